"""The prompt-length policy: what happens to a row whose prompt is longer than the recipe allows
(`data.max_prompt_tokens`, `data.long_prompts`; config/data_limits.py).

A prompt's length is counted the way the samplers see it: the chat template applied to its
messages, with the generation prompt (`<|im_start|>assistant\\n`) at the end. For an SFT example the
prompt is the conversation before the reply (the reply has its own cap, max_completion_tokens).

- refuse: a UserError naming the file, the row, and the length against the limit.
- truncate_left: keep the end of the conversation (what the reply answers). Oldest turns that are
  not system prompts are dropped first; when one turn is left, its text is cut from the left by
  the number of tokens over the limit (re-counted: cutting text can change how its edge tokenises).
  A row whose system prompt and template alone exceed the limit cannot be truncated: refused.
- drop: the row is left out; the counts come back for the metrics (data/long_prompts_dropped/<source>).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3post.config.errors import UserError, located

Messages = list[tuple[str, str]]


@dataclass
class LengthReport:
    """Rows of one source the policy changed, by row index (0-based, as in error messages)."""

    dropped: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)


def prompt_tokens(tokenizer: Any, messages: Messages) -> int:
    """Tokens of `messages` rendered by the chat template, ready for the reply."""
    ids = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                        add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return len(ids)


def truncate_left(tokenizer: Any, messages: Messages, max_tokens: int) -> Messages | None:
    """The end of `messages` that fits in `max_tokens` (see the module docstring); None if even the
    last turn cut to nothing does not fit."""
    msgs = list(messages)
    for _ in range(len(msgs) + 8):  # each pass drops a turn or cuts text; a few re-counts at most
        over = prompt_tokens(tokenizer, msgs) - max_tokens
        if over <= 0:
            return msgs
        older = [i for i, (role, _) in enumerate(msgs[:-1]) if role != "system"]
        if older:
            del msgs[older[0]]
            continue
        role, text = msgs[-1]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        keep = len(ids) - over
        if keep <= 0:
            return None
        msgs[-1] = (role, tokenizer.decode(ids[-keep:]))
    return None


def _prompt_of(row: dict, sft: bool) -> tuple[Messages, Messages]:
    """(the prompt's messages, what follows them: the SFT reply, or nothing)."""
    messages = [tuple(m) for m in row["messages"]]
    return (messages[:-1], messages[-1:]) if sft else (messages, [])


def limit_prompt_lengths(rows: list[dict], tokenizer: Any, max_tokens: int, policy: str, label: str,
                         sft: bool = False) -> tuple[list[dict], LengthReport]:
    """Apply the policy to every row of one source; returns the rows to train on and what changed."""
    kept, report = [], LengthReport()
    for index, row in enumerate(rows):
        prompt, reply = _prompt_of(row, sft)
        length = prompt_tokens(tokenizer, prompt)
        if length <= max_tokens:
            kept.append(row)
            continue
        if policy == "drop":
            report.dropped.append(index)
            continue
        short = truncate_left(tokenizer, prompt, max_tokens) if policy == "truncate_left" else None
        if short is None:
            why = ("data.long_prompts is refuse; set it to truncate_left or drop, or raise data.max_prompt_tokens"
                   if policy == "refuse" else "its system prompt and chat template alone exceed the limit")
            raise UserError(located(label, f"the prompt is {length:,} tokens, more than data.max_prompt_tokens="
                                           f"{max_tokens} ({why})", row=index))
        report.truncated.append(index)
        kept.append({**row, "messages": short + reply})
    if not kept:
        raise UserError(located(label, f"every row is longer than data.max_prompt_tokens={max_tokens} and was "
                                       "dropped; nothing is left to train on"))
    return kept, report


def length_metrics(reports: dict[str, LengthReport]) -> dict[str, int]:
    """The counts for metrics.jsonl (logged once, with step 0), per source."""
    out = {}
    for source, report in reports.items():
        out[f"data/long_prompts_dropped/{source}"] = len(report.dropped)
        out[f"data/long_prompts_truncated/{source}"] = len(report.truncated)
    return out


def within_limit(rows: list[dict], tokenizer: Any, data: Any, label: str,
                 sft: bool = False) -> tuple[list[dict], LengthReport]:
    """The rows a run trains on under a recipe's `data` section (its max_prompt_tokens and
    long_prompts), and what the policy changed: what the launch builders call on each source's rows."""
    return limit_prompt_lengths(rows, tokenizer, data.max_prompt_tokens, data.long_prompts, label, sft)
