"""The run directory's contract.

- `check_run_dir` (reads only): the path is a directory or can become one; a run already there
  has a readable `recipe.resolved.yaml`. Called before anything is written.
- `prepare_run_dir`: the resolved recipe written before anything else; the refusal to resume a
  run made from a different recipe; a checkpoint marked COMPLETE whose files are missing or cut
  short (copied without its weights, a disk that filled) moved aside to `.step-N.broken`, with a
  warning naming it, so that the resume falls back to the previous complete one.

Nothing here writes until the recipe, the models and the data have passed their checks: the
caller runs those first (cli/inputs.py `check_inputs`), then `prepare_run_dir`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from k3post.config.errors import UserError, located
from k3post.config.load import dump_recipe, read_yaml
from k3post.track.atomic import latest_checkpoint, list_checkpoints, write_text_atomic
from k3post.track.checkpoint_files import checkpoint_problem

RESOLVED = "recipe.resolved.yaml"


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b, path = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed_keys(a, b, path + ".")
        elif a != b:
            keys.append(path)
    return keys


def _without(data, path: tuple):
    """`data` (nested dicts and lists) without the key at `path`."""
    head, *rest = path
    if isinstance(data, list) and isinstance(head, int) and 0 <= head < len(data):
        return [_without(v, tuple(rest)) if i == head else v for i, v in enumerate(data)] if rest else data
    if not isinstance(data, dict) or head not in data:
        return data
    if not rest:
        return {k: v for k, v in data.items() if k != head}
    return {**data, head: _without(data[head], tuple(rest))}


# Top-level keys k3post has renamed since a run could have been made, per recipe kind (old -> new).
RENAMED = {"sft": {"model": "student"}}


def _with_current_defaults(old: dict, schema) -> dict:
    """A run's saved recipe as this k3post reads it: keys renamed since under their new names,
    with the defaults of keys added since (the run had those defaults' behaviour) and without keys
    removed since (e.g. vLLM's enable_sleep_mode, which never did anything), so that upgrading
    k3post does not make a resume look like a new recipe."""
    from pydantic import ValidationError  # noqa: PLC0415

    for before, after in RENAMED.get(old.get("kind"), {}).items():
        if before in old and after not in old:
            old = {(after if k == before else k): v for k, v in old.items()}

    try:
        return schema.model_validate(old).model_dump(mode="json")
    except ValidationError as err:  # pydantic reports every unknown key of the tree at once
        for loc in (e["loc"] for e in err.errors() if e["type"] == "extra_forbidden"):
            old = _without(old, tuple(loc))
    try:
        return schema.model_validate(old).model_dump(mode="json")
    except ValidationError:  # a value this schema rejects: compare as saved
        return old


def check_run_dir(run_dir: Path, restart: bool = False) -> None:
    """The run directory can be used: a directory (or a path where one can be made, not under a
    file), whose saved recipe, if any, can be read. Writes nothing."""
    run_dir = Path(run_dir)
    for path in (run_dir, *run_dir.parents):
        if path.exists() and not path.is_dir():
            where = "is a file" if path == run_dir else f"is inside {path}, which is a file"
            raise UserError(located(run_dir, f"--run-dir {where}; expected a directory (or a path where one can "
                                             "be made)"))
    checkpoints = run_dir / "checkpoints"
    if checkpoints.exists() and not checkpoints.is_dir():
        raise UserError(located(checkpoints, "expected the run's checkpoint directory, found a file"))
    resolved = run_dir / RESOLVED
    resumes = checkpoints.is_dir() and latest_checkpoint(checkpoints) is not None and not restart
    if resumes and not (resolved.exists() or resolved.is_symlink()):
        raise UserError(located(resolved, "missing: this run directory holds checkpoints but not the recipe that made "
                                          "them, so k3post cannot tell whether they come from this recipe; put the "
                                          "file back, use another --run-dir, or pass --restart to discard them"))
    if resumes:  # without checkpoints the saved recipe is rewritten, whatever it holds
        try:
            read_yaml(resolved, "saved recipe")
        except UserError as err:
            raise UserError(f"{err}\n{run_dir}: this run directory's saved recipe ({RESOLVED}) cannot be read, so "
                            "the run cannot be resumed; use another --run-dir, or pass --restart to start over "
                            "here") from None


def set_aside_broken_checkpoints(checkpoints: Path) -> list[Path]:
    """Move checkpoints that are marked COMPLETE but cannot be resumed from to `.step-N.broken`
    (list_checkpoints ignores dot-names), newest first, stopping at the first good one: the
    resume then starts from the previous complete checkpoint. A warning names each."""
    moved = []
    for step, path in reversed(list_checkpoints(checkpoints)):
        problem = checkpoint_problem(path)
        if problem is None:
            break
        target = path.parent / f".{path.name}.broken"
        suffix = 1
        while target.exists():
            target, suffix = path.parent / f".{path.name}.broken-{suffix}", suffix + 1
        path.rename(target)
        moved.append(target)
        earlier = [p for s, p in list_checkpoints(checkpoints) if s < step]
        then = (f"resuming from {earlier[-1].name} if it is whole" if earlier
                else "no earlier checkpoint: training starts from step 0")
        print(f"k3post: warning: {path} is marked complete but cannot be resumed from ({problem}); moved it to "
              f"{target.name} (kept, not deleted); {then}", file=sys.stderr)
    return moved


# Changes a resume can take: more steps (the schedule's end moves), and where and on how many
# processes the run computes (the learner's ranks reshard its checkpoint; placement, buckets and
# recomputation change no result), where the metrics go (`track`) and how many held-out prompts
# are evaluated (no training result depends on it; runs saved by earlier versions wrote
# the old default, 8, which the new default, every held-out prompt, would otherwise refuse).
RESUMABLE = ("train.steps", "resources.", "ray.", "learner.placement", "learner.weight_bucket_mb",
             "learner.activation_checkpointing", "learner.sharding", "track", "eval.prompts_per_source")


def resumable_change(key: str) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE)


def _check_steps_reach(recipe, run_dir: Path, restart: bool) -> None:
    """A resume must have steps left, or at least none taken away: `train.steps` below the newest
    checkpoint's step would end the run at once, past the steps asked for."""
    found = None if restart else latest_checkpoint(run_dir / "checkpoints")
    steps = recipe.train.steps
    if found is not None and found[0] > steps:
        raise UserError(f"{run_dir}: its newest checkpoint is {found[1].name}, past train.steps={steps}: the run "
                        f"would end at once with {found[0]} steps, not {steps}. Use another --run-dir, pass "
                        f"train.steps={found[0]} or more to go on, or --restart to train {steps} steps from scratch")


def prepare_run_dir(recipe, run_dir: Path, restart: bool) -> None:
    """Write the resolved recipe; refuse to resume a run made from a different recipe; set broken
    checkpoints aside. Call after the inputs' checks: this is the first write into `run_dir`."""
    check_run_dir(run_dir, restart)
    resolved = run_dir / RESOLVED
    if not restart:
        set_aside_broken_checkpoints(run_dir / "checkpoints")
    has_checkpoint = latest_checkpoint(run_dir / "checkpoints") is not None
    if resolved.is_file() and has_checkpoint and not restart:
        changed = _changed_keys(_with_current_defaults(read_yaml(resolved, "saved recipe"), type(recipe)),
                                recipe.model_dump(mode="json"))
        changed = [k for k in changed if not resumable_change(k)]
        if changed:
            raise UserError(
                f"{run_dir} holds a run of a different recipe (changed: {', '.join(changed)}). "
                f"Use another --run-dir, or pass --restart to discard its checkpoints.")
    _check_steps_reach(recipe, run_dir, restart)
    if restart and has_checkpoint:
        import shutil  # noqa: PLC0415

        shutil.rmtree(run_dir / "checkpoints")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(resolved, dump_recipe(recipe))
