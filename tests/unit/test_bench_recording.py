"""Every bench script that has figures in bench/results/*.jsonl records its own rows, and a re-run
supersedes the rows it re-measures.

Each script builds its rows in a plain function of the measured numbers (`result_rows`). Here
those functions get the numbers of the recorded measurement (or made-up ones), and the rows go
through bench/results.py's record() into a copy of the subject's results file in a temporary
folder (never bench/results): record() must accept them, the copy must still load (one current
row per metric), and every row of the measurement that is still current must now be superseded -
so the new rows carry exactly the metric names of the old. Where the same numbers went in, the
values must come out as recorded (the rounding and ratios are the table's).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
FIXED = {"commit_": "abc1234", "machine_": "2-core AMD EPYC test machine", "command_": "python bench/x.py --test"}


def _module(name: str):
    """A module of bench/ by its dotted path there: "results", "opd.opd_step" (bench/opd/opd_step.py)."""
    return importlib.import_module(f"bench.{name}")


@pytest.fixture(scope="module")
def results():
    return _module("results")


@pytest.fixture(scope="module")
def render():
    return _module("render_tables")


def old_current(subject: str, command: str | None = None, where=None) -> dict[str, Decimal]:
    """The current rows of a subject (of one command, its script named where it is now:
    results.moved; or those `where` picks): metric -> value."""
    results = _module("results")
    rows = results.read(RESULTS / f"{subject}.jsonl")
    return {r["metric"]: r["value"] for r in rows if r["current"]
            and (command is None or results.moved(r["command"]) == command) and (where is None or where(r))}


def rerun(results, render, tmp_path: Path, subject: str, rows: list[dict], section: str) -> list[dict]:
    """record() the rows into a copy of the subject's file; the copy loads; the written rows."""
    folder = tmp_path / subject
    folder.mkdir(exist_ok=True)
    if not (folder / f"{subject}.jsonl").exists():
        shutil.copy(RESULTS / f"{subject}.jsonl", folder)
    written = results.record(subject, rows, results_dir=folder, source_section=section, **FIXED)
    render.load(folder)  # every row valid, one current row per metric
    return render.current(render.load(folder))


def still_current(after: list[dict], old: dict) -> set[str]:
    return {r["metric"] for r in after if r["metric"] in old and r["command"] != FIXED["command_"]}


def same_values(after: list[dict], old: dict, skip=()) -> None:
    new = {r["metric"]: r["value"] for r in after if r["command"] == FIXED["command_"]}
    diff = {m: (v, new[m]) for m, v in old.items() if m not in skip and m in new and Decimal(str(new[m])) != v}
    assert not diff, diff


def section_exists(section: str) -> None:
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert f"\n## {section}\n" in text or f"\n### {section}\n" in text, section


def supersedes(results, render, tmp_path, subject: str, runs: list[list[dict]], section: str, count: int,
               skip=()) -> list[dict]:
    """Record each run's rows into a copy of the subject's file: every one of its `count` current
    rows is superseded, with the same values (but the metrics ending in one of `skip`)."""
    section_exists(section)
    old = old_current(subject)
    for rows in runs:
        after = rerun(results, render, tmp_path, subject, rows, section)
    assert len(old) == count and not still_current(after, old)
    same_values(after, old, skip=[m for m in old if m.endswith(tuple(skip))])
    return after


def test_record_writes_where_it_is_told_and_keeps_headlines(results, render, tmp_path, monkeypatch):
    before = {p.name: p.read_bytes() for p in RESULTS.glob("*.jsonl")}
    monkeypatch.setenv("K3POST_BENCH_RESULTS", str(tmp_path))
    assert results.results_folder() == tmp_path
    row = {"metric": "headline metric", "value": 1, "unit": "s"}
    results.record("demo", [{**row, "headline": True}], source_section="S", **FIXED)
    results.record("demo", [{**row, "value": 2}], source_section="S", **FIXED)  # re-measured: still the headline
    results.record("demo", [{**row, "value": 3, "headline": False}], source_section="S", **FIXED)  # said otherwise
    rows = render.load(tmp_path)
    assert [(r["value"], r["current"], r["headline"]) for r in rows] == [(1, False, True), (2, False, True),
                                                                         (3, True, False)]
    assert {p.name: p.read_bytes() for p in RESULTS.glob("*.jsonl")} == before  # bench/results untouched
    assert results.rounded(0.0367, 3) == Decimal("0.037") and str(results.rounded(1.2, 3)) == "1.200"


