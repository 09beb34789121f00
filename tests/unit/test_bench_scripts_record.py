"""Every script of bench/ (its subject folders included) that measures records what it measures
(bench/results.py), and takes a trial-run switch that records nothing."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

NOT_MEASURING = {
    "results": "the recorder itself",
    "render_tables": "renders bench/results into the docs",
    "bench_arms": "a module of bench/alternatives/opd_vs_alternatives.py, which records",
    "bench_report": "a module of bench/alternatives/opd_vs_alternatives.py, which records",
    "bench_trl": "a module of bench/alternatives/opd_vs_alternatives.py, which records",
    "plan_vs_measured": "prints the planner's predictions; its --run measurement is "
                        "bench/learner/learner_sharded.py's, which records",
    "vllm_hazards_on_gpu": "a functional check of the vLLM engines' GPU placement: what happened, no figure",
    "prefix_cases": "the system prompts and docs section of the prefix-cache benchmarks, which record",
    "speculation_profile": "the profiler arm of bench/sampling/speculation_gpu.py (--profile), which records",
    "acceptance_check": "the acceptance arm of bench/sampling/speculation_gpu.py (--check-acceptance), which "
                        "records",
    "opd_gpu_rows": "the rows and table of bench/opd/opd_step_gpu.py, which records",
    "invariance_probe_gpu": "a functional check of the GPU's kernels (rows whose bits differ), no timing or memory",
}


def test_every_bench_script_records_its_figures():
    """Every script of bench/ that measures records its rows (record_and_say / record) and takes
    --no-record for a trial run (bench/sampling/decode_step_gpu.py records only when given --results
    DIR); a script that prints no figure of its own is named in NOT_MEASURING with the reason."""
    paths = {p.stem: p for p in (REPO / "bench").rglob("*.py")}
    assert len(paths) == len(list((REPO / "bench").rglob("*.py"))), "two scripts of bench/ share a name"
    scripts = sorted(paths)
    assert not set(NOT_MEASURING) - set(scripts), "NOT_MEASURING names a script that is gone"
    missing = []
    for name in scripts:
        if name in NOT_MEASURING:
            continue
        text = paths[name].read_text(encoding="utf-8")
        records = "record_and_say(" in text or "record(" in text
        trial = "add_no_record(parser)" in text or '"--no-record"' in text or '"--results"' in text
        if not (records and trial):
            missing.append(name)
    assert len(scripts) - len(NOT_MEASURING) >= 20 and not missing, (
        f"bench scripts that print figures without recording them (results.record_and_say, --no-record): {missing}")
