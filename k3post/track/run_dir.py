"""The run directory's contract: the resolved recipe written before anything else, and the
refusal to resume a run that was made from a different recipe."""

from __future__ import annotations

from pathlib import Path

from k3post.config.errors import UserError
from k3post.config.load import dump_recipe
from k3post.track.atomic import latest_checkpoint, write_text_atomic

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


def _with_current_defaults(old: dict, schema) -> dict:
    """A run's saved recipe as this k3post reads it: with the defaults of keys added since (the
    run had those defaults' behaviour) and without keys removed since (e.g. vLLM's
    enable_sleep_mode, which never did anything), so that upgrading k3post does not make a resume
    look like a new recipe."""
    from pydantic import ValidationError  # noqa: PLC0415

    try:
        return schema.model_validate(old).model_dump(mode="json")
    except ValidationError as err:  # pydantic reports every unknown key of the tree at once
        for loc in (e["loc"] for e in err.errors() if e["type"] == "extra_forbidden"):
            old = _without(old, tuple(loc))
    try:
        return schema.model_validate(old).model_dump(mode="json")
    except ValidationError:  # a value this schema rejects: compare as saved
        return old


def prepare_run_dir(recipe, run_dir: Path, restart: bool) -> None:
    """Write the resolved recipe; refuse to resume a run made from a different recipe."""
    import yaml  # noqa: PLC0415

    resolved = run_dir / RESOLVED
    has_checkpoint = latest_checkpoint(run_dir / "checkpoints") is not None
    if resolved.is_file() and has_checkpoint and not restart:
        changed = _changed_keys(_with_current_defaults(yaml.safe_load(resolved.read_text()), type(recipe)),
                                recipe.model_dump(mode="json"))
        # More steps is the one change a resume can take: the schedule's end moves, nothing else.
        changed = [k for k in changed if k != "train.steps"]
        if changed:
            raise UserError(
                f"{run_dir} holds a run of a different recipe (changed: {', '.join(changed)}). "
                f"Use another --run-dir, or pass --restart to discard its checkpoints.")
    if restart and has_checkpoint:
        import shutil  # noqa: PLC0415

        shutil.rmtree(run_dir / "checkpoints")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(resolved, dump_recipe(recipe))