def test_opd_vs_trl_cpu(results, render, tmp_path):
    bench = _module("opd.opd_vs_trl_step")
    section_exists(bench.SECTION)
    command = (".venv/bin/python bench/opd/opd_vs_trl_step.py --steps 5 "
               "--arms k3post,trl-b1,k3post-glibc-defaults,trl-b1-tuned-alloc")
    measured = {"k3post": (6.73, 2.62, 382), "trl-b1": (9.33, 3.83, 297), "k3post-glibc-defaults": (8.81, 4.45, 382),
                "trl-b1-tuned-alloc": (7.46, 2.71, 297)}
    rows = bench.result_rows({arm: {"step": s, "learner": lrn, "tokens": t, "sample": 1.0} for arm, (s, lrn, t)
                              in measured.items()}, notes="test")
    old = old_current("opd-vs-trl", command)
    after = rerun(results, render, tmp_path, "opd-vs-trl", rows, bench.SECTION)
    assert len(old) == 16 and not still_current(after, old)
    same_values(after, old)
    assert [r["metric"] for r in after if r["headline"] and r["command"] == FIXED["command_"]] == [bench.HEADLINE]


def test_sandbox_cost(results, render, tmp_path, monkeypatch):
    bench = _module("sandbox.sandbox_cost")
    section_exists(bench.SECTION)
    trivial, five = "`run_python` of a trivial program", "`rewards.code:tests_pass` with 5 tests"
    assert set(bench.cases(None, None)) == {trivial, five}
    runs = [("hardened jail", "as root", "3760d06", {trivial: (95.7, 77.8), five: (108.9, 92.3)}),
            ("non-root jail", "as root", "2742dae", {trivial: (70.0, 69.3), five: (76.5, 76.5)}),
            ("non-root jail", None, "2742dae", {trivial: (45.0, 43.7), five: (48.5, 46.6)})]
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    assert bench.as_user("userns") == "as uid 65534 (user namespaces)"
    (tmp_path / "runs" / "sandbox-baseline-2742dae").mkdir(parents=True)
    assert bench.baseline_name(str(tmp_path / "runs" / "sandbox-baseline-2742dae")) == "2742dae"
    assert bench.baseline_name("3760d06") == "3760d06"
    for label, who, baseline, medians in runs:
        rows = bench.result_rows(medians, label, who or bench.as_user("userns"), baseline)
        after = rerun(results, render, tmp_path, "sandbox-cost", rows, bench.SECTION)
    old = old_current("sandbox-cost")
    assert len(old) == 12 and not still_current(after, old)
    same_values(after, old, skip=[m for m in old if "against the baseline" in m])


def test_weight_check_cost_cpu_and_gpu(results, render, tmp_path):
    cpu, gpu = _module("engines.weight_check_cost"), _module("engines.weight_check_gpu")
    section_exists(cpu.SECTION)
    assert gpu.SECTION == cpu.SECTION
    old = old_current("weight-check-cost")
    for label, copy, check in (("run 1", 0.348, 0.029), ("run 2", 0.932, 0.081)):
        rows = cpu.result_rows([copy, copy, copy + 1], [check, check, check + 1], label)
        after = rerun(results, render, tmp_path, "weight-check-cost", rows, cpu.SECTION)
    import torch

    timings = [((49152, 576), torch.bfloat16, 0.65, 0.1), ((49152, 576), torch.float32, 0.54, 0.1),
               ((151936, 8192), torch.bfloat16, 9.22, 1.2), ((151936, 8192), torch.float32, 6.93, 2.39)]
    after = rerun(results, render, tmp_path, "weight-check-cost", gpu.result_rows(timings), gpu.SECTION)
    assert len(old) == 14 and not still_current(after, old)
    same_values(after, old, skip=[m for m in old if "share" in m])
    mine = {r["metric"]: r["value"] for r in after if r["command"] == FIXED["command_"]}
    assert mine["CPU, in process, run 1: check's share of the median sync"] == Decimal("7.7")


