"""Pipeline recipes: SFT -> OPD -> eval stages, each stage's student handed to the next."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from k3post.config.errors import RecipeError
from k3post.config.load import load_recipe

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, stages: list[dict]) -> Path:
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump({"kind": "pipeline", "stages": stages}))
    return path


@pytest.mark.parametrize("stages, expected", [
    ([{"name": "a", "recipe": "x.yaml"}], "stages\\[0\\].recipe: file not found"),
    ([{"name": "opd", "recipe": str(REPO / "recipes/smoke/tiny.yaml"), "student_from": "sft"}],
     "takes its student from 'sft', which is not an earlier stage"),
    ([{"name": "a", "recipe": str(REPO / "recipes/smoke/tiny.yaml")}] * 2, "two stages are named 'a'"),
    ([{"name": "t", "recipe": str(REPO / "recipes/teachers/tiny-alpha.yaml")}], "a stage is an sft, distill, rl or eval"),
    ([{"name": "a", "recipe": str(REPO / "recipes/smoke/tiny.yaml"), "overrides": ["optim.lr=oops"]}],
     "optim.lr"),
    ([{"name": "a", "recipe": str(REPO / "recipes/smoke/tiny.yaml"), "unknown": 1}], "stages\\[0\\].unknown"),
])
def test_bad_pipelines_name_the_file_and_the_stage(tmp_path, stages, expected):
    with pytest.raises(RecipeError, match=expected.replace("(", r"\(")):
        load_recipe(_write(tmp_path, stages))


def test_smoke_pipeline_hands_each_stage_the_previous_student_and_resumes(tmp_path, capsys):
    from k3post.cli.main import main

    run_dir = tmp_path / "run"
    assert main(["run", "recipes/pipelines/smoke-tiny.yaml", "--run-dir", str(run_dir), "--in-process"]) == 0
    for stage in ("sft", "opd", "eval"):
        assert (run_dir / stage / "STAGE_DONE").is_file()
    # The OPD stage trained the SFT stage's last checkpoint (step 4), not the recipe's own student.
    opd = yaml.safe_load((run_dir / "opd" / "recipe.resolved.yaml").read_text())
    assert opd["student"]["path"] == str((run_dir / "sft" / "checkpoints" / "step-4").resolve())
    assert opd["student"].get("tiny") is None
    # The eval stage evaluated both stages' checkpoints over time, next to the recipe's students;
    # OPD's step 0 is SFT's step 4 (the same weights), so it is not evaluated twice.
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    names = {m["name"] for m in report["models"]}
    assert {"sft@step-0", "sft@step-2", "sft@step-4", "opd@step-1", "opd@step-2", "small"} <= names
    assert "opd@step-0" not in names
    kl = {(r["model"], r["teacher"]): r["value"] for r in report["records"]
          if r["task"] == "kl" and r.get("metric") == "reverse_kl"}
    assert all(value > 0 for value in kl.values()) and ("opd@step-2", "alpha") in kl
    capsys.readouterr()
    # Running it again skips every finished stage.
    assert main(["run", "recipes/pipelines/smoke-tiny.yaml", "--run-dir", str(run_dir), "--in-process"]) == 0
    assert capsys.readouterr().out.count("done earlier, skipped") == 3
