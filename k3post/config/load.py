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

import yaml

from k3post.config.errors import RecipeError, located, shorten
from k3post.config.pipeline_schema import PipelineRecipe
from k3post.config.recipe_files import (  # noqa: F401 - callers import read_yaml, validate, apply_overrides from here
    absolute_data_paths,
    inline_teachers,
    apply_overrides,
    load_teacher,
    read_yaml,
    validate,
)
from k3post.config.kinds import RECIPE_KINDS
from k3post.config.rl_schema import RlRecipe
from k3post.config.schema import DistillRecipe, ModelSpec, Strict, TeacherSpec
from k3post.config.sft_schema import SftRecipe


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Strict:
    """Load any recipe file (its `kind` picks the schema), fully validated."""
    path = Path(path)
    data = read_yaml(path)
    kind = data.get("kind")
    if not isinstance(kind, str):  # e.g. `kind: *anchor` naming a list: not hashable, not a kind
        known = ", ".join(sorted([*RECIPE_KINDS, "eval", "pipeline"]))
        raise RecipeError(located(path, f"expected one of {known}", key="kind",
                                  got=kind if kind is not None else "no kind"))
    if kind == "eval":  # its own loader (config/eval_load.py); strict here: any bad entry is an error
        from k3post.config.eval_load import load_eval_recipe  # noqa: PLC0415 - it imports this module

        return load_eval_recipe(path, overrides, strict=True).recipe
    if kind == "pipeline":
        return load_pipeline(path)
    if kind not in RECIPE_KINDS:
        known = ", ".join(sorted([*RECIPE_KINDS, "eval", "pipeline"]))
        raise RecipeError(located(path, f"expected one of {known}", key="kind", got=kind))
    if kind == "teacher":
        return validate(TeacherSpec, apply_overrides(load_teacher(path), overrides or [], path), path)
    inline_teachers(data, path)
    apply_overrides(data, overrides or [], path)
    absolute_data_paths(data, path)
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
        if not isinstance(kind, str) or kind not in ("sft", "distill", "rl", "eval"):
            raise RecipeError(f"{path}: stages[{i}].recipe: {stage_file} has kind {shorten(kind)}; a stage is an "
                              f"sft, distill, rl or eval recipe")
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
            found.extend(sorted(p for p in item.rglob("*.y*ml") if p.suffix in (".yaml", ".yml") and not p.is_dir()))
        else:
            found.append(item)
    return found


__all__ = ["ModelSpec", "dump_recipe", "find_recipe_files", "load_distill_recipe", "load_recipe", "read_yaml"]
