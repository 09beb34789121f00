"""Loading an evaluation recipe, keeping what is valid.

`load_eval_recipe(path, overrides)` works like `load_recipe` (teachers inlined from their
files, dotted overrides, relative paths made absolute, errors naming the file and key path)
with one difference: each task and each student is validated on its own first. An entry that
fails (an unknown task kind, a typo in a key, a student with two sources) becomes a *problem*
— a message naming the file and the entry — and is left out; the rest of the recipe loads and
is evaluated, and the report lists the problems. Anything else wrong (a top-level key, the
sampling section) still fails the whole file.

`strict=True` (what `k3post validate` and `load_recipe` use) turns any problem into an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from k3post.config.errors import RecipeError, shorten
from k3post.config.eval_schema import TASK_KINDS, EvalRecipe, KLTask, StudentSpec
from k3post.config.recipe_files import (absolute_model_paths, inline_teachers, apply_overrides,
                                        format_validation_error, read_yaml, validate)

_PASSTHROUGH = ("builtin:", "hub:")


@dataclass
class LoadedEval:
    recipe: EvalRecipe
    problems: list[dict] = field(default_factory=list)  # {"entry": "tasks[2]", "name": ..., "error": ...}
    source: Path | None = None


def _absolute(value: object, base: Path) -> object:
    if isinstance(value, str) and not value.startswith(_PASSTHROUGH) and value != "export":
        return str((base / Path(value).expanduser()).resolve())
    return value


def _absolute_paths(data: dict, base: Path) -> None:
    for entry in (data.get("students") or {}).values() if isinstance(data.get("students"), dict) else []:
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("model"), dict):
            absolute_model_paths(entry["model"], base)
        for key in ("run", "fp8"):
            if key in entry:
                entry[key] = _absolute(entry[key], base)
    for task in data.get("tasks") or [] if isinstance(data.get("tasks"), list) else []:
        for key in ("data", "prompts"):
            if isinstance(task, dict) and key in task:
                task[key] = _absolute(task[key], base)


def _problem(source: Path, entry: str, name: object, err: ValidationError) -> dict:
    return {"entry": entry, "name": name, "error": format_validation_error(source, err, prefix=entry)}


def _keep_valid_tasks(data: dict, source: Path) -> list[dict]:
    tasks, problems = data.get("tasks"), []
    if not isinstance(tasks, list):
        return problems  # the schema reports it
    teachers = data.get("teachers") if isinstance(data.get("teachers"), dict) else {}
    kept = []
    for i, task in enumerate(tasks):
        name = task.get("name") if isinstance(task, dict) else None
        kind = task.get("kind") if isinstance(task, dict) else None
        if not isinstance(kind, str) or kind not in TASK_KINDS:
            problems.append({"entry": f"tasks[{i}]", "name": name, "error": (
                f"{source}: tasks[{i}].kind: unknown task type {shorten(kind)} (expected one of "
                f"{', '.join(TASK_KINDS)})")})
            continue
        try:
            parsed = TASK_KINDS[kind].model_validate(task)
        except ValidationError as err:
            problems.append(_problem(source, f"tasks[{i}]", name, err))
            continue
        unknown = [t for t in parsed.teachers or [] if t not in teachers] if isinstance(parsed, KLTask) else []
        if isinstance(parsed, KLTask) and (unknown or not teachers):
            problems.append({"entry": f"tasks[{i}]", "name": name, "error": (
                f"{source}: tasks[{i}].teachers: {unknown or 'none'} not among the recipe's teachers "
                f"({', '.join(teachers) or 'none'})")})
            continue
        kept.append(task)
    data["tasks"] = kept
    return problems


def _keep_valid_students(data: dict, source: Path) -> list[dict]:
    students, problems = data.get("students"), []
    if not isinstance(students, dict):
        return problems
    for name in list(students):
        try:
            StudentSpec.model_validate(students[name])
        except ValidationError as err:
            problems.append(_problem(source, f"students.{name}", name, err))
            del students[name]
    return problems


def load_eval_recipe(path: str | Path, overrides: list[str] | None = None, strict: bool = False) -> LoadedEval:
    path = Path(path)
    data = read_yaml(path)
    if data.get("kind") != "eval":
        raise RecipeError(f"{path}: kind: expected 'eval' for this command (got {shorten(data.get('kind'))})")
    inline_teachers(data, path)
    apply_overrides(data, overrides or [], path)
    _absolute_paths(data, path.parent)
    problems = _keep_valid_tasks(data, path) + _keep_valid_students(data, path)
    if problems and (strict or not data.get("tasks")):
        raise RecipeError("\n".join(p["error"] for p in problems))
    return LoadedEval(validate(EvalRecipe, data, path), problems, path)
