"""Supervised fine-tuning examples: a prompt conversation plus the assistant reply to learn.

Rows come through the same loaders as prompts (data/sources.py: builtin sets, jsonl, json,
parquet). A row is an SFT example when its conversation already ends with an assistant turn,
or when it has a completion field (`completion`, or `answer` for the built-in math set); the
reply becomes the final assistant message, and only its tokens carry loss.
"""

from __future__ import annotations

from k3post.config.errors import UserError


def as_sft_rows(rows: list[dict], completion_field: str, label: str) -> list[dict]:
    """Rows whose messages end with the assistant reply to train on."""
    out = []
    for index, row in enumerate(rows):
        messages = list(row["messages"])
        if messages and messages[-1][0] == "assistant":
            out.append(row)
            continue
        reply = row.get(completion_field)
        if not isinstance(reply, str) or not reply.strip():
            raise UserError(f"{label}: row {index}: an SFT example needs a final assistant message or a "
                            f"non-empty string field '{completion_field}'")
        out.append({**row, "messages": messages + [("assistant", reply)]})
    return out


def split_reply(messages: tuple[tuple[str, str], ...]) -> tuple[list[dict[str, str]], str]:
    """(the conversation before the reply as chat dicts, the reply text)."""
    *context, (role, reply) = messages
    if role != "assistant":
        raise ValueError("an SFT example must end with an assistant message")
    return [{"role": r, "content": c} for r, c in context], reply