def test_cross_tokenizer_cost(results, render, tmp_path):
    bench = _module("teachers.cross_tokenizer_cost")
    section_exists(bench.SECTION)
    measured = [{"arm": "direct", "score_s": 1.35, "read_text_s": 0.0, "driver_bytes": 1568},
                {"arm": "cross-same", "score_s": 1.589, "read_text_s": 0.006, "driver_bytes": 1568},
                {"arm": "cross-12k", "score_s": 1.756, "read_text_s": 0.005, "driver_bytes": 2304}]
    old = old_current("cross-tokenizer-cost")
    after = rerun(results, render, tmp_path, "cross-tokenizer-cost", bench.result_rows(measured), bench.SECTION)
    assert len(old) == 9 and not still_current(after, old)
    same_values(after, old)


def test_fp8_qat_from_its_three_scripts(results, render, tmp_path):
    ptq, step, memory = _module("fp8.qat_vs_ptq"), _module("fp8.qat_step_gpu"), _module("learner.learner_memory")
    for section in (ptq.SECTION, step.SECTION, memory.SECTION):
        section_exists(section)
    old = old_current("fp8-qat")
    rows = ptq.result_rows(5.5643, {"plain": (1.0356, 1.0566), "QAT": (1.068, 1.0313)})
    after = rerun(results, render, tmp_path, "fp8-qat", rows, ptq.SECTION)
    assert [r["metric"] for r in after if r["headline"]] == [ptq.GAIN]  # a re-measured headline stays one
    for shape, bf16, qat, ratio, variant in (("8x4x64x448", 0.131, 0.168, 1.28, None),
                                             ("8x4x64x448", 0.103, 0.14, 1.36, "with `--profile`"),
                                             ("8x4x64x448", 0.119, 0.146, 1.23, "inductor `combo_kernels`"),
                                             ("16x8x64x960", 0.186, 0.211, 1.12, None)):
        measured = [{"shape": shape, "bf16": bf16, "fp8-qat": qat, "ratio": ratio, "ratio_min": 1.0, "ratio_max": 1.4,
                     "rounds": 12}]
        after = rerun(results, render, tmp_path, "fp8-qat", step.result_rows(measured, "one H200", variant), step.SECTION)
    args = SimpleNamespace(model="big", dtype="bfloat16", rows=8, prompt_len=64, completion_len=448, compile=True,
                           device="cuda")
    head = memory.run_name(args, 503_000_000)
    by = memory.result_rows([{"variant": "none", "peak_gib": 7.0, "step_s": 0.2},
                             {"variant": "qat", "peak_gib": 8.176, "step_s": 0.3}], head, "one H200", 0.94)
    after = rerun(results, render, tmp_path, "fp8-qat", by["fp8-qat"], memory.SECTION)
    assert len(old) == 15 and not still_current(after, old)
    same_values(after, old, skip=[m for m in old if "step time" in m])


def test_reference_cost_from_learner_memory(results, render, tmp_path):
    memory = _module("learner.learner_memory")
    for device, model, dtype, tokens, params, variants in (
            ("cuda", "big", "bfloat16", (64, 448), 503_000_000,
             {"none": (7.15, 0.207), "grad_buffer": (7.15, 0.271), "copy": (8.087, 0.236)}),
            ("cpu", "smollm2", "float32", (48, 48), 134_515_008,
             {"none": (3.66, 1.0), "copy": (4.121, 1.1), "grad_buffer": (4.114, 1.2), "lora": (3.0, 0.9)})):
        args = SimpleNamespace(model=model, dtype=dtype, rows=8, prompt_len=tokens[0], completion_len=tokens[1],
                               compile=False, device=device)
        measured = [{"variant": v, "peak_gib": p, "step_s": s} for v, (p, s) in variants.items()]
        by = memory.result_rows(measured, memory.run_name(args, params), "one H200", 0.94)
        assert set(by) == {"reference-cost"}
        after = rerun(results, render, tmp_path, "reference-cost", by["reference-cost"], memory.SECTION)
    old = old_current("reference-cost", where=lambda r: "learner_memory.py" in r["command"])
    assert len(old) == 10 and not still_current(after, old)
    same_values(after, old, skip=[m for m in old if "step time" in m or "model copies" in m])


