"""`sampling.on_policy: bitwise` in the recipe and the run: where it is refused at load, the stop on
the first step whose largest |log π − log μ| is not exactly 0, and in-process OPD and RL runs on
the tiny smoke models in which every step's figure is exactly 0 and every importance ratio 1."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from k3post.cli.run import run_recipe
from k3post.config.drift_schema import DriftSpec
from k3post.config.errors import RecipeError, RunStopped
from k3post.config.load import load_recipe, load_run_recipe
from k3post.launch.distill import build_distill_run
from k3post.launch.in_process import InProcessBackend
from k3post.loops import distill as loop
from k3post.loops.drift_gate import DriftGate, DriftStopped
from k3post.track.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "recipes" / "smoke" / "tiny.yaml"
SMOKE_RL = REPO / "recipes" / "smoke" / "tiny-rl.yaml"
BITWISE = "sampling.on_policy=bitwise"
SHORT = ["train.eval_every=0", "train.checkpoint_every=0", "sampling.max_new_tokens=6"]


def test_off_is_the_default_and_bitwise_loads_on_the_hf_cpu_paths():
    assert load_run_recipe(SMOKE).sampling.on_policy == "off"
    assert load_run_recipe(SMOKE, ["sampling.on_policy=off"]).sampling.on_policy == "off"  # YAML's bare off: false
    assert load_run_recipe(SMOKE, [BITWISE]).sampling.on_policy == "bitwise"
    assert load_run_recipe(SMOKE_RL, [BITWISE]).sampling.on_policy == "bitwise"
    static = load_run_recipe(SMOKE, [BITWISE, "sampling.cache=static", "sampling.compile=true"]).sampling
    assert (static.cache, static.compile) == ("static", True)  # compile: a CUDA graph of the eager step (a CPU: eager)


@pytest.mark.parametrize("overrides, key", [
    (["sampling.engine=vllm"], "sampling.engine: vllm"),
    (["draft.kind=mtp", "draft.speculate={tokens: 2}"], "draft.speculate"),
    (["lora.rank=4"], "lora.rank"),
    (["qat.enabled=true"], "qat.enabled"),
    (["train.compile=true"], "train.compile"),
    (["resources.learner.replicas=2"], "resources.learner.replicas"),
    (["learner.sharding=always"], "learner.sharding: always"),
    (["learner.precision=bf16-mixed"], "learner.precision: bf16-mixed"),
    # a GPU learner with a CPU sampler and the other way round (both on GPUs is covered)
    (["resources.learner.num_gpus=1"], "resources.samplers.num_gpus"),
    (["resources.samplers.num_gpus=1", "resources.samplers.num_cpus=1"], "resources.samplers.num_gpus"),
    (["train.mode=async"], "train.mode: async"),
])
def test_paths_the_mode_does_not_cover_are_refused_at_load_naming_the_key(overrides, key):
    load_run_recipe(SMOKE, overrides)  # each is a valid recipe without bitwise mode
    with pytest.raises(RecipeError, match=rf"sampling.on_policy: bitwise does not cover {key} \(.*\); set .*, or "
                                          r"sampling.on_policy: off"):
        load_run_recipe(SMOKE, [BITWISE, *overrides])


def test_rl_recipes_are_checked_too():
    with pytest.raises(RecipeError, match=r"sampling.on_policy: bitwise does not cover lora.rank"):
        load_run_recipe(SMOKE_RL, [BITWISE, "lora.rank=4"])


def test_the_gate_stops_on_any_gap_in_bitwise_mode_and_only_there():
    spec = DriftSpec()  # the thresholds are far above a 1e-9 gap: only bitwise mode acts on it
    for value in (1e-9, math.nan):
        with pytest.raises(DriftStopped, match=r"stopped at step 3: sampling.on_policy is bitwise, yet .* differ by up "
                                               r"to .* nats .*A broken invariant is a bug, not noise") as stop:
            DriftGate(spec, exact=True).check(3, {"train/logprob_abs_diff_max": value, "train/logprob_abs_diff": 0.0})
        assert isinstance(stop.value, RunStopped) and stop.value.metrics["drift/stopped"] == 1.0
    assert DriftGate(spec, exact=True).check(3, {"train/logprob_abs_diff_max": 0.0, "train/logprob_abs_diff": 0.0})[
        "drift/warned"] == 0.0
    assert DriftGate(spec).check(3, {"train/logprob_abs_diff_max": 1e-9, "train/logprob_abs_diff": 1e-9})[
        "drift/warned"] == 0.0


def test_a_learner_whose_weights_differ_by_one_element_stops_the_run_at_its_first_step(tmp_path):
    """One weight of the learner only, nudged after the samplers got the weights: step 1's largest
    gap is not 0, the step is logged with drift/stopped = 1, and the run stops."""
    recipe = load_recipe(SMOKE, [BITWISE, "train.steps=2", *SHORT])
    run = build_distill_run(recipe, tmp_path, InProcessBackend())
    push = run.weight_sync.push

    def push_then_nudge(version: int) -> None:
        push(version)
        with torch.no_grad():
            run.learner.model.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3

    run.weight_sync.push = push_then_nudge
    with pytest.raises(DriftStopped, match=r"stopped at step 1: sampling.on_policy is bitwise, yet the learner's log π "
                                           r"and the sampler's log μ differ by up to"):
        loop.run_distill(run)
    row = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert row["step"] == 1 and row["drift/stopped"] == 1.0 and row["train/logprob_abs_diff_max"] > 0


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_an_opd_run_in_bitwise_mode_has_no_gap_at_any_step(tmp_path, cache):
    """The whole loop (sample → score → train → sync) for three steps, with either HF sampler: the
    learner's recomputation equals the sampler's record exactly at every step, so every importance
    ratio is exactly 1."""
    overrides = [BITWISE, f"sampling.cache={cache}", "train.steps=3", *SHORT, "train.eval_every=3"]
    assert run_recipe(SMOKE, overrides, tmp_path, in_process=True, restart=False) == 0
    steps = [m for m in read_metrics(tmp_path / "metrics.jsonl") if "train/logprob_abs_diff_max" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["train/logprob_abs_diff_max"] == 0.0 and m["train/logprob_abs_diff"] == 0.0
        assert m["train/ratio_mean"] == 1.0 and m["train/ratio_max"] == 1.0 and m["train/sampler_kl"] == 0.0
        assert m["train/tokens"] > 0


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_under_fp8_qat_with_rollouts_on_its_grid_no_step_has_a_gap_and_the_off_mode_has_one(tmp_path, cache):
    """FP8 QAT (fake quantisation from step 2) with FP8 rollouts: the sampler's Fp8Linears hold
    e4m3 bytes and scales, the learner's FakeQuantizedLinears its fp32 weights; in bitwise mode
    the learner's log π equals the sampler's log μ at every step, before the switch and after it.
    With the mode off the gap is there once the layers quantise."""
    common = ["qat.enabled=true", "sampling.weights=fp8", "qat.fake_quant_after_n_steps=1", "train.steps=3",
              f"sampling.cache={cache}", *SHORT]
    runs = {}
    for mode in ("off", "bitwise") if cache == "dynamic" else ("bitwise",):  # the off run's gap: once is enough
        assert run_recipe(SMOKE, [f"sampling.on_policy={mode}", *common], tmp_path / mode, in_process=True,
                          restart=False) == 0
        runs[mode] = [m for m in read_metrics(tmp_path / mode / "metrics.jsonl") if "train/logprob_abs_diff_max" in m]
    assert [m["train/fake_quant"] for m in runs["bitwise"]] == [0.0, 1.0, 1.0]
    for m in runs["bitwise"]:
        assert m["train/logprob_abs_diff_max"] == 0.0 and m["train/ratio_max"] == 1.0 and m["train/ratio_mean"] == 1.0
    if "off" in runs:
        assert min(m["train/logprob_abs_diff_max"] for m in runs["off"][1:]) > 0.0


def test_an_rl_run_in_bitwise_mode_has_no_gap_and_the_off_mode_has_one(tmp_path):
    common = ["train.steps=2", *SHORT, "data.prompts_per_step=2"]
    figures = {}
    for mode in ("off", "bitwise"):
        assert run_recipe(SMOKE_RL, [f"sampling.on_policy={mode}", *common], tmp_path / mode, in_process=True,
                          restart=False) == 0
        figures[mode] = [m["train/logprob_abs_diff_max"] for m in read_metrics(tmp_path / mode / "metrics.jsonl")
                         if "train/logprob_abs_diff_max" in m]
    print("largest gap per step:", figures)
    assert figures["bitwise"] == [0.0, 0.0]
    assert len(figures["off"]) == 2 and min(figures["off"]) > 0.0
