"""The teacher system prompts of the prefix-cache benchmarks, and the docs section their rows go to.

bench/teachers/teacher_prefix_cache.py, bench/opd/opd_step_gpu.py (`--teacher-system-tokens`) and
bench/teachers/vllm_teacher_recompute.py give their teachers the same style guide cut to N tokens, so their
figures compare.
"""

from __future__ import annotations

SECTION = "Teacher prompt-prefix cache (`bench/teachers/teacher_prefix_cache.py`)"
GUIDE = ("Answer in plain sentences. Keep every reply under five sentences unless asked for more. Use metric units. "
         "Define each acronym the first time it appears. Never use exclamation marks. Prefer active voice. ")


def system_prompt(tokenizer, tokens: int) -> str | None:
    """The style guide repeated and cut to `tokens` tokens (None for 0)."""
    if tokens == 0:
        return None
    ids = tokenizer.encode(GUIDE * (tokens // 20 + 2), add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids)
