"""FP8 rollouts (`sampling.weights: fp8`): the sampler draws from the learner's FP8 QAT forward, so
μ and the learner's π are one function - its logprobs equal the learner's fake-quantised ones on
the same tokens (fp32, CPU), from the weight version at which the learner's fake quantisation
turns on - while sampling from the full weights differs. A tiny in-process QAT run logs the
sampler-vs-learner gap the drift gate reads: zero with FP8 rollouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3post.config.errors import RecipeError
from k3post.config.load import load_run_recipe
from k3post.config.schema import ModelSpec, OptimSpec, QatSpec, TinyModelSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.samplers.sampler import HFSampler
from k3post.model.scoring.logprobs import completion_logprobs
from k3post.types import Prompt, SamplingParams

REPO = Path(__file__).resolve().parents[2]
SPEC = ModelSpec(tiny=TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, seed=4, init_std=0.05))
PROMPTS = [Prompt(f"u{i}", "s", "t", (("user", f"Question number {i}?"),)) for i in range(4)]


def qat_learner(after: int = 0) -> Learner:
    return Learner(LearnerConfig(student=SPEC, optim=OptimSpec(lr=1e-3, micro_batch_size=4), total_steps=10,
                                 num_threads=2, qat=QatSpec(enabled=True, fake_quant_after_n_steps=after)))


def learner_logprobs(lrn: Learner, rollouts) -> torch.Tensor:
    lrn._update_fake_quant()  # as its step does first
    with torch.no_grad():
        return completion_logprobs(lrn.model, rollouts.prompt_ids, rollouts.completion_ids_BT, rollouts.loss_mask_BT,
                                   lrn.tokenizer.pad_token_id, 1.0)


def gap(lrn: Learner, sampler: HFSampler, version: int) -> float:
    sampler.load_weights(lrn.weights(), version)
    rollouts = sampler.sample(PROMPTS, SamplingParams(max_new_tokens=8, seed=version))
    mask = rollouts.loss_mask_BT.bool()
    return float((rollouts.sampler_logprobs_BT - learner_logprobs(lrn, rollouts))[mask].abs().max())


def test_fp8_rollouts_are_the_learners_qat_forward_and_full_weights_are_not():
    lrn = qat_learner()
    assert gap(lrn, HFSampler(SPEC, num_threads=2, fp8_from_version=0), 1) < 1e-6
    assert gap(lrn, HFSampler(SPEC, num_threads=2), 1) > 1e-4


def test_the_sampler_follows_the_learners_fake_quant_schedule():
    """qat.fake_quant_after_n_steps = 2: weights pushed after step 1 drew step 2's samples in full
    precision, as the learner's step 2 computes; from the weights of step 2 on, both quantise."""
    lrn, sampler = qat_learner(after=2), HFSampler(SPEC, num_threads=2, fp8_from_version=2)
    lrn.steps_done = 1
    assert gap(lrn, sampler, 1) < 1e-6
    lrn.steps_done = 2
    assert gap(lrn, sampler, 2) < 1e-6


@pytest.mark.parametrize("overrides, message", [
    (["sampling.weights=fp8"], r"sampling.weights: fp8 samples with the learner's FP8 QAT forward; it needs qat"),
    (["sampling.weights=fp8", "qat.enabled=true", "sampling.engine=vllm"], r"sampling.weights: fp8 runs the QAT "
                                                                         r"forward in the HF sampler"),
])
def test_fp8_rollouts_without_qat_or_on_vllm_are_refused(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_run_recipe(REPO / "recipes" / "smoke" / "tiny.yaml", overrides)


def test_a_qat_run_with_fp8_rollouts_has_no_sampler_learner_gap(tmp_path):
    from k3post.cli.run import run_recipe
    from k3post.track.metrics import read_metrics

    common = ["train.steps=2", "qat.enabled=true", "student.tiny.hidden_size=64", "student.tiny.intermediate_size=128"]
    gaps = {}
    for weights in ("full", "fp8"):
        assert run_recipe(REPO / "recipes" / "smoke" / "tiny.yaml", [*common, f"sampling.weights={weights}"],
                          tmp_path / weights, in_process=True, restart=False) == 0
        gaps[weights] = [m["train/logprob_abs_diff"] for m in read_metrics(tmp_path / weights / "metrics.jsonl")
                         if "train/logprob_abs_diff" in m]
    assert max(gaps["fp8"]) < 1e-6 < min(gaps["full"]), gaps
