"""`track:` sinks: W&B (offline) and MLflow (local file store) get the same metrics with the same
steps as metrics.jsonl, the resolved recipe as the run's config, and a resumed run goes on in the
same tracked run; a sink whose package is missing fails at load with the pip line; checkpoints
carry a model card naming the teachers and the held-out figures."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import yaml

from k3post.cli.run import run_recipe
from k3post.config.errors import UserError
from k3post.config.load import load_recipe
from k3post.track.metrics import MetricsLog, read_metrics
from k3post.track.mlflow_sink import metric_key
from k3post.track.run_ids import read_ids
from k3post.track.sinks import open_sinks

pytest.importorskip("wandb")  # both are in the dev extra (make setup); a bare install skips here
pytest.importorskip("mlflow")

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "recipes" / "smoke" / "tiny.yaml"
TRACK = "track=[{kind: tensorboard}, {kind: wandb, offline: true, project: k3post-tests, tags: [ci]}, {kind: mlflow}]"


def wandb_records(run_dir: Path) -> list:
    """Every record of every offline W&B run file under run_dir/wandb (a LevelDB-style log:
    a 7-byte header, then 32 KiB blocks of chunks, each with a 7-byte header crc/length/type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, block, pending = path.read_bytes(), 7, 32768, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # the rest of a block too small for a header: padding
                pos += block - pos % block
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            pending += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST
                record = pb.Record()
                record.ParseFromString(pending)
                records.append(record)
                pending = b""
            elif kind == 0:
                break
    return records


def wandb_history(run_dir: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            step = items.pop("_step", None) if record.history.step.num == 0 else record.history.step.num
            rows.setdefault(int(step), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def wandb_config(run_dir: Path) -> dict:
    config = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "config":
            config.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.config.update})
    return config


def mlflow_history(run_dir: Path) -> tuple[dict[int, dict], dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run = client.get_run(read_ids(run_dir)["mlflow"])
    rows: dict[int, dict] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            rows.setdefault(metric.step, {})[key] = metric.value
    return rows, run.data.params


def finite(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "step" and v is not None and math.isfinite(v)}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A tiny distillation (2 steps, checkpoints at 1 and 2) logging to W&B offline and MLflow."""
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    assert run_recipe(SMOKE, [TRACK], run_dir, in_process=True, restart=False) == 0
    return run_dir


def test_wandb_and_mlflow_hold_the_metrics_of_metrics_jsonl(tracked_run):
    jsonl = {row["step"]: finite(row) for row in read_metrics(tracked_run / "metrics.jsonl")}
    assert sorted(jsonl) == [0, 1, 2] and "eval/kl/alpha" in jsonl[2] and "train/loss" in jsonl[1]
    wandb_rows = wandb_history(tracked_run)
    mlflow_rows, params = mlflow_history(tracked_run)
    for name, rows, key_of in (("wandb", wandb_rows, str), ("mlflow", mlflow_rows, lambda k: metric_key(k, True))):
        assert sorted(rows) == sorted(jsonl), name
        for step, expected in jsonl.items():
            assert set(rows[step]) == {key_of(k) for k in expected}, (name, step)
            for key, value in expected.items():
                assert rows[step][key_of(key)] == pytest.approx(value, rel=1e-6), (name, step, key)
    # The resolved recipe is each tracked run's config.
    resolved = yaml.safe_load((tracked_run / "recipe.resolved.yaml").read_text())
    assert wandb_config(tracked_run)["optim"]["lr"] == resolved["optim"]["lr"]
    assert float(params["optim.lr"]) == resolved["optim"]["lr"] and params["kind"] == "distill"


def test_a_resumed_run_goes_on_in_the_same_tracked_runs(tracked_run):
    ids = read_ids(tracked_run)
    assert set(ids) == {"wandb", "mlflow"}
    assert run_recipe(SMOKE, [TRACK, "train.steps=3"], tracked_run, in_process=True, restart=False) == 0
    assert read_ids(tracked_run) == ids
    mlflow_rows, _ = mlflow_history(tracked_run)
    assert sorted(mlflow_rows) == [0, 1, 2, 3]
    runs = sorted((tracked_run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(ids["wandb"]) for r in runs)  # one W&B run id, two syncs
    assert 3 in wandb_history(tracked_run)


def test_the_checkpoint_card_names_teachers_and_heldout_figures(tracked_run):
    from huggingface_hub import ModelCard

    last = max((tracked_run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    card = ModelCard((last / "README.md").read_text(encoding="utf-8"))
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and "on-policy-distillation" in data["tags"]
    assert {t["name"] for t in data["teachers"]} == {"alpha", "beta"}
    assert data["datasets"] == ["builtin:chat", "builtin:math"] and data["k3post"]["recipe_kind"] == "distill"
    step = data["k3post"]["step"]
    row = next(r for r in read_metrics(tracked_run / "metrics.jsonl") if r["step"] == step)
    figures = {r.metric_type: r.metric_value for r in card.data.eval_results}
    for key in ("eval/kl/alpha", "eval/fkl/alpha", "eval/kl/beta", "eval/fkl/beta"):
        assert figures[key] == pytest.approx(row[key], rel=1e-5)
        assert f"`{key}`" in card.text  # the body's table
    assert "## How it was trained" in card.text and "Teacher `alpha`" in card.text


def test_a_sink_whose_package_is_missing_fails_at_load_with_the_pip_line(monkeypatch):
    import k3post.config.track_schema as track_schema

    monkeypatch.setattr(track_schema, "installed", lambda package: package != "wandb")
    with pytest.raises(UserError, match=r"pip install 'k3post\[wandb\]'"):
        load_recipe(SMOKE, ["track=[{kind: wandb}]"])
    assert load_recipe(SMOKE, ["track=[{kind: mlflow}]"]).track[0].kind == "mlflow"


def test_track_defaults_to_tensorboard_and_refuses_a_kind_twice():
    assert [s.kind for s in load_recipe(SMOKE).track] == ["tensorboard"]
    assert [s.kind for s in load_recipe(SMOKE, ["track=[{kind: jsonl}]"]).track] == ["jsonl"]
    with pytest.raises(UserError, match="one sink of each kind"):
        load_recipe(SMOKE, ["track=[{kind: tensorboard}, {kind: tensorboard}]"])


def test_metrics_log_fans_out_one_record_to_every_sink(tmp_path):
    class Recorder:
        def __init__(self):
            self.rows, self.closed = [], None

        def log(self, step, record):
            self.rows.append((step, dict(record)))

        def close(self, failed=False):
            self.closed = failed

    sink = Recorder()
    with pytest.raises(RuntimeError):
        with MetricsLog(tmp_path, tensorboard=False, sinks=[sink]) as log:
            log.log(1, {"a": 1.5, "b": float("nan")})
            raise RuntimeError("crash")
    assert sink.rows == [(1, {"a": 1.5, "b": None})] and sink.closed is True
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 1.5, "b": None}]
    assert open_sinks([], tmp_path, None, {}) == []