def _sharded_args(**kw):
    base = dict(shape="qwen2-7b", layers=18, rows=4, seq=1024, compile=False, ranks=1, label=None)
    return SimpleNamespace(**{**base, **kw})


def _measured(kind, refs: dict, params, scratch=2**24, largest=152064 * 3584):
    return [{"kind": kind, "reference": ref, "params": params, "peak_gib": peak, "step_s": step, "mfu": mfu,
             "scratch_elements": scratch, "largest_shard": largest} for ref, (peak, step, mfu) in refs.items()]


def test_reference_cost_from_the_sharded_learner(results, render, tmp_path):
    bench = _module("learner.learner_sharded")
    section_exists(bench.GPU_SECTION)
    kind, n = "sharded-bf16-mixed+ac", 5_290_000_000
    runs = [("process 1", {"none": (91.2, 0.531, 0), "grad_buffer": (91.4, 0.845, 0)}, 2**24),
            ("process 3", {"grad_buffer": (91.4, 0.76, 0), "none": (91.2, 0.595, 0)}, 2**24),
            ("process 2", {"grad_buffer": (93.3, 0.772, 0)}, 10**10),
            ("order none → grad_buffer → copy", {"none": (91.2, 0.57, 0), "grad_buffer": (93.3, 0.6, 0),
                                                 "copy": (111.0, 0.746, 0)}, 10**10),
            ("order copy → grad_buffer → none", {"copy": (111.0, 0.662, 0), "grad_buffer": (93.3, 0.7, 0),
                                                 "none": (91.2, 0.556, 0)}, 10**10)]
    for label, refs, scratch in runs:
        by = bench.result_rows(_measured(kind, refs, n, scratch), _sharded_args(label=label))
        assert set(by) == {"reference-cost"}
        after = rerun(results, render, tmp_path, "reference-cost", by["reference-cost"], bench.GPU_SECTION)
    old = old_current("reference-cost", where=lambda r: "learner_sharded.py" in r["command"])
    # Not reproducible by one run: the copy's peak named without the run's order, and process 2's
    # peak against a no-reference run of other processes.
    assert still_current(after, old) == {
        "5.29B student (Qwen2-7B dims, 18 layers), 4 × 1,024 tokens, sharded bf16-mixed + AC: copy reference, peak memory",
        "5.29B student (Qwen2-7B dims, 18 layers), 4 × 1,024 tokens, sharded bf16-mixed + AC: grad_buffer reference, "
        "peak memory against no reference (scratch the largest shard; process 2)"}
    headline = [r for r in after if r["headline"]]
    assert len(headline) == 1 and headline[0]["command"] == FIXED["command_"] and "(process 1)" in headline[0]["metric"]
    same_values(after, old, skip=[m for m in old if "against" in m or "order" in m])


def test_learner_sharded_h200(results, render, tmp_path):
    bench = _module("learner.learner_sharded")
    model = "sharded-bf16-mixed+model"
    for args, measured in (
            (_sharded_args(shape="qwen2.5-0.5b", layers=None, rows=32, seq=320, compile=True),
             _measured(model, {"none": (18.9, 0.119, 0.413)}, 630_000_000)
             + _measured("unsharded-bf16", {"none": (14.9, 0.1, 0.505)}, 630_000_000)),
            (_sharded_args(shape="qwen2-0.4b", layers=None, rows=32, seq=320, compile=True),
             _measured(model, {"none": (15.7, 0.1, 0.3)}, 450_000_000)),
            (_sharded_args(shape="llama-1.3b", layers=None, rows=8, seq=2048, compile=True),
             _measured(model, {"none": (43.1, 0.3, 0.567)}, 1_360_000_000))):
        by = bench.result_rows(measured, args)
        assert set(by) == {"learner-sharded-h200"}
        after = rerun(results, render, tmp_path, "learner-sharded-h200", by["learner-sharded-h200"], bench.GPU_SECTION)
    old = old_current("learner-sharded-h200")
    # The median over 8 processes and the before/after ratio are not one run's rows.
    assert still_current(after, old) == {m for m in old if "median of 8 processes" in m or "after / before" in m}
    assert [r["metric"] for r in after if r["headline"]] == [
        "1.36B Llama student, 8 × 2,048 tokens, sharded bf16-mixed, model unit, compiled: MFU"]
    same_values(after, old)
    assert bench.learner_name("sharded-bf16-mixed+ac+fused", False, 2) == "sharded bf16-mixed + AC + fused AdamW, 2 ranks"


