"""Recipes: every shipped recipe loads; mistakes fail with the file, the key path and what was expected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from k3post.config.errors import RecipeError
from k3post.config.eval_schema import EvalRecipe
from k3post.config.load import apply_overrides, dump_recipe, find_recipe_files, load_distill_recipe, load_recipe
from k3post.config.pipeline_schema import PipelineRecipe
from k3post.config.rl_schema import RlRecipe
from k3post.config.schema import DistillRecipe, TeacherSpec
from k3post.config.sft_schema import SftRecipe

REPO = Path(__file__).resolve().parents[2]
SHIPPED = find_recipe_files([REPO / "recipes"])


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(REPO)) for p in SHIPPED])
def test_every_shipped_recipe_loads_and_its_saved_form_loads_again(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, (DistillRecipe, SftRecipe, RlRecipe, TeacherSpec, EvalRecipe, PipelineRecipe))
    # What a run directory keeps (every default written out) is what a resume reads back.
    assert type(recipe).model_validate(recipe.model_dump(mode="json")) == recipe


def test_quickstart_inlines_both_teachers_and_routes_sources():
    recipe = load_distill_recipe(REPO / "recipes" / "quickstart.yaml")
    assert set(recipe.teachers) == {"chat", "math"}
    assert recipe.teachers["math"].system_prompt and recipe.teachers["chat"].system_prompt is None
    assert {s.name: s.teacher for s in recipe.data.sources} == {"chat": "chat", "math": "math"}


def write(tmp_path: Path, name: str, data) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def base_recipe(tmp_path: Path) -> dict:
    write(tmp_path, "teachers/t.yaml", {"kind": "teacher", "model": {"tiny": {"seed": 1}}})
    return {"kind": "distill", "student": {"tiny": {}}, "teachers": {"t": "teachers/t.yaml"},
            "data": {"sources": [{"name": "s", "prompts": "builtin:chat", "teacher": "t"}]}}


def error_of(path: Path, overrides=None) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return str(info.value)


def test_unknown_key_names_file_and_path(tmp_path):
    data = base_recipe(tmp_path)
    data["optim"] = {"lr": 1e-4, "lrr": 3}
    message = error_of(write(tmp_path, "r.yaml", data))
    assert "r.yaml" in message and "optim.lrr" in message and "unknown key" in message


def test_wrong_type_and_out_of_range(tmp_path):
    data = base_recipe(tmp_path)
    data["train"] = {"steps": "many"}
    data["sampling"] = {"top_p": 1.5}
    message = error_of(write(tmp_path, "r.yaml", data))
    assert "train.steps" in message and "'many'" in message
    assert "sampling.top_p" in message and "less than or equal to 1" in message


def test_dangling_teacher_reference(tmp_path):
    data = base_recipe(tmp_path)
    data["data"]["sources"][0]["teacher"] = "nobody"
    message = error_of(write(tmp_path, "r.yaml", data))
    assert "data.sources[0].teacher" in message and "'nobody'" in message and "teachers: t" in message


def test_missing_teacher_file(tmp_path):
    data = base_recipe(tmp_path)
    data["teachers"]["u"] = "teachers/missing.yaml"
    message = error_of(write(tmp_path, "r.yaml", data))
    assert "teachers.u" in message and "missing.yaml" in message and "not found" in message


def test_error_inside_teacher_file_names_that_file(tmp_path):
    data = base_recipe(tmp_path)
    write(tmp_path, "teachers/t.yaml", {"kind": "teacher", "model": {"tiny": {}}, "temperature": -1})
    message = error_of(write(tmp_path, "r.yaml", data))
    assert "teachers/t.yaml" in message and "temperature" in message


def test_model_needs_exactly_one_source(tmp_path):
    data = base_recipe(tmp_path)
    data["student"] = {"tiny": {}, "path": "x"}
    message = error_of(write(tmp_path, "r.yaml", data))
    assert "student" in message and "exactly one of" in message


def test_yaml_syntax_error_names_line(tmp_path):
    message = error_of(write(tmp_path, "bad.yaml", "kind: distill\nstudent: [unclosed\n"))
    assert "bad.yaml" in message and "line" in message


def test_dotted_overrides_are_typed_and_checked(tmp_path):
    path = write(tmp_path, "r.yaml", base_recipe(tmp_path))
    recipe = load_distill_recipe(path, ["optim.lr=1e-5", "train.steps=7", "teachers.t.system_prompt=Be brief."])
    assert recipe.optim.lr == 1e-5 and recipe.train.steps == 7
    assert recipe.teachers["t"].system_prompt == "Be brief."
    assert "optim.nope" in error_of(path, ["optim.nope=1"])
    with pytest.raises(RecipeError, match="KEY.PATH=VALUE"):
        apply_overrides({}, ["no-equals-sign"], path)


def test_cuda_ipc_transport_needs_gpus_on_both_sides(tmp_path):
    path = write(tmp_path, "r.yaml", base_recipe(tmp_path))
    message = error_of(path, ["sampling.weight_transport=cuda_ipc"])
    assert "cuda_ipc" in message and "num_gpus" in message
    gpus = ["resources.learner.num_gpus=0.5", "resources.samplers.num_gpus=0.5", "resources.placement.colocate=true"]
    assert load_distill_recipe(path, ["sampling.weight_transport=cuda_ipc", *gpus]).sampling.weight_transport == "cuda_ipc"


def test_resolved_recipe_round_trips(tmp_path):
    recipe = load_distill_recipe(write(tmp_path, "r.yaml", base_recipe(tmp_path)))
    again = write(tmp_path, "elsewhere/resolved.yaml", dump_recipe(recipe))
    assert load_distill_recipe(again) == recipe  # self-contained: teachers inline, defaults explicit


def test_validate_command_exit_codes(tmp_path):
    good = write(tmp_path, "ok/r.yaml", base_recipe(tmp_path / "ok"))
    bad = base_recipe(tmp_path / "bad")
    bad["train"] = {"stepz": 1}
    write(tmp_path, "bad/r.yaml", bad)
    cli = [sys.executable, "-m", "k3post.cli.main", "validate"]
    assert subprocess.run(cli + [str(good.parent)], capture_output=True).returncode == 0
    result = subprocess.run(cli + [str(tmp_path / "bad")], capture_output=True, text=True)
    assert result.returncode == 1 and "train.stepz" in result.stderr and "Traceback" not in result.stderr


def test_a_warmup_longer_than_the_run_is_refused_at_load_for_every_trained_kind(tmp_path):
    """The schedule would raise at the first step (an internal error, after the actors started)."""
    distill = write(tmp_path, "r.yaml", base_recipe(tmp_path))
    message = error_of(distill, ["train.steps=1", "optim.warmup_steps=2"])
    assert "r.yaml" in message and "optim.warmup_steps: 2" in message and "train.steps: 1" in message
    assert load_distill_recipe(distill, ["train.steps=2", "optim.warmup_steps=2"]).train.steps == 2
    for kind in ("sft/smollm2-math-fp8-qat.yaml", "rl/smollm2-boxed.yaml"):
        message = error_of(REPO / "recipes" / kind, ["train.steps=3", "optim.warmup_steps=4"])
        assert "optim.warmup_steps: 4" in message and "train.steps: 3" in message, kind
