"""The vLLM-on-GPU hazards, checked on CPU vLLM (fp32, eager) with the tiny random Llama.

vLLM on a GPU cannot run here, so what is checked is the path each engine takes: the engines are
built as if their actors held half a GPU (`num_gpus: 0.5`, where `engine_device` says "cuda"), and

- the vLLM engine is configured from that share (gpu_memory_utilization 0.9 × 0.5, TP size 1);
- the teacher's evaluation (exact KL) and its score spot check run on an HF copy on the CPU —
  before the fix that copy went to "cuda", which fails here as it would OOM beside vLLM there;
- the sampler copies no weight at a sync and holds no HF copy after one; its full distributions
  come from an HF copy on the CPU built from the weights of that moment, kept until the next sync.

One engine for the module (a CPU start takes 40-50 s): the teacher under test scores with the
student's model on the sampler's engine, and the sampler test puts the engine's weights back.
(Engines cannot be shared across modules: vLLM's parallel state is global to the process, and an
engine of another module going away tears it down.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3post.config.schema import ModelSpec, OptimSpec, ResourceSpec, TeacherSpec, TinyModelSpec, VllmSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.samplers.sampler import HFSampler
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.model.scoring.logprobs import completion_full_logprobs
from k3post.model.training.weights import export_weights
from k3post.types import Prompt, SamplingParams, TrainBatch

pytestmark = pytest.mark.vllm

# The CPU attention kernels take head sizes that are multiples of 32: hidden 64 over 2 heads.
STUDENT = ModelSpec(tiny=TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=1, seed=5))
ENGINE = VllmSpec(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_gib=0.25)
HALF_A_GPU = ResourceSpec(num_gpus=0.5)
TEACHER = TeacherSpec(model=STUDENT, engine="vllm", vllm=ENGINE, resources=HALF_A_GPU, system_prompt="You are terse.")
PROMPTS = [Prompt(f"p{i}", "chat", "t", (("user", text),))
           for i, text in enumerate(["What is 2+2?", "Name a colour.", "Say hi", "Count to three, please."])]
TOL = 1e-3


@pytest.fixture(scope="module")
def sampler():
    from k3post.engine.samplers.vllm_sampler import VLLMSampler

    return VLLMSampler(STUDENT, ENGINE, num_gpus=HALF_A_GPU.num_gpus)


@pytest.fixture(scope="module")
def teacher(sampler):
    import k3post.engine.teachers.vllm_teacher as vllm_teacher

    with pytest.MonkeyPatch.context() as patch:  # the same model: reuse the sampler's engine
        patch.setattr(vllm_teacher, "build_llm", lambda *args, **kwargs: sampler.llm)
        return vllm_teacher.VLLMTeacher("t", TEACHER)


@pytest.fixture(scope="module")
def rollouts(sampler):
    return sampler.sample(PROMPTS, SamplingParams(max_new_tokens=10, temperature=1.0, seed=2))


def test_the_engine_is_configured_from_the_actors_share(sampler):
    config = sampler.llm.llm_engine.vllm_config
    assert config.cache_config.gpu_memory_utilization == pytest.approx(0.9 * 0.5)
    assert config.parallel_config.tensor_parallel_size == 1


def test_evaluation_through_the_vllm_teacher_runs_on_a_cpu_copy(teacher, sampler, rollouts):
    from k3post.engine.common import engine_device

    assert engine_device(teacher.spec.resources) == "cuda"  # what the HF copy used to be put on
    student_BTV = sampler.full_logprobs(rollouts, 1.0)
    got = teacher.exact_kl(rollouts, student_BTV, "reverse")
    hf = teacher._hf
    assert hf is not None and hf.device.type == "cpu"
    assert {p.device.type for p in hf.model.parameters()} == {"cpu"}
    # The same figure as an HF teacher's: the copy is the teacher.
    want = TeacherScorer("t", TEACHER.model_copy(update={"engine": "hf", "resources": ResourceSpec()})).exact_kl(
        rollouts, student_BTV, "reverse")
    assert got["tokens"] == want["tokens"] > 10
    assert got["kl_sum"] == pytest.approx(want["kl_sum"], abs=1e-5)


def test_check_scores_compares_vllm_with_hf_on_the_first_two_rows(teacher, rollouts):
    check = teacher.check_scores(rollouts)
    assert set(check) == {"max_abs_diff", "mean_abs_diff"}
    assert 0 <= check["mean_abs_diff"] <= check["max_abs_diff"] < TOL
    assert check == teacher.check_scores(rollouts.select([0, 1]))  # rows 2 and 3 are not recomputed
    assert teacher._hf.device.type == "cpu"
    empty = dataclasses.replace(rollouts.select([0, 1]), loss_mask_BT=torch.zeros_like(rollouts.loss_mask_BT[:2]))
    assert teacher.check_scores(empty) is None
    # It sees drift: with the HF side's output head perturbed, the scores part.
    head = teacher._full().model.get_output_embeddings().weight
    saved = head.detach().clone()
    with torch.no_grad():
        head.add_(0.05 * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    try:
        assert teacher.check_scores(rollouts)["max_abs_diff"] > 50 * TOL
    finally:
        with torch.no_grad():
            head.copy_(saved)


def _trained_learner(rollouts) -> Learner:
    learner = Learner(LearnerConfig(student=STUDENT, optim=OptimSpec(lr=3e-2, micro_batch_size=4), total_steps=2))
    advantages_BT = torch.randn(rollouts.completion_ids_BT.shape, generator=torch.Generator().manual_seed(0))
    learner.train_step(TrainBatch(rollouts.prompt_ids, rollouts.completion_ids_BT, rollouts.loss_mask_BT,
                                  rollouts.sampler_logprobs_BT, advantages_BT * rollouts.loss_mask_BT))
    return learner


def _modules_held(engine) -> list[str]:
    return [name for name, value in vars(engine).items() if isinstance(value, (torch.nn.Module, HFSampler))]


def test_the_sampler_keeps_no_hf_copy_and_copies_no_weights_at_a_sync(sampler, rollouts):
    learner = _trained_learner(rollouts)
    weights = learner.weights()
    try:
        sampler.load_weights(weights, 1)
        assert _modules_held(sampler) == []
        assert sampler._weights is weights  # a reference to what the transport delivered, not a copy
        # Full distributions come from the weights of this moment, on an HF copy on the CPU ...
        full_BTV = sampler.full_logprobs(rollouts, 1.0)
        want_BTV = completion_full_logprobs(learner.model, rollouts.prompt_ids, rollouts.completion_ids_BT,
                                            rollouts.loss_mask_BT, learner.tokenizer.pad_token_id, 1.0).detach()
        mask = rollouts.loss_mask_BT.bool()
        torch.testing.assert_close(full_BTV[mask], want_BTV[mask], atol=1e-5, rtol=0)
        assert _modules_held(sampler) == ["_hf"] and sampler._hf.device.type == "cpu"
        assert sampler._weights is None  # the transport's buffers let go once in the copy
        copy = sampler._hf
        sampler.full_logprobs(rollouts.select([0]), 1.0)
        assert sampler._hf is copy  # one copy per weight version (an evaluation asks several times)
        # ... which the next sync drops, as a broadcast receive lets the last weights go first.
        sampler.load_weights(weights, 2)
        assert _modules_held(sampler) == [] and sampler._weights is weights

        class OneBroadcast:  # a broadcast group's receiving end
            def receive(self):
                assert sampler._weights is None
                return weights

        sampler.full_logprobs(rollouts.select([0]), 1.0)
        sampler._weight_group = OneBroadcast()
        assert sampler.receive_weights(3) == 3 and sampler._weights is weights and _modules_held(sampler) == []
    finally:  # the engine back at the model's own weights (the teacher tests share it)
        sampler.load_weights(export_weights(HFSampler(STUDENT).model), 0)
        sampler._weights, sampler._weight_group = None, None