def test_quickstart(results, render, tmp_path):
    bench = _module("demos.quickstart_demo")
    section_exists(bench.SECTION)
    kl = {"chat": ((0.918, 0.987), (0.574, 0.666)), "math": ((0.884, 1.034), (0.503, 0.583))}
    metrics = [{"step": s, "time/step_s": 1.0} for s in range(1, 29)]
    for step, i in ((0, 0), (14, 1), (28, 1)):
        metrics.append({"step": step, **{f"eval/{k}/{t}": kl[t][i][j] for t in kl for j, k in enumerate(("kl", "fkl"))}})
    rows = bench.result_rows(501.2, 410, True, metrics)
    old = old_current("quickstart", "make demo")
    after = rerun(results, render, tmp_path, "quickstart", rows, bench.SECTION)
    assert len(old) == 10 and not still_current(after, old)
    same_values(after, old)
    assert [r["metric"] for r in after if r["headline"]] == ["`make demo`, install included: wall time"]
    assert rows[0]["notes"] == "8 min 21 s"
    assert bench.result_rows(342, None, False, [])[0]["metric"] == "`make demo`, venv already installed: wall time"


def test_opd_step_cpu(results, render, tmp_path):
    bench = _module("opd.opd_step")
    measured = {"in-process": {"setup": 2.8, "sample": 3.44, "score": 1.16, "train": 5.75, "sync": 0.03, "step": 10.38,
                               "tokens/step": 368, "tokens/s": 35.5},
                "ray": {"setup": 10.9, "sample": 3.59, "score": 1.25, "train": 6.42, "sync": 0.09, "step": 11.40,
                        "tokens/step": 368, "tokens/s": 31.1}}
    supersedes(results, render, tmp_path, "opd-step-cpu", [bench.result_rows("recipes/quickstart.yaml", measured)],
               bench.SECTION, 18)


def test_learner_one_forward(results, render, tmp_path):
    bench = _module("opd.learner_one_forward")
    runs = [bench.result_rows({"before": (6.14, 12.10), "after": (4.79, 9.29)})]
    runs += [bench.result_rows({"after": (wall, 2 * wall)}, label)
             for label, wall in (("AVX2-only machine", 6.9), ("AVX-512 + AMX machine", 2.08))]
    after = supersedes(results, render, tmp_path, "learner-one-forward", runs, bench.SECTION, 8)
    assert {str(r["value"]) for r in after if "after / before" in r["metric"]} == {"0.78", "0.77"}


def test_sft_precision(results, render, tmp_path):
    bench = _module("learner.sft_precision")

    def arm(precision, learner, nll, step_s):
        return {"precision": precision, "learner": learner, "curve": [(500, 9.0), (600, nll)], "step_s": step_s}

    args = SimpleNamespace(lr=3e-5, layers=8, hidden=512, steps=600, batch=64)
    first = bench.result_rows([arm("bf16", "Learner", 1.8779, 0.0530), arm("bf16-mixed", "ShardedLearner", 1.6157, 0.0806),
                               arm("fp32", "Learner", 1.6163, 0.0496)], args)
    args.lr = 1e-4
    second = bench.result_rows([arm("bf16", "Learner", 1.4600, 0.0520), arm("bf16-mixed", "ShardedLearner", 1.3172, 0.0786)],
                               args)
    supersedes(results, render, tmp_path, "sft-precision", [first, second], bench.SECTION, 13)


