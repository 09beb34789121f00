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

import importlib.util
import os
import shutil
import sys
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
FIXED = {"commit_": "abc1234", "machine_": "test machine", "command_": "python bench/x.py --test"}


def _module(name: str):
    sys.path.insert(0, str(REPO / "bench"))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results():
    return _module("results")


@pytest.fixture(scope="module")
def render():
    return _module("render_tables")


def old_current(subject: str, command: str | None = None, where=None) -> dict[str, Decimal]:
    """The current rows of a subject (of one command, or those `where` picks): metric -> value."""
    rows = _module("results").read(RESULTS / f"{subject}.jsonl")
    return {r["metric"]: r["value"] for r in rows if r["current"] and (command is None or r["command"] == command)
            and (where is None or where(r))}


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
    bench = _module("opd_vs_trl_step")
    section_exists(bench.SECTION)
    command = ".venv/bin/python bench/opd_vs_trl_step.py --steps 5 --arms k3post,trl-b1,k3post-glibc-defaults,trl-b1-tuned-alloc"
    measured = {"k3post": (6.73, 2.62, 382), "trl-b1": (9.33, 3.83, 297), "k3post-glibc-defaults": (8.81, 4.45, 382),
                "trl-b1-tuned-alloc": (7.46, 2.71, 297)}
    rows = bench.result_rows({arm: {"step": s, "learner": lrn, "tokens": t, "sample": 1.0} for arm, (s, lrn, t)
                              in measured.items()}, notes="test")
    old = old_current("opd-vs-trl", command)
    after = rerun(results, render, tmp_path, "opd-vs-trl", rows, bench.SECTION)
    assert len(old) == 16 and not still_current(after, old)
    same_values(after, old)
    assert [r["metric"] for r in after if r["headline"] and r["command"] == FIXED["command_"]] == [bench.HEADLINE]


def _gpu_result(batch, mode, tokens_s, mfu=0.2, sync=0.02):
    return {"batch": batch, "mode": mode, "tokens/s": tokens_s, "mfu": mfu, "sync": sync}


@pytest.mark.parametrize("placement,precision,gpus,measured,against,stale", [
    ("in-process", "bf16", 1, [(32, "sync", 11165, 0.202), (32, "async", 12729, 0.156)], None, set()),
    ("ray-shared", "bf16", 1, [(32, "sync", 9149), (32, "async", 9483)], None, set()),
    ("ray-shared-store", "bf16-mixed", 1, [(32, "sync", 1876), (32, "async", 2002)], None, set()),
    ("ray-split", "bf16", 2, [(32, "async", 11442), (128, "sync", 20000), (128, "async", 24956)],
     [(32, "async", 10943), (128, "async", 18042)], set()),
    ("in-process", "bf16", 2, [(128, "async", 18042)], None, set()),
])
def test_opd_step_gpu(results, render, tmp_path, placement, precision, gpus, measured, against, stale):
    bench = _module("opd_step_gpu")
    section = bench.SECTIONS[gpus > 1]
    section_exists(section)
    rows = bench.result_rows([_gpu_result(*m) for m in measured], placement, precision, "H200", gpus, 402_000_000,
                             baseline=525.0, against=[_gpu_result(*a) for a in against or ()])
    marks = {("in-process", 1): "in-process, bf16", ("ray-shared", 1): "ray-shared (cuda_ipc)",
             ("ray-shared-store", 1): "ray-shared-store", ("ray-split", 2): "two H200s",
             ("in-process", 2): "in-process on one of the two"}
    old = old_current("opd-step-gpu", where=lambda r: r["metric"].startswith(marks[placement, gpus]))
    after = rerun(results, render, tmp_path, "opd-step-gpu", rows, section)
    assert old and still_current(after, old) == stale
    same_values(after, old, skip=[m for m in old if "weight sync" in m])


def test_sandbox_cost(results, render, tmp_path, monkeypatch):
    bench = _module("sandbox_cost")
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
    cpu, gpu = _module("weight_check_cost"), _module("weight_check_gpu")
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
    bench = _module("cross_tokenizer_cost")
    section_exists(bench.SECTION)
    measured = [{"arm": "direct", "score_s": 1.35, "read_text_s": 0.0, "driver_bytes": 1568},
                {"arm": "cross-same", "score_s": 1.589, "read_text_s": 0.006, "driver_bytes": 1568},
                {"arm": "cross-12k", "score_s": 1.756, "read_text_s": 0.005, "driver_bytes": 2304}]
    old = old_current("cross-tokenizer-cost")
    after = rerun(results, render, tmp_path, "cross-tokenizer-cost", bench.result_rows(measured), bench.SECTION)
    assert len(old) == 9 and not still_current(after, old)
    same_values(after, old)


def test_fp8_qat_from_its_three_scripts(results, render, tmp_path):
    ptq, step, memory = _module("qat_vs_ptq"), _module("qat_step_gpu"), _module("learner_memory")
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
    memory = _module("learner_memory")
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
    bench = _module("learner_sharded")
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
    bench = _module("learner_sharded")
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
    bench = _module("quickstart_demo")
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


def test_every_recording_script_has_no_record_and_the_subjects_are_covered():
    scripts = ["opd_vs_trl_step", "opd_step_gpu", "sandbox_cost", "weight_check_cost", "weight_check_gpu",
               "cross_tokenizer_cost", "qat_vs_ptq", "qat_step_gpu", "learner_memory", "learner_sharded",
               "quickstart_demo", "cross_tokenizer_arms"]
    for name in scripts:
        text = (REPO / "bench" / f"{name}.py").read_text(encoding="utf-8")
        assert "add_no_record(parser)" in text or '"--no-record"' in text, name
        assert "record_and_say(" in text or "record(" in text, name


def test_opd_step_gpu_with_a_teacher_system_prompt_records_apart_from_the_throughput_rows():
    """A run with `--teacher-system-tokens` records the teacher phase, the step and tokens/s under
    names that say the prompt's length and the cache arm, never a name of the throughput rows."""
    bench = _module("opd_step_gpu")
    measured = [_gpu_result(32, "sync", 9000.0) | {"score": 0.25, "step": 0.9}]
    rows = {arm: bench.prefix_rows(measured, "in-process", "H200", 2048, arm) for arm in ("on", "off")}
    names = [r["metric"] for arm in rows for r in rows[arm]]
    assert len(names) == len(set(names)) == 6
    assert all("2048-token system prompt" in n for n in names)
    assert [r["value"] for r in rows["on"]] == [Decimal("0.250"), Decimal("0.900"), 9000]
    plain = {r["metric"] for r in bench.result_rows(measured, "in-process", "bf16", "H200", 1, 402_000_000)}
    assert not plain & set(names)


def test_vllm_teacher_recompute_share_is_the_system_prompts_part_of_the_phase():
    bench = _module("vllm_teacher_recompute")
    rows = bench.with_shares([{"system_tokens": 0, "n": 1, "rows": 8, "seconds": 2.0, "prefilled": 500},
                              {"system_tokens": 1024, "n": 1, "rows": 8, "seconds": 8.0, "prefilled": 8700},
                              {"system_tokens": 1024, "n": 4, "rows": 32, "seconds": 30.0, "prefilled": 35000}])
    assert rows[1]["share"] == pytest.approx(0.75) and "share" not in rows[0] and "share" not in rows[2]
    recorded = bench.result_rows(rows, "where")
    assert [r["value"] for r in recorded] == [2.0, 8.0, 75.0, 30.0]
    assert len({r["metric"] for r in recorded}) == 4
