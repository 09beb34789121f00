"""Loading recipes: YAML files → typed, validated, self-contained recipe objects.

Order of work for a recipe file:
1. parse the YAML (syntax errors name the file and line);
2. inline every teacher named by file (`teachers: {chat: teachers/chat.yaml}`), validating
   each teacher file on its own so its errors name that file;
3. apply the command line's dotted overrides (`optim.lr=1e-5`);
4. make relative paths absolute (relative to the file that wrote them);
5. validate against the schema; errors name the file, the key path and what was expected.

The result is self-contained: `dump_recipe` writes it back as YAML with the teachers inline,
which is what a run directory keeps (`recipe.resolved.yaml`) and what resume reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from k3post.config.errors import RecipeError
from k3post.config.pipeline_schema import PipelineRecipe
from k3post.config.schema import RECIPE_KINDS, DistillRecipe, ModelSpec, RlRecipe, SftRecipe, Strict, TeacherSpec


def read_yaml(path: Path) -> dict[str, Any]:
    """Parse one YAML mapping; any failure is a RecipeError naming the file."""
    if not path.is_file():
        raise RecipeError(f"{path}: file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{path}:{where}: not valid YAML: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


def format_validation_error(source: Path, err: ValidationError, prefix: str = "") -> str:
    """One line per problem: `file: key.path: what was expected (got ...)`."""
    lines = []
    for problem in err.errors():
        loc = _format_loc(problem["loc"], prefix)
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; see docs/recipes.md for the keys)"
        got = problem.get("input")
        suffix = "" if problem["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{source}: {loc or '<top level>'}: {message}{suffix}")
    return "\n".join(lines)


def _format_loc(loc: tuple, prefix: str) -> str:
    parts = [prefix] if prefix else []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif not str(item).startswith("function-after"):
            parts.append(str(item))
    return ".".join(parts)


def validate(cls: type[Strict], data: dict, source: Path, prefix: str = "") -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(source, err, prefix)) from None


def apply_overrides(data: dict, overrides: list[str], source: Path) -> dict:
    """Set `a.b.c=value` entries (values parsed as YAML: `1e-5`, `true`, `[0, 1]`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"override '{item}': expected KEY.PATH=VALUE, e.g. optim.lr=1e-5")
        node = data
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parents[: i + 1])
                raise RecipeError(f"override '{item}': {where} is a value, not a section, in {source}")
            node = child
        try:
            node[leaf] = yaml.safe_load(raw)
        except yaml.YAMLError:
            node[leaf] = raw
    return data


def _absolute_model_paths(model: dict, base: Path) -> None:
    for key in ("path", "gguf"):
        if isinstance(model.get(key), str):
            model[key] = str((base / model[key]).resolve())
    kimi = model.get("kimi")
    for key in ("tokenizer_from", "init_embeddings_from"):  # nested model specs of a Kimi student
        if isinstance(kimi, dict) and isinstance(kimi.get(key), dict):
            _absolute_model_paths(kimi[key], base)


def load_teacher(path: Path) -> dict:
    """Read and validate one teacher file; returns its data with absolute paths."""
    data = read_yaml(path)
    if isinstance(data.get("model"), dict):
        _absolute_model_paths(data["model"], path.parent)
    validate(TeacherSpec, data, path)
    return data


def _inline_teachers(data: dict, source: Path) -> None:
    teachers = data.get("teachers")
    if not isinstance(teachers, dict):
        return  # the schema reports the missing/ill-typed section
    for name, ref in teachers.items():
        if isinstance(ref, str):
            path = (source.parent / ref).resolve()
            if not path.is_file():
                raise RecipeError(f"{source}: teachers.{name}: teacher file '{ref}' not found (resolved to {path})")
            teachers[name] = load_teacher(path)
        elif isinstance(ref, dict) and isinstance(ref.get("model"), dict):
            _absolute_model_paths(ref["model"], source.parent)