def test_opd_losses(results, render, tmp_path):
    bench = _module("opd.opd_losses")
    B, T, V = 2, 2048, 152_064
    payload = {"sampled_token": 0, "topk k=32": B * T * (8 * 32 + 4), "topk k=128": B * T * (8 * 128 + 4),
               "full_vocab": 4 * B * T * V, "full_vocab hidden": 4 * B * T * 64}
    seconds = {"sampled_token": (6.8, 14.5), "topk k=32": (28.2, 66.7), "topk k=128": (24.7, 80.1),
               "full_vocab": (23.5, 43.2), "full_vocab hidden": (3.0, 81.3)}
    measured = [{"loss": n, "driver": 20 * B * T, "to_learner": payload[n], "score_s": seconds[n][0],
                 "train_s": seconds[n][1], "before": 20 * B * T + (4 * B * T * V if n.startswith("full") else 0)}
                for n in payload]
    after = supersedes(results, render, tmp_path, "opd-losses", [bench.result_rows(measured, B, T, V)], bench.SECTION, 30,
                       skip=["step time"])  # the docs' step times are sums of unrounded times
    units = {r["metric"].split(": ")[-1] + " " + r["unit"] for r in after if "topk_reverse k = 32" in r["metric"]}
    assert "bytes a step to the driver KB" in units and "bytes a step teacher → learner MB" in units


def test_kimi_step_gpu(results, render, tmp_path):
    bench = _module("demos.kimi_step_gpu")
    runs = [bench.result_rows({"fla_kernels": fla, "params_M": 77.6, "batch": 8, "length": 1024, "step_s_median": step,
                               "tokens_per_s": round(8 * 1024 / step), "peak_mem_GiB": peak})
            for fla, step, peak in ((False, 0.347, 17.7), (True, 0.102, 7.0))]
    supersedes(results, render, tmp_path, "kimi-step-gpu", runs, bench.SECTION, 4)


def test_rollout_engines(results, render, tmp_path):
    bench = _module("engines.vllm_vs_hf")
    rows = bench.result_rows(8, 64, {"sample hf": 43.6, "sample vllm": 135.9, "score hf": 241.9, "score vllm": 378.0},
                             (3.1e-5, 3.9e-5), (0.7, 7.9), {"in_place": 0.76, "checkpoint": 1.93})
    supersedes(results, render, tmp_path, "rollout-engines", [rows], bench.SECTION, 12)


def test_head_logprobs(results, render, tmp_path):
    bench = _module("learner.head_logprobs")
    runs = [bench.result_rows(ms, 10240, 896, vocab, "bfloat16") for vocab, ms in (
        (151936, {False: [67.4, 67.6], True: [30.4, 31.3]}), (49152, {False: [24.3, 24.3], True: [23.8, 18.0]}))]
    supersedes(results, render, tmp_path, "head-logprobs", runs, bench.SECTION, 6)


def test_behaviour_prompt(results, render, tmp_path):
    bench = _module("alternatives.behaviour_prompt")
    rate = lambda v, lo, hi: SimpleNamespace(value=v, low=lo, high=hi)  # noqa: E731
    rates = {"answer_prefix": (rate(0.0, 0.0, 0.06), rate(0.0, 0.0, 0.06)),
             "numbered_list": (rate(0.094, 0.04, 0.19), rate(0.0625, 0.02, 0.15)),
             "brief": (rate(0.406, 0.29, 0.53), rate(0.0625, 0.02, 0.15))}
    supersedes(results, render, tmp_path, "behaviour-prompt", [bench.result_rows(rates, 64, 48)], bench.SECTION, 6)


