"""bench/opd/opd_step_gpu.py's rows (and bench/opd/opd_vs_trl_step.py's for its --trl arm): each
placement's re-run supersedes the recorded rows with the same values, and the teacher-prompt and
TRL arms record under names no throughput row has. The harness is test_bench_recording.py's."""

from __future__ import annotations

from decimal import Decimal

import pytest

from tests.unit.test_bench_recording import (  # noqa: F401  (results, render: fixtures)
    FIXED, _module, old_current, render, rerun, results, same_values, section_exists, still_current)


def _gpu_result(batch, mode, tokens_s, mfu=0.2, sync=0.02):
    return {"batch": batch, "mode": mode, "tokens/s": tokens_s, "mfu": mfu, "sync": sync}


@pytest.mark.parametrize("placement,precision,gpus,measured,against,stale", [
    ("in-process", "bf16", 1, [(32, "sync", 12025, 0.196), (32, "async", 14125, 0.169)], None, set()),
    ("ray-shared", "bf16", 1, [(32, "sync", 9149), (32, "async", 9483)], None, set()),
    ("ray-shared-store", "bf16-mixed", 1, [(32, "sync", 1876), (32, "async", 2002)], None, set()),
    ("ray-split", "bf16", 2, [(32, "async", 11442), (128, "sync", 20000), (128, "async", 24956)],
     [(32, "async", 10943), (128, "async", 18042)], set()),
    ("in-process", "bf16", 2, [(128, "async", 18042)], None, set()),
])
def test_opd_step_gpu(results, render, tmp_path, placement, precision, gpus, measured, against, stale):
    bench = _module("opd.opd_step_gpu")
    section = bench.SECTIONS[gpus > 1]
    section_exists(section)
    rows = bench.result_rows([_gpu_result(*m) for m in measured], placement, precision, "H200", gpus, 402_000_000,
                             baseline=525.0, against=[_gpu_result(*a) for a in against or ()])
    marks = {("in-process", 1): "in-process, bf16", ("ray-shared", 1): "ray-shared (cuda_ipc)",
             ("ray-shared-store", 1): "ray-shared-store", ("ray-split", 2): "two H200s",
             ("in-process", 2): "in-process on one of the two"}
    old = old_current("opd-step-gpu", where=lambda r: r["metric"].startswith(marks[placement, gpus])
                      and "vLLM" not in r["metric"])  # the vLLM engines' rows are another arm
    after = rerun(results, render, tmp_path, "opd-step-gpu", rows, section)
    assert old and still_current(after, old) == stale
    same_values(after, old, skip=[m for m in old if "weight sync" in m])


def test_opd_step_gpu_with_a_teacher_system_prompt_records_apart_from_the_throughput_rows():
    """A run with `--teacher-system-tokens` records the teacher phase, the step and tokens/s under
    names that say the prompt's length and the cache arm, never a name of the throughput rows."""
    bench = _module("opd.opd_step_gpu")
    measured = [_gpu_result(32, "sync", 9000.0) | {"score": 0.25, "step": 0.9}]
    rows = {arm: bench.prefix_rows(measured, "in-process", "H200", 2048, arm) for arm in ("on", "off")}
    names = [r["metric"] for arm in rows for r in rows[arm]]
    assert len(names) == len(set(names)) == 6
    assert all("2048-token system prompt" in n for n in names)
    assert [r["value"] for r in rows["on"]] == [Decimal("0.250"), Decimal("0.900"), 9000]
    plain = {r["metric"] for r in bench.result_rows(measured, "in-process", "bf16", "H200", 1, 402_000_000)}
    assert not plain & set(names)


def test_opd_step_gpu_against_trl_in_the_same_process(results, render, tmp_path):
    """A `--trl` run records TRL's step per batch and, per batch and mode, TRL's step over k3post's
    (how many times as fast k3post's is), under names no throughput row has."""
    bench = _module("opd.opd_step_gpu")
    measured = [_gpu_result(32, "sync", 9000.0) | {"step": 0.9}, _gpu_result(32, "async", 11000.0) | {"step": 0.75}]
    rows = _module("opd.opd_vs_trl_step").trl_rows(measured, {32: {"step": 4.5}}, "H200")
    after = rerun(results, render, tmp_path, "opd-step-gpu", rows, bench.SECTIONS[False])
    mine = {r["metric"]: (r["value"], r["unit"], r["ratio_to"]) for r in after if r["command"] == FIXED["command_"]}
    against = "OPD step speed-up over TRL GKDTrainer's in the same process (TRL's step ÷ k3post's)"
    assert mine == {
        "TRL GKDTrainer (β = 1, λ = 1) on one H200, batch 32, same models and new tokens: step":
            (Decimal("4.500"), "s", None),
        f"in-process, batch 32, sync: {against}": (Decimal("5.0"), "×", "TRL GKDTrainer, batch 32 (4.50 s a step)"),
        f"in-process, batch 32, async: {against}": (Decimal("6.0"), "×", "TRL GKDTrainer, batch 32 (4.50 s a step)")}
    plain = {r["metric"] for r in bench.result_rows(measured, "in-process", "bf16", "H200", 1, 402_000_000)}
    assert not plain & set(mine)


def test_opd_step_gpu_in_bitwise_mode_records_its_gap_and_its_cost_against_the_default(results, render, tmp_path):
    """A `--on-policy bitwise` run records the largest gap over its steps, its step, and step, sampling
    and train phase against the default run it was given (`--against`), under the on-policy cost
    section; re-running it with the recorded figures supersedes them with the same values."""
    bench = _module("opd.opd_step_gpu")
    on = {"batch": 32, "mode": "sync", "step": 11.925, "sample": 10.947, "train": 0.830, "logprob_abs_diff_max": 0.0,
          "steps": 3}
    default = {"batch": 32, "mode": "sync", "step": 0.679, "sample": 0.409, "train": 0.134}
    arm = bench.on_policy_arm("dynamic", "off")
    rows = bench.on_policy_rows([on], [default], "H100 80GB HBM3", arm)
    values = {r["metric"].split(", sync: ")[1]: r["value"] for r in rows}
    assert values == {"largest |log π − log μ| over 3 steps": 0.0, "step": Decimal("11.925"),
                      "step against the default": Decimal("17.56"), "sampling phase against the default": Decimal("26.77"),
                      "learner's train phase against the default": Decimal("6.19")}
    assert len(bench.on_policy_rows([on], None, "H100 80GB HBM3", arm)) == 2  # no default run given: no ratios
    # each arm (the sampler's cache, the precision) its own rows: one arm's run supersedes no other's
    arms = [bench.on_policy_arm(cache, qat) for cache in ("dynamic", "static") for qat in ("off", "fp8-rollouts")]
    metrics = [{r["metric"] for r in bench.on_policy_rows([on], [default], "H100 80GB HBM3", a)} for a in arms]
    assert all(not metrics[i] & metrics[j] for i in range(4) for j in range(i + 1, 4))
    section_exists(bench.ON_POLICY_SECTION)
    old = old_current("on-policy-cost", where=lambda r: "H100" in r["metric"] and arm in r["metric"])
    after = rerun(results, render, tmp_path, "on-policy-cost", rows, bench.ON_POLICY_SECTION)
    assert old and still_current(after, old) == set()