def _absolute_data_paths(data: dict, source: Path) -> None:
    for key in ("student", "model"):
        if isinstance(data.get(key), dict):
            _absolute_model_paths(data[key], source.parent)
    reward_models = data.get("reward_models")
    for spec in reward_models.values() if isinstance(reward_models, dict) else []:
        if isinstance(spec, dict) and isinstance(spec.get("path"), str):
            spec["path"] = str((source.parent / spec["path"]).resolve())
    sources = (data.get("data") or {}).get("sources") if isinstance(data.get("data"), dict) else None
    for entry in sources or []:
        for key in ("prompts", "examples"):
            value = entry.get(key) if isinstance(entry, dict) else None
            if isinstance(value, str) and not value.startswith("builtin:"):
                entry[key] = str((source.parent / value).resolve())


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Strict:
    """Load any recipe file (its `kind` picks the schema), fully validated."""
    path = Path(path)
    data = read_yaml(path)
    kind = data.get("kind")
    if kind == "eval":  # its own loader (config/eval_load.py); strict here: any bad entry is an error
        from k3post.config.eval_load import load_eval_recipe  # noqa: PLC0415 - it imports this module

        return load_eval_recipe(path, overrides, strict=True).recipe
    if kind == "pipeline":
        return load_pipeline(path)
    if kind not in RECIPE_KINDS:
        known = ", ".join(sorted([*RECIPE_KINDS, "eval", "pipeline"]))
        raise RecipeError(f"{path}: kind: expected one of {known} (got {kind!r})")
    if kind == "teacher":
        return validate(TeacherSpec, apply_overrides(load_teacher(path), overrides or [], path), path)
    _inline_teachers(data, path)
    apply_overrides(data, overrides or [], path)
    _absolute_data_paths(data, path)
    return validate(RECIPE_KINDS[kind], data, path)


def load_pipeline(path: Path) -> PipelineRecipe:
    """A pipeline recipe with every stage's recipe file loaded (with its overrides) and checked,
    so a broken last stage fails before the first one trains."""
    recipe = validate(PipelineRecipe, read_yaml(path), path)
    for i, stage in enumerate(recipe.stages):
        stage_file = path.parent / stage.recipe
        if not stage_file.is_file():
            raise RecipeError(f"{path}: stages[{i}].recipe: file not found: {stage_file}")
        kind = read_yaml(stage_file).get("kind")
        if kind not in ("sft", "distill", "rl", "eval"):
            raise RecipeError(f"{path}: stages[{i}].recipe: {stage_file} has kind {kind!r}; a stage is an sft, "
                              f"distill, rl or eval recipe")
        if kind == "eval" and stage.student_from:
            raise RecipeError(f"{path}: stages[{i}]: an eval stage takes students_from, not student_from")
        if kind != "eval" and stage.students_from:
            raise RecipeError(f"{path}: stages[{i}]: students_from is for eval stages; use student_from")
        load_recipe(stage_file, stage.overrides)
    return recipe


def load_distill_recipe(path: str | Path, overrides: list[str] | None = None) -> DistillRecipe:
    recipe = load_recipe(path, overrides)
    if not isinstance(recipe, DistillRecipe):
        raise RecipeError(f"{path}: kind: expected 'distill' for this command (got '{recipe.kind}')")
    return recipe


def load_run_recipe(path: str | Path, overrides: list[str] | None = None) -> DistillRecipe | SftRecipe | RlRecipe:
    """A recipe `k3post run` can train (distill, sft or rl)."""
    recipe = load_recipe(path, overrides)
    if not isinstance(recipe, (DistillRecipe, SftRecipe, RlRecipe)):
        raise RecipeError(f"{path}: kind: '{recipe.kind}' is not a training recipe (expected distill, sft or rl)")
    return recipe


def dump_recipe(recipe: Strict) -> str:
    """The recipe as YAML, every default written out and the teachers inline."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def find_recipe_files(paths: list[str | Path]) -> list[Path]:
    """Expand directories into the YAML files under them (sorted); keep files as given."""
    found: list[Path] = []
    for item in map(Path, paths):
        if item.is_dir():
            found.extend(sorted(p for p in item.rglob("*.y*ml") if p.suffix in (".yaml", ".yml")))
        else:
            found.append(item)
    return found


__all__ = ["ModelSpec", "dump_recipe", "find_recipe_files", "load_distill_recipe", "load_recipe", "read_yaml"]
