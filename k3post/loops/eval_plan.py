"""Which models an evaluation runs: the recipe's students and teachers expanded into entries.

A `run:` student becomes one entry per point in training time: step 0 (the run's initial
student, rebuilt from its recipe.resolved.yaml) and every complete checkpoints/step-N, so a
run is evaluated over time with one command. An `fp8:` student gets a twin entry `<name>@fp8`
right after it (the harness keeps the pair loaded together for the fp8_gap task).

Problems found here (a run directory without checkpoints or recipe) are returned, not raised:
the other models are still evaluated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from k3post.config.errors import UserError
from k3post.config.eval_schema import EvalRecipe, StudentSpec
from k3post.config.load import read_yaml
from k3post.config.schema import ModelSpec, TeacherSpec
from k3post.track.atomic import list_checkpoints
from k3post.track.run_dir import RESOLVED


@dataclass(frozen=True)
class ModelEntry:
    """One model of the report. `spec` carries its view of the prompt (a teacher's system prompt)."""

    name: str
    role: str  # "student" or "teacher"
    spec: TeacherSpec
    group: str  # the recipe entry it came from: a run's checkpoints share one group
    step: int | None = None  # training step, for entries from a run
    fp8_of: str | None = None  # the full-precision twin, for an FP8 entry
    export_from: ModelSpec | None = None  # write the FP8 export from this model first


def _initial_student(run: Path) -> ModelSpec:
    """The model a run started from: `student` (distill) or `model` (sft/rl) of its resolved recipe."""
    data = read_yaml(run / RESOLVED)
    raw = data.get("student", data.get("model"))
    if not isinstance(raw, dict):
        raise UserError(f"{run / RESOLVED}: no student or model section to rebuild the initial student from")
    try:
        return ModelSpec.model_validate(raw)
    except ValidationError as err:
        raise UserError(f"{run / RESOLVED}: the student spec does not load: {err}") from None


def _run_points(name: str, student: StudentSpec) -> list[tuple[str, int, ModelSpec]]:
    """(entry name, step, model) for each point of a run, oldest first."""
    run = Path(student.run or "")
    if not run.is_dir():
        raise UserError(f"students.{name}.run: run directory {run} not found")
    points = [(f"{name}@step-{step}", step, ModelSpec(path=str(path))) for step, path in
              list_checkpoints(run / "checkpoints")]
    if student.include_initial and (run / RESOLVED).is_file():
        points.insert(0, (f"{name}@step-0", 0, _initial_student(run)))
    if student.steps is not None:
        points = [p for p in points if p[1] in set(student.steps)]
    if not points:
        raise UserError(f"students.{name}.run: {run} has no complete checkpoints/step-N (and no {RESOLVED})"
                        + (f" at steps {student.steps}" if student.steps is not None else ""))
    return points


def _fp8_twin(entry: ModelEntry, fp8: str, out_dir: Path, single: bool) -> ModelEntry:
    if fp8 == "export":
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", entry.name)
        spec, source = ModelSpec(path=str(out_dir / "fp8" / safe)), entry.spec.model
    elif single:
        spec, source = ModelSpec(path=fp8), None
    else:
        raise UserError(f"students.{entry.group}.fp8: a path names one export, but the run has several "
                        "checkpoints; use fp8: export (or steps: [N])")
    return ModelEntry(f"{entry.name}@fp8", "student", TeacherSpec(model=spec), entry.group, entry.step,
                      fp8_of=entry.name, export_from=source)


def expand_models(recipe: EvalRecipe, out_dir: Path) -> tuple[list[ModelEntry], list[dict]]:
    """(entries in evaluation order, problems): students (each FP8 twin after its model), then teachers."""
    entries, problems = [], []
    for name, student in recipe.students.items():
        try:
            points = _run_points(name, student) if student.run else [(name, None, student.model)]
            for label, step, model in points:
                entry = ModelEntry(label, "student", TeacherSpec(model=model), name, step)
                entries.append(entry)
                if student.fp8 is not None:
                    entries.append(_fp8_twin(entry, student.fp8, out_dir, single=len(points) == 1))
        except UserError as err:
            problems.append({"model": name, "task": None, "error": str(err)})
    for name, teacher in recipe.teachers.items():
        entries.append(ModelEntry(name, "teacher", teacher, name))
    return entries, problems