def _equal_budget_table(marker: str):
    """The checkpoints and harness records of docs/opd-benchmark.md's table at equal budget (the
    one bench/alternatives/bench_report.py writes between the task's markers)."""
    from bench.alternatives.bench_arms import Checkpoint  # noqa: PLC0415

    page = (REPO / "docs" / "opd-benchmark.md").read_text(encoding="utf-8")
    block = page.split(f"<!-- {marker}:start -->")[1].split("At equal budget")[1].split("\n\n")[1].splitlines()
    columns = [c.strip() for c in block[0].strip("|").split("|")]
    kept, records = [], []
    for line in block[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith("teacher"):
            continue
        model = "initial"
        if cells[0] != "untrained student":
            seconds, step, tokens = (float(x) for x in cells[-1].split(" · "))
            kept.append(Checkpoint(cells[0], Path("."), seconds, tokens, int(step)))
            model = f"{cells[0]}@{int(step)}"
        for column, cell in zip(columns[1:], cells[1:]):
            key = {"reverse KL": "reverse_kl", "forward KL": "forward_kl"}.get(column, column)
            if key in ("reverse_kl", "forward_kl", "brief", "pass@1"):
                value, low, high = (float(x) for x in re.fullmatch(r"([\d.]+) \[([\d.]+), ([\d.]+)\]", cell).groups())
                records.append({"model": model, "metric": key, "value": value, "ci_low": low, "ci_high": high})
    return kept, records


def test_opd_vs_alternatives_rows_are_the_docs_tables(results, render, tmp_path):
    """The rows re-made from docs/opd-benchmark.md's generated tables supersede every current row
    of the two --full runs with the same values: data and docs agree."""
    bench = _module("alternatives.opd_vs_alternatives")
    section_exists(bench.SECTION)
    old = old_current("opd-vs-alternatives", where=lambda r: "--full" in r["command"])
    for task, marker, scores in (("behaviour", "bench", ["brief"]), ("math", "bench:math", ["pass@1"])):
        kept, records = _equal_budget_table(marker)
        after = rerun(results, render, tmp_path, "opd-vs-alternatives",
                      bench.result_rows(task, 240, "wall", kept, records, scores), bench.SECTION)
    assert len(old) == 42 and not still_current(after, old)
    same_values(after, old)
    notes = {r["notes"] for r in after if r["command"] == FIXED["command_"] and "opd-full, held-out reverse" in r["metric"]}
    assert "95% interval [0.525, 0.617]; at 252 s, step 20, 4664 tokens" in notes


def test_kimi_demo(results, render, tmp_path):
    bench = _module("demos.kimi_demo_report")
    runs = {"kimi-quantile": [{"step": 4, "eval/kl/chat": 3.571}, {"step": 8, "eval/kl/chat": 3.275},
                              {"step": 8, "moe/load_max_over_mean/max": 1.57}],
            "kimi-none": [{"step": 8, "eval/kl/chat": 3.413, "moe/load_max_over_mean/max": 3.93}],
            "dense": [{"step": 8, "eval/kl/chat": 3.273}]}
    supersedes(results, render, tmp_path, "kimi-demo", [bench.result_rows(runs)], bench.SECTION, 5)


def test_vllm_teacher_recompute_share_is_the_system_prompts_part_of_the_phase():
    bench = _module("teachers.vllm_teacher_recompute")
    rows = bench.with_shares([{"system_tokens": 0, "n": 1, "rows": 8, "seconds": 2.0, "prefilled": 500},
                              {"system_tokens": 1024, "n": 1, "rows": 8, "seconds": 8.0, "prefilled": 8700},
                              {"system_tokens": 1024, "n": 4, "rows": 32, "seconds": 30.0, "prefilled": 35000}])
    assert rows[1]["share"] == pytest.approx(0.75) and "share" not in rows[0] and "share" not in rows[2]
    recorded = bench.result_rows(rows, "where")
    assert [r["value"] for r in recorded] == [2.0, 8.0, 75.0, 30.0]
    assert len({r["metric"] for r in recorded}) == 4


def test_chat_render(results, render, tmp_path):
    bench = _module("teachers.chat_render")
    measured = [{"system_tokens": s, "rows": 32, "whole": w / 1e3, "head_once": h / 1e3}
                for s, w, h in [(0, 2.71, 1.30), (256, 12.00, 1.70), (1024, 43.07, 1.88), (2048, 80.54, 1.94),
                                (4096, 216.56, 1.93)]]
    section_exists(bench.SECTION)
    old = old_current("chat-render")
    after = rerun(results, render, tmp_path, "chat-render", bench.result_rows(measured), bench.SECTION)
    assert len(old) == 15 and not still_current(after, old)
    same_values(after, old, skip=[m for m in old if m.startswith("render speed-up")])  # from unrounded ms
