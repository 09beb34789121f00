"""A teacher's run-long prompt prefix: what it encodes once, and what it counts.

A teacher is frozen, and every prompt it scores starts with the same tokens: its system prompt
and the chat template's fixed head (`<|im_start|>system\\n… <|im_end|>\\n<|im_start|>user\\n`).
`template_head` finds those tokens by rendering the template around two user messages that
share nothing and keeping the common token prefix; the teacher encodes them once
(model/scoring/prefix_scoring.py: `PrefixStore`, keyed on the ids) and scores every batch as their
continuation, each distinct prompt of the batch once. A row that does not start with them (a
prompt with its own system turn) is scored the uncached way, so the prefix can only save work,
never change a score. A family that cannot take the cache at all (Kimi Linear) or only while a
batch fits its sliding window says so in one line at start.

Counted per scoring call and handed to the metrics (`take_counts`, summed over replicas):
prompt tokens of the rows, how many of them the decoder ran, rows that fell back, and seconds.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from k3post.model.scoring.logprobs import completion_hidden_states
from k3post.model.scoring.prefix_scoring import (PrefixStats, PrefixStore, cache_unsupported, common_prefix,
                                         prefixed_hidden_states, window_note)
from k3post.model.generation.sampling import render_prompts
from k3post.types import Prompt

# Two user messages with no character in common at the start: their renderings share exactly
# the template's head (a merge across the seam, if any, is excluded by the common prefix).
PROBES = ("0", "Zebra?")


def template_head(tokenizer: PreTrainedTokenizerBase, system_prompt: str | None) -> list[int]:
    """The token ids every prompt rendered with `system_prompt` through the tokenizer's chat
    template starts with."""
    probes = [Prompt(f"probe-{i}", "", "", (("user", text),)) for i, text in enumerate(PROBES)]
    try:
        return common_prefix(render_prompts(tokenizer, probes, system_prompt))
    except ValueError:  # no chat template: the rows are the sampler's ids, with no known head
        return []


class TeacherPrefix:
    """The hidden states a teacher scores from, through its cached prefix when it has one."""

    def __init__(self, name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, enabled: bool,
                 system_prompt: str | None):
        """`system_prompt`: the one the rows this teacher scores were rendered with."""
        self.model, self.enabled = model, enabled
        reason = cache_unsupported(model) if enabled else None
        if reason is not None:
            print(f"k3post: teacher '{name}' scores every prompt whole (no prefix cache): {reason}")
            self.enabled = False
        window = window_note(model) if self.enabled else None
        if window is not None:
            print(f"k3post: teacher '{name}' prefix cache: {window} (counted in teacher/fallback_rows/{name})")
        self.ids = template_head(tokenizer, system_prompt) if self.enabled else []
        self.store = PrefixStore(model)
        self.counts: dict[str, float] = {}

    def hidden_states(self, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor,
                      pad_id: int) -> torch.Tensor:
        """The final hidden states that predict each completion token, [B, T, H]."""
        if self.enabled:
            h_BTH, stats = prefixed_hidden_states(self.model, self.store.get(self.ids), prompt_ids, completion_ids_BT,
                                                  loss_mask_BT, pad_id)
        else:
            h_BTH = completion_hidden_states(self.model, prompt_ids, completion_ids_BT, loss_mask_BT, pad_id)
            total = sum(len(p) for p in prompt_ids)
            stats = PrefixStats(total, total)
        self._add({"prompt_tokens": stats.prompt_tokens, "prompt_tokens_encoded": stats.encoded_prompt_tokens,
                   "fallback_rows": stats.fallback_rows})
        return h_BTH

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Adds the block's wall time to `score_seconds` (the block ends with its results on the
        host, so on a GPU the kernels are done)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._add({"score_seconds": time.perf_counter() - started})

    def _add(self, counts: dict[str, float]) -> None:
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0.0) + float(value)

    def take_counts(self) -> dict[str, float]:
        """The counts since the last call (then reset)."""
        counts, self.counts = self.counts, {}
        return counts
