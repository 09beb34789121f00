"""bench/alternatives/opd_vs_alternatives.py end to end on tiny random models (`--smoke`): every arm trains for
its wall-clock budget, checkpoints, is scored by the eval harness and lands in the table, the
curves and the samples. Nothing is learnt at this size; the real run is in docs/opd-benchmark.md."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_smoke_benchmark_writes_table_plots_and_samples(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    opd_vs_alternatives = importlib.import_module("bench.alternatives.opd_vs_alternatives")

    assert opd_vs_alternatives.main(["--smoke", "--budget", "1", "--out", str(tmp_path)]) == 0
    checkpoints = json.loads((tmp_path / "checkpoints.json").read_text())
    arms = {c["arm"] for c in checkpoints}
    assert arms == {"opd-full", "sft"}
    for c in checkpoints:
        assert (Path(c["path"]) / "config.json").is_file() and c["step"] >= 1 and c["seconds"] >= 0.5
    sft_steps = [c["step"] for c in checkpoints if c["arm"] == "sft"]
    assert sft_steps == sorted(set(sft_steps))  # one checkpoint per distinct step
    assert len((tmp_path / "sft" / "teacher_samples.jsonl").read_text().splitlines()) == 8
    text = (tmp_path / "results.md").read_text()
    for arm in arms:
        assert f"| {arm} |" in text
    assert "| untrained student |" in text and "teacher (alpha)" in text and "forward KL" in text
    assert "Prompt `heldout-chat-0001`" in text
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    metrics = {(r["model"].split("@")[0], r["metric"]) for r in records}
    for arm in ("initial", *arms):
        for metric in ("reverse_kl", "forward_kl", "brief", "length", "distinct_2", "repetition_4"):
            assert (arm, metric) in metrics, (arm, metric)
    for name in ("fkl-seconds", "rkl-seconds", "fkl-tokens", "behaviour-seconds", "repetition-seconds"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    sys.modules.pop("bench.alternatives.opd_vs_alternatives", None)


def test_smoke_math_task_scores_the_answers(tmp_path, monkeypatch):
    """`--task math`: held-out arithmetic prompts, and pass@1 of the math verifier beside the KL."""
    monkeypatch.chdir(REPO)
    opd_vs_alternatives = importlib.import_module("bench.alternatives.opd_vs_alternatives")

    argv = ["--smoke", "--task", "math", "--arms", "opd-full", "--budget", "1", "--out", str(tmp_path)]
    assert opd_vs_alternatives.main(argv) == 0
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    answers = [r for r in records if r["metric"] == "pass@1"]
    assert {r["model"].split("@")[0] for r in answers} == {"initial", "opd-full", "alpha"}  # alpha: the teacher
    assert all(0.0 <= r["value"] <= 1.0 and r["n"] == 4 for r in answers), answers
    assert not any(r["metric"] == "brief" for r in records)
    text = (tmp_path / "results.md").read_text()
    assert "pass@1" in text and "Prompt `arith-" in text
    assert (tmp_path / "accuracy-seconds.png").stat().st_size > 1000
    sys.modules.pop("bench.alternatives.opd_vs_alternatives", None)
