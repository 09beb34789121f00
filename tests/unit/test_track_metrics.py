"""MetricsLog: durable JSONL, resume truncation, value conversion, TensorBoard mirror; samples."""

import json
import math

import numpy as np
import pytest
import torch

from k3post.track.metrics import METRICS_FILE, MetricsLog, read_metrics
from k3post.track.samples import format_samples_table, write_samples


def _steps(run_dir):
    return [r["step"] for r in read_metrics(run_dir / METRICS_FILE)]


def test_resume_truncates_then_each_step_once(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 6):
        log.log(step, {"train/loss": step / 10})
    log.close()
    assert _steps(tmp_path) == [1, 2, 3, 4, 5]

    # Crash after step 5, resume from the checkpoint of step 3: steps 4 and 5 are redone.
    log = MetricsLog(tmp_path, resume_step=3, tensorboard=False)
    assert _steps(tmp_path) == [1, 2, 3]
    log.log(4, {"train/loss": 0.44})
    log.log(5, {"train/loss": 0.55})
    log.close()
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[3]["train/loss"] == 0.44


def test_torn_last_line_dropped(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]

    log = MetricsLog(tmp_path, resume_step=2, tensorboard=False)
    log.log(3, {"a": 3.0})
    log.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # every line valid JSON


def test_fresh_run_sets_old_log_aside(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "a": 1.0}\n')
    with MetricsLog(tmp_path, tensorboard=False) as log:
        log.log(1, {"a": 2.0})
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": 1, "a": 2.0}]
    assert len(list(tmp_path.glob(f"{METRICS_FILE}.prev-*"))) == 1


def test_values_converted_and_nonfinite_is_null(tmp_path):
    with MetricsLog(tmp_path, tensorboard=False) as log:
        log.log(1, {
            "t": torch.tensor(0.25), "t_int": torch.tensor(7), "np": np.float32(0.5),
            "np_int": np.int64(3), "nan": float("nan"), "inf": torch.tensor(math.inf), "i": 2,
        })
    line = (tmp_path / METRICS_FILE).read_text().strip()
    assert "NaN" not in line and "Infinity" not in line
    record = json.loads(line)
    assert record == {"step": 1, "t": 0.25, "t_int": 7, "np": 0.5, "np_int": 3,
                      "nan": None, "inf": None, "i": 2}
    assert type(record["t_int"]) is int


def test_rejects_non_scalars_and_step_key(tmp_path):
    with MetricsLog(tmp_path, tensorboard=False) as log:
        with pytest.raises(TypeError, match="'v'"):
            log.log(1, {"v": torch.ones(3)})
        with pytest.raises(ValueError, match="reserved"):
            log.log(1, {"step": 3})


def test_tensorboard_event_file_written(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.log(1, {"train/loss": 0.5, "bad": float("nan")})
        log.log(2, {"train/loss": 0.4, "bad": 1.0})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents*"))
    assert events and events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]
    assert [e.step for e in acc.Scalars("bad")] == [2]  # the NaN was skipped


def test_write_samples_and_table(tmp_path):
    rows = [{"prompt": "Zähle: 1, 2,\n3?", "before": "x" * 50, "after": "4", "score": torch.tensor(1.5)}]
    path = write_samples(tmp_path, 10, rows)
    assert path == tmp_path / "samples" / "step-10.jsonl"
    text = path.read_text(encoding="utf-8")
    assert "Zähle" in text  # ensure_ascii=False
    assert json.loads(text) == {"prompt": "Zähle: 1, 2,\n3?", "before": "x" * 50, "after": "4", "score": 1.5}

    table = format_samples_table(rows, max_chars=10)
    lines = table.splitlines()
    assert lines[1].strip().startswith("prompt: Zähle: 1,")
    assert "xxxxxxxxxx… (+40 chars)" in table
    assert "after: 4" in table
