"""`k3post run PIPELINE.yaml`: the stages of a pipeline recipe, in order, each in its own
directory under the run directory (config/pipeline_schema.py).

Re-running the same command resumes: a finished stage (marked STAGE_DONE) is skipped, and an
unfinished training stage resumes from its last checkpoint like any run.
"""

from __future__ import annotations

from pathlib import Path

from k3post.config.errors import UserError
from k3post.config.kinds import RECIPE_KINDS
from k3post.config.load import load_pipeline, read_yaml, validate
from k3post.config.pipeline_schema import StageSpec
from k3post.config.schema import ModelSpec
from k3post.track.atomic import latest_checkpoint, write_text_atomic
from k3post.cli.references import check_pipeline_stages
from k3post.track.checkpoint_files import checkpoint_problem

DONE = "STAGE_DONE"


def final_checkpoint(stage_dir: Path, stage: str) -> Path:
    """The last checkpoint of a finished training stage, as a model directory."""
    found = latest_checkpoint(stage_dir / "checkpoints")
    if found is None:
        raise UserError(f"stage {stage!r} left no checkpoint in {stage_dir / 'checkpoints'}")
    checkpoint = found[1]
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        raise UserError(f"stage {stage!r}: its last checkpoint {checkpoint} is damaged ({problem}); rerun that stage "
                        f"(remove {stage_dir / DONE} and run the pipeline again: it resumes from the checkpoint before)")
    if not (checkpoint / "config.json").is_file():
        raise UserError(f"stage {stage!r}: {checkpoint} holds a LoRA adapter, not a full model; a later stage "
                        f"cannot start from it (train that stage without lora, or merge the adapter)")
    return checkpoint


def _training_recipe(stage: StageSpec, stage_file: Path, run_dir: Path):
    """The stage's recipe, its student swapped for an earlier stage's last checkpoint."""
    from k3post.config.load import load_run_recipe  # noqa: PLC0415

    recipe = load_run_recipe(stage_file, stage.overrides)
    if stage.student_from is None:
        return recipe
    checkpoint = final_checkpoint(run_dir / stage.student_from, stage.student_from)
    data = recipe.model_dump(mode="json")
    data["student"] = ModelSpec(path=str(checkpoint.resolve()), dtype=recipe.student.dtype).model_dump(
        mode="json", exclude_none=True)
    return validate(RECIPE_KINDS[recipe.kind], data, stage_file)


def run_pipeline(path: Path, run_dir: Path | None, in_process: bool, restart: bool) -> int:
    from k3post.cli.eval import run_eval  # noqa: PLC0415
    from k3post.cli.run import run_loaded_recipe  # noqa: PLC0415

    pipeline = load_pipeline(path)
    check_pipeline_stages(pipeline, path)  # a typo in the last stage's recipe is found before the first stage runs
    run_dir = run_dir or Path("runs") / path.stem
    names = [s.name for s in pipeline.stages]
    started_from = {s.name: s.student_from for s in pipeline.stages}
    print(f"k3post: pipeline {path} → {run_dir} (stages: {' → '.join(names)})")
    status = 0
    for number, stage in enumerate(pipeline.stages, start=1):
        stage_dir, stage_file = run_dir / stage.name, path.parent / stage.recipe
        if (stage_dir / DONE).is_file() and not restart:
            print(f"k3post: stage {number}/{len(names)} {stage.name}: done earlier, skipped")
            continue
        print(f"k3post: stage {number}/{len(names)} {stage.name} ({stage.recipe})", flush=True)
        if read_yaml(stage_file).get("kind") == "eval":
            students = [f"students.{source}.run={(run_dir / source).resolve()}" for source in stage.students_from]
            # A stage that started from another evaluated stage's last checkpoint would only repeat
            # that checkpoint as its step 0.
            students += [f"students.{source}.include_initial=false" for source in stage.students_from
                         if started_from[source] in stage.students_from]
            status = run_eval(stage_file, stage.overrides + students, stage_dir)
        else:
            recipe = _training_recipe(stage, stage_file, run_dir)
            status = run_loaded_recipe(recipe, f"{stage.name} ({stage.recipe})", stage_dir, in_process, restart)
        if status != 0:
            print(f"k3post: stage {stage.name} ended with status {status}; later stages not run")
            return status
        write_text_atomic(stage_dir / DONE, f"{stage.recipe}\n")
    print(f"k3post: pipeline done; stages in {run_dir}")
    return status
