"""`check_references(recipe, file)`: the names a recipe gives to things k3post looks up by name -
each reward function (`fn: rewards.<module>:<function>`, an eval task's `verifier:
<module>:<function>`) and each built-in prompt set (`builtin:<name>`) - exist, checked at
`k3post validate` and before `k3post run` starts anything: in training recipes, in eval recipes'
tasks, and in every stage recipe of a pipeline.

The schema checks their shape only (`<module>:<function>`; any string after `builtin:`): whether a
module has the function is known once it is imported, and a typo found only then - when a Ray
actor builds the reward pool - reaches the user as a message naming no file and no key. Here each
one is a `UserError` shaped `FILE: KEY.PATH: what; did you mean 'NEAREST'?` (config/errors.py).
Importing a reward module runs its top level, as the run would.
"""

from __future__ import annotations

from pathlib import Path

from k3post.config.errors import UserError, located
from k3post.config.suggest import did_you_mean
from k3post.data.builtin_prompts import builtin_prompt_names, unknown_set_message
from k3post.data.eval_sets import eval_set_names
from k3post.rewards.loader import load_reward

BUILTIN = "builtin:"
PROMPT_FIELDS = ("prompts", "heldout_prompts", "examples")  # distill / rl sources, and sft ones


def builtin_name(spec) -> str | None:
    """`name` of a `builtin:<name>` data spec; None for anything else (a file, a hub set)."""
    return spec[len(BUILTIN):] if isinstance(spec, str) and spec.startswith(BUILTIN) else None


def check_function(fn: str, file: str | Path | None, key: str) -> None:
    """`<module>:<function>` imports and names a callable (rewards/loader.py), else a located error."""
    try:
        load_reward(fn)
    except UserError as err:
        raise UserError(located(file, str(err), key=key)) from None


def check_builtin_sets(recipe, file: str | Path | None) -> None:
    """Every `builtin:<name>` of a data source names a shipped prompt set."""
    for i, source in enumerate(recipe.data.sources):
        for field in PROMPT_FIELDS:
            name = builtin_name(getattr(source, field, None))
            if name is not None and name not in builtin_prompt_names():
                raise UserError(located(file, unknown_set_message(name), key=f"data.sources[{i}].{field}"))


def check_reward_functions(recipe, file: str | Path | None) -> None:
    """Every `fn:` of a data source's rewards imports and names a callable."""
    for i, source in enumerate(recipe.data.sources):
        for j, use in enumerate(getattr(source, "rewards", None) or []):
            if use.fn is not None:
                check_function(use.fn, file, f"data.sources[{i}].rewards[{j}].fn")


def check_eval_tasks(recipe, file: str | Path | None) -> None:
    """An eval recipe's tasks: each `builtin:` set is a shipped eval or prompt set, and each
    `<module>:<function>` verifier imports and names a callable."""
    known = sorted(set(eval_set_names()) | set(builtin_prompt_names()))
    for i, task in enumerate(recipe.tasks):
        for field in ("data", "prompts"):
            name = builtin_name(getattr(task, field, None))
            if name is not None and name not in known:
                what = (f"unknown built-in set {name!r}{did_you_mean(name, known, shown='builtin:{}')} "
                        f"(known sets: {', '.join(known)})")
                raise UserError(located(file, what, key=f"tasks[{i}].{field}"))
        verifier = getattr(task, "verifier", None)
        if isinstance(verifier, str) and ":" in verifier:
            check_function(verifier, file, f"tasks[{i}].verifier")


def check_pipeline_stages(recipe, file: str | Path) -> None:
    """Every stage recipe of a pipeline, loaded with its overrides, and its names checked."""
    from k3post.config.load import load_recipe  # noqa: PLC0415 (config.load imports this layer's callers)

    for i, stage in enumerate(recipe.stages):
        stage_file = Path(file).parent / stage.recipe
        try:
            check_references(load_recipe(stage_file, stage.overrides), stage_file)
        except UserError as err:
            raise UserError(f"{located(file, f'stage {stage.name!r}', key=f'stages[{i}].recipe')}: {err}") from None


def check_references(recipe, file: str | Path | None) -> None:
    """Built-in prompt sets, then reward functions (the cheaper check first), for any kind."""
    if recipe.kind == "pipeline":
        check_pipeline_stages(recipe, file)
    elif recipe.kind == "eval":
        check_eval_tasks(recipe, file)
    elif recipe.kind in ("distill", "sft", "rl"):
        check_builtin_sets(recipe, file)
        check_reward_functions(recipe, file)
