"""The prompt-length policy of a recipe's `data` section (distill, rl and sft recipes).

    data:
      max_prompt_tokens: 2048      # a prompt (chat template applied, before the reply) longer than this...
      long_prompts: refuse         # ...stops the run before it starts, naming the file and the row (default)
                    truncate_left  # ...keeps its end: oldest turns dropped, then the first kept turn cut from the left
                    drop           # ...is left out; data/long_prompts_dropped/<source> counts them in metrics.jsonl

Without a limit one bad row (a million-character prompt) reaches the model and asks the
allocator for a terabyte. The choice is the user's; the default refuses, because silently
changing the data is the surprise a user least wants. k3post/data/prompt_length.py applies it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from k3post.config.base import Strict

LongPrompts = Literal["refuse", "truncate_left", "drop"]


class PromptLimitSpec(Strict):
    """Keys every data section shares (its subclasses: DataSpec, RlDataSpec, SftDataSpec)."""

    max_prompt_tokens: PositiveInt = Field(2048, description=(
        "the longest prompt, in the student's tokens with its chat template applied (SFT: the conversation "
        "before the reply)"))
    long_prompts: LongPrompts = Field("refuse", description=(
        "a longer prompt: refuse stops the run before it starts, naming the file and row; truncate_left keeps "
        "its end (oldest turns dropped first); drop leaves the row out"))
