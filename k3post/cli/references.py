"""`check_references(recipe, file)`: the names a training recipe gives to things k3post looks up
by name - each reward function (`fn: rewards.<module>:<function>`) and each built-in prompt set
(`builtin:<name>`) - exist, checked at `k3post validate` and before `k3post run` starts anything.

The schema checks their shape only (`<module>:<function>`; any string after `builtin:`): whether a
module has the function is known once it is imported, and a typo found only then - when a Ray
actor builds the reward pool - reaches the user as a message naming no file and no key. Here each
one is a `UserError` shaped `FILE: KEY.PATH: what; did you mean 'NEAREST'?` (config/errors.py).
Importing a reward module runs its top level, as the run would.
"""

from __future__ import annotations

from pathlib import Path

from k3post.config.errors import UserError, located
from k3post.data.builtin_prompts import builtin_prompt_names, unknown_set_message
from k3post.rewards.loader import load_reward

BUILTIN = "builtin:"
PROMPT_FIELDS = ("prompts", "heldout_prompts", "examples")  # distill / rl sources, and sft ones


def check_builtin_sets(recipe, file: str | Path | None) -> None:
    """Every `builtin:<name>` of a data source names a shipped prompt set."""
    for i, source in enumerate(recipe.data.sources):
        for field in PROMPT_FIELDS:
            spec = getattr(source, field, None)
            name = spec[len(BUILTIN):] if isinstance(spec, str) and spec.startswith(BUILTIN) else None
            if name is not None and name not in builtin_prompt_names():
                raise UserError(located(file, unknown_set_message(name), key=f"data.sources[{i}].{field}"))


def check_reward_functions(recipe, file: str | Path | None) -> None:
    """Every `fn:` of a data source's rewards imports and names a callable (rewards/loader.py)."""
    for i, source in enumerate(recipe.data.sources):
        for j, use in enumerate(getattr(source, "rewards", None) or []):
            if use.fn is None:
                continue
            try:
                load_reward(use.fn)
            except UserError as err:
                raise UserError(located(file, str(err), key=f"data.sources[{i}].rewards[{j}].fn")) from None


def check_references(recipe, file: str | Path | None) -> None:
    """Built-in prompt sets, then reward functions (the cheaper check first)."""
    check_builtin_sets(recipe, file)
    check_reward_functions(recipe, file)
