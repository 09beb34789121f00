"""`k3post eval` end to end on tiny models: two students (one of them a training run's checkpoints,
one with an FP8 twin) and a teacher; and bad input reported without stopping the rest."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from k3post.cli.main import main
from k3post.config.schema import TinyModelSpec
from k3post.model.loading.tiny import save_tiny
from k3post.track.atomic import mark_complete

REPO = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 32, "num_layers": 1}


def fake_run(root: Path) -> Path:
    """A run directory as `k3post run` leaves it: the resolved recipe and a checkpoint at step 2."""
    (root / "checkpoints").mkdir(parents=True)
    (root / "recipe.resolved.yaml").write_text(yaml.safe_dump({"kind": "distill", "student": {"tiny": {**TINY, "seed": 5}}}))
    save_tiny(TinyModelSpec(**TINY, seed=6), root / "checkpoints" / "step-2")
    mark_complete(root / "checkpoints" / "step-2")
    return root


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_two_students_and_a_teacher_end_to_end(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    recipe = write_recipe(tmp_path / "eval.yaml", {
        "kind": "eval",
        "students": {"small": {"model": {"tiny": {**TINY, "seed": 1}}, "fp8": "export"}, "trained": {"run": "run"}},
        "teachers": {"alpha": str(REPO / "recipes" / "teachers" / "tiny-alpha.yaml")},
        "tasks": [
            {"name": "arith", "kind": "generation", "data": "builtin:arith", "limit": 3, "samples": 2, "k": [1, 2]},
            {"name": "kl", "kind": "kl", "prompts": "builtin:heldout-chat", "limit": 2},
            {"name": "ref", "kind": "nll", "data": "builtin:reference", "limit": 3},
            {"name": "fp8", "kind": "fp8_gap", "prompts": "builtin:heldout-chat", "limit": 2},
        ],
        "sampling": {"max_new_tokens": 4, "batch_size": 4}, "seed": 7,
    })
    out = tmp_path / "report"
    assert main(["eval", str(recipe), "--out", str(out), "--set", "confidence=0.9"]) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["failures"] == [] and report["seed"] == 7 and report["confidence"] == 0.9
    students = ["small", "small@fp8", "trained@step-0", "trained@step-2"]
    assert [m["name"] for m in report["models"]] == students + ["alpha"]
    assert run.name in report["models"][3]["spec"]["path"] and report["models"][3]["step"] == 2
    got = {(r["model"], r["task"], r["metric"], r.get("teacher")): r for r in report["records"]}
    for name in students + ["alpha"]:
        for metric in ("pass@1", "pass@2"):
            r = got[(name, "arith", metric, None)]
            assert r["n"] == 3 and r["samples_per_prompt"] == 2 and r["ci_method"] == "wilson"
        assert got[(name, "ref", "nll", None)]["value"] > 0
    for name in students:  # every student against the teacher, both directions, on 2 prompts
        for metric in ("reverse_kl", "forward_kl"):
            r = got[(name, "kl", metric, "alpha")]
            assert r["n"] == 2 and r["seed"] == 7 and r["ci_low"] <= r["value"] <= r["ci_high"] and r["value"] >= 0
    assert ("alpha", "kl", "reverse_kl", "alpha") not in got
    fp8 = got[("small@fp8", "fp8", "fp8_kl", None)]
    assert fp8["reference_model"] == "small" and 0 < fp8["value"] < 1e-2  # quantization moves it, a little
    assert (out / "fp8" / "small" / "config.json").is_file()
    for r in report["records"]:
        assert {"model", "task", "metric", "value", "ci_low", "ci_high", "n", "seed", "confidence"} <= set(r)
    md = (out / "report.md").read_text()
    for heading in ("## Models × tasks", "## Students × teachers (KL)", "## FP8 serving", "| trained@step-2 |"):
        assert heading in md
    assert "## Failures" not in md
    plots = {p.name for p in (out / "plots").glob("*.png")}
    assert {"arith-pass_1.png", "kl-reverse_kl.png", "steps-kl-reverse_kl.png", "steps-arith-pass_1.png"} <= plots
    assert all((out / "plots" / p).read_bytes()[:4] == b"\x89PNG" for p in plots)


def test_bad_input_is_reported_and_the_rest_is_evaluated(tmp_path, capsys):
    rows = tmp_path / "qa.jsonl"
    rows.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?"}\n')
    recipe = write_recipe(tmp_path / "eval.yaml", {
        "kind": "eval",
        "students": {"good": {"model": {"tiny": TINY}}, "gone": {"model": {"path": "no/such/model"}}},
        "tasks": [
            {"name": "trivia", "kind": "trivia", "data": "builtin:arith"},
            {"name": "qa", "kind": "generation", "data": "qa.jsonl", "verifier": "exact"},
            {"name": "ref", "kind": "nll", "data": "builtin:reference", "limit": 2},
        ],
    })
    out = tmp_path / "report"
    assert main(["eval", str(recipe), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    errors = {(f["model"], f["task"]): f["error"] for f in report["failures"]}
    assert f"{recipe}: tasks[0].kind: unknown task type 'trivia'" in errors[(None, "trivia")]
    assert f"{rows} row 1" in errors[(None, "qa")] and "'answer'" in errors[(None, "qa")]
    assert "no/such/model" in errors[("gone", None)] and "config.json" in errors[("gone", None)]
    assert {(r["model"], r["task"], r["metric"]) for r in report["records"]} == {("good", "ref", "nll"),
                                                                                 ("good", "ref", "perplexity")}
    assert "## Failures" in (out / "report.md").read_text() and "trivia" in err and "Traceback" not in err
    assert main(["validate", str(recipe)]) == 1  # validate is strict: any bad entry makes the file invalid


def test_an_eval_recipe_tracks_its_report_to_mlflow(tmp_path, capsys):
    """`track:` in an eval recipe: the report's numbers reach the sink, at each model's training
    step (a run's checkpoint at its step, other models at 0), equal to report.json's."""
    import pytest

    pytest.importorskip("mlflow")
    from tests.unit.test_track_sinks import mlflow_history

    from k3post.track.mlflow_sink import metric_key

    fake_run(tmp_path / "run")
    recipe = write_recipe(tmp_path / "eval.yaml", {
        "kind": "eval", "students": {"trained": {"run": "run"}},
        "tasks": [{"name": "ref", "kind": "nll", "data": "builtin:reference", "limit": 2}],
        "track": [{"kind": "mlflow"}],
    })
    out = tmp_path / "report"
    assert main(["eval", str(recipe), "--out", str(out)]) == 0, capsys.readouterr().err
    records = json.loads((out / "report.json").read_text())["records"]
    rows, _ = mlflow_history(out)
    assert sorted(rows) == [0, 2]  # trained@step-0 and trained@step-2
    for r in records:
        assert rows[r["step"]][metric_key(f"ref/{r['metric']}/{r['group']}", True)] == r["value"]


def test_a_model_whose_config_is_not_json_is_named_with_the_file_and_what_was_expected(tmp_path, capsys):
    """The model directory's config.json is not JSON: the failure names that file, the line and
    what was expected (a JSON object: the model config), not a bare JSONDecodeError; the other
    student is still evaluated."""
    save_tiny(TinyModelSpec(**TINY, seed=6), tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    config.write_text("{not json\n")
    recipe = write_recipe(tmp_path / "eval.yaml", {
        "kind": "eval",
        "students": {"good": {"model": {"tiny": TINY}}, "broken": {"model": {"path": str(tmp_path / "m")}}},
        "tasks": [{"name": "ref", "kind": "nll", "data": "builtin:reference", "limit": 2}],
    })
    out = tmp_path / "report"
    assert main(["eval", str(recipe), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    error = {f["model"]: f["error"] for f in report["failures"]}["broken"]
    assert error.startswith(f"{config}: line 1: expected a JSON model config"), error
    assert "JSONDecodeError" not in error and "JSONDecodeError" not in err and "Traceback" not in err
    assert {r["model"] for r in report["records"]} == {"good"}
