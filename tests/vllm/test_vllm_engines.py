"""vLLM engines against the HF reference engine (CPU, fp32, enforce_eager).

The HF engine is the reference: vLLM's teacher scores and its sampler's recorded logprobs must
equal what transformers computes for the same token ids, and after a learner step and a weight
sync the engine must compute the learner's logprobs (which proves every tensor was applied,
the tied embedding/LM head included). Marked `vllm`: `pytest -m "not vllm"` skips them.
"""

from __future__ import annotations

import pytest
import torch

from k3post.config.schema import ModelSpec, OptimSpec, TeacherSpec, TinyModelSpec, VllmSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.samplers.sampler import HFSampler
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.model.scoring.logprobs import completion_logprobs
from k3post.types import Prompt, SamplingParams, TrainBatch
from tests.vllm.tolerance import APART, FP32_TOL

pytestmark = pytest.mark.vllm

# The CPU attention kernels take head sizes that are multiples of 32: hidden 64 over 2 heads.
STUDENT = ModelSpec(tiny=TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=1, seed=5))
TEACHER = TeacherSpec(model=ModelSpec(tiny=TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=1, seed=6,
                                                         init_std=0.2)),
                      engine="vllm", system_prompt="You are terse.")
ENGINE = VllmSpec(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_gib=0.25)
PROMPTS = [Prompt(f"p{i}", "chat", "t", (("user", text),))
           for i, text in enumerate(["What is 2+2?", "Name a colour.", "Say hi", "Count to three, please."])]
TOL = FP32_TOL


@pytest.fixture(scope="module")
def vllm_sampler():
    from k3post.engine.samplers.vllm_sampler import VLLMSampler

    return VLLMSampler(STUDENT, ENGINE)


@pytest.fixture(scope="module")
def vllm_teacher():
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher

    return VLLMTeacher("t", TEACHER.model_copy(update={"vllm": ENGINE}))


@pytest.fixture(scope="module")
def hf_rollouts():
    return HFSampler(STUDENT).sample(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, seed=1))


def test_teacher_scores_equal_hf_scores(vllm_teacher, hf_rollouts):
    hf = TeacherScorer("t", TEACHER.model_copy(update={"engine": "hf"}))
    want_BT = hf.score(hf_rollouts)
    got_BT = vllm_teacher.score(hf_rollouts)
    mask = hf_rollouts.loss_mask_BT.bool()
    assert mask.sum() > 20
    assert (got_BT[~mask] == 0).all()
    torch.testing.assert_close(got_BT[mask], want_BT[mask], atol=TOL, rtol=0)
    # The system prompt is part of the teacher's view: without it the scores move.
    plain = TeacherScorer("t", TEACHER.model_copy(update={"engine": "hf", "system_prompt": None}))
    assert (plain.score(hf_rollouts)[mask] - want_BT[mask]).abs().max() > APART


def test_sampler_records_the_logprobs_the_learner_computes(vllm_sampler):
    temperature = 0.7
    rollouts = vllm_sampler.sample(PROMPTS, SamplingParams(max_new_tokens=12, temperature=temperature, seed=3))
    hf = HFSampler(STUDENT)
    want_BT = completion_logprobs(hf.model, rollouts.prompt_ids, rollouts.completion_ids_BT, rollouts.loss_mask_BT,
                                  hf.tokenizer.pad_token_id, temperature)
    mask = rollouts.loss_mask_BT.bool()
    assert mask.sum() > 20 and rollouts.weight_version == 0
    torch.testing.assert_close(rollouts.sampler_logprobs_BT[mask], want_BT[mask], atol=TOL, rtol=0)
    assert (rollouts.sampler_logprobs_BT[~mask] == 0).all()
    # Rows end at the stop token or at max_new_tokens, and the text is what the tokens say.
    lengths = mask.sum(dim=1).long()
    for row, length in enumerate(lengths.tolist()):
        ids = rollouts.completion_ids_BT[row, :length].tolist()
        assert length == 12 or ids[-1] in vllm_sampler.stop_ids
        assert rollouts.texts[row] == hf.tokenizer.decode(ids, skip_special_tokens=True)


def test_same_seed_same_samples(vllm_sampler):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    a, b = vllm_sampler.sample(PROMPTS, params), vllm_sampler.sample(PROMPTS, params)
    assert torch.equal(a.completion_ids_BT, b.completion_ids_BT)


def _train_once(learner: Learner, rollouts) -> None:
    advantages_BT = torch.randn(rollouts.completion_ids_BT.shape, generator=torch.Generator().manual_seed(0))
    learner.train_step(TrainBatch(rollouts.prompt_ids, rollouts.completion_ids_BT, rollouts.loss_mask_BT,
                                  rollouts.sampler_logprobs_BT, advantages_BT * rollouts.loss_mask_BT))


@pytest.mark.parametrize("transport", ["in_place", "checkpoint"])
def test_after_a_learner_step_and_a_sync_vllm_computes_the_learners_logprobs(transport, hf_rollouts):
    from k3post.engine.samplers.vllm_sampler import VLLMSampler

    sampler = VLLMSampler(STUDENT, ENGINE.model_copy(update={"weight_sync": transport}))
    learner = Learner(LearnerConfig(student=STUDENT, optim=OptimSpec(lr=3e-2, micro_batch_size=4), total_steps=2))
    seq = (hf_rollouts.prompt_ids, hf_rollouts.completion_ids_BT, hf_rollouts.loss_mask_BT)
    mask = hf_rollouts.loss_mask_BT.bool()
    before_BT = sampler.sequence_logprobs(*seq)
    _train_once(learner, hf_rollouts)
    learner_BT = completion_logprobs(learner.model, *seq, learner.tokenizer.pad_token_id, 1.0).detach()
    assert (learner_BT[mask] - before_BT[mask]).abs().max() > APART  # the step moved the policy

    assert sampler.load_weights(learner.weights(), version=1) == 1
    after_BT = sampler.sequence_logprobs(*seq)
    torch.testing.assert_close(after_BT[mask], learner_BT[mask], atol=TOL, rtol=0)
    assert sampler.weight_version == 1
    # Samples are stamped with the weights they came from; the first after a sync reports its seconds.
    first = sampler.sample(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    assert first.weight_version == 1 and first.sampler_stats["sampler/reload_s"] > 0
    assert sampler.sample(PROMPTS[:1], SamplingParams(max_new_tokens=2)).sampler_stats["sampler/reload_s"] == 0.0
    # The full distributions (exact-KL evals) come from an HF copy kept in step with the sync.
    full_BTV = sampler.full_logprobs(hf_rollouts, 1.0)
    from_full_BT = full_BTV.gather(-1, hf_rollouts.completion_ids_BT[..., None]).squeeze(-1)
    torch.testing.assert_close(from_full_BT[mask], learner_BT[mask], atol=TOL, rtol=0)


def test_a_partial_sync_is_refused(vllm_sampler):
    from k3post.engine.vllm.vllm_engine import load_weights_in_place
    from k3post.model.training.weights import export_weights

    weights = export_weights(HFSampler(STUDENT).model)
    weights.pop("model.layers.1.mlp.down_proj.weight")
    with pytest.raises(RuntimeError, match="left 1 vLLM parameters unchanged"):
        load_weights_in_place(vllm_sampler.llm, weights)


def _plain_in_worker(worker) -> bool:
    from k3post.engine.vllm.vllm_engine import plain_layers_only

    return plain_layers_only(worker.model_runner.model)


def test_a_sync_takes_the_direct_load_only_where_nothing_reworks_the_weights(vllm_sampler):
    """The direct load (`model.load_weights` into the live parameters) is right only where no
    layer reworks its weights after loading. The student's layers are plain (linear, embedding,
    attention without derived weights), yet on a CPU the sync takes the reload: vLLM's CPU
    linears keep oneDNN packs of their weights. A quantized linear, or a layer with weights
    derived after loading (MLA's absorbed projections), is not plain."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from k3post.engine.vllm.vllm_engine import last_sync_path, load_weights_in_place, plain_layers_only
    from k3post.model.training.weights import export_weights

    assert vllm_sampler.llm.collective_rpc(_plain_in_worker) == [True]
    load_weights_in_place(vllm_sampler.llm, export_weights(HFSampler(STUDENT).model))
    assert last_sync_path(vllm_sampler.llm) == "reload"

    def model(method=None, derived=False) -> torch.nn.Module:
        layer = torch.nn.Linear(2, 2)
        layer.quant_method = method
        if derived:
            layer.process_weights_after_loading = lambda dtype: None
        return torch.nn.Sequential(torch.nn.Linear(2, 2), layer)

    assert plain_layers_only(model(UnquantizedLinearMethod()))
    class Repacking(UnquantizedLinearMethod):  # as FP8's or a MoE kernel's: reworks weights once loaded
        def process_weights_after_loading(self, layer):
            layer.weight.data = layer.weight.data.t().contiguous()

    assert not plain_layers_only(model(Repacking()))
    assert not plain_layers_only(model(derived=True))


def test_the_weight_sync_check_sees_a_tensor_corrupted_on_its_way_into_vllm(vllm_sampler, monkeypatch):
    """engine/transport/weight_check.py through vLLM: the checked tensors are checksummed as they reach the
    engine's loader (vllm_engine.py: received_checksums); clean syncs pass, one perturbed on the
    way fails naming it, and the restored transport passes again."""
    import k3post.engine.samplers.vllm_sampler as module
    from k3post.engine.transport.weight_check import WeightSyncMismatch, checked_names
    from k3post.launch.in_process import DirectWeightSync, LocalSamplers

    learner = Learner(LearnerConfig(student=STUDENT, optim=OptimSpec(lr=1e-3), total_steps=2, num_threads=2))
    sync = DirectWeightSync(learner, LocalSamplers(vllm_sampler))
    sync.push(1)
    target = checked_names(list(learner.weights()), 2)[0]
    clean_sync = module.timed_sync

    def corrupted(llm, weights, how, check=()):
        weights = dict(weights)
        weights[target] = torch.as_tensor(weights[target]).clone()
        weights[target].view(-1)[0] += 1e-3
        return clean_sync(llm, weights, how, check)

    monkeypatch.setattr(module, "timed_sync", corrupted)
    with pytest.raises(WeightSyncMismatch, match=f"v2: sampler replica 0 does not hold the learner's '{target}'"):
        sync.push(2)
    monkeypatch.undo()
    sync.push(2)


def test_an_engine_core_in_its_own_process_takes_a_sync_and_every_check(hf_rollouts):
    """The engine core in a process of its own (what a sleeping engine runs on a GPU, where the
    weights then travel as CUDA IPC handles; here host tensors through collective_rpc): the sync
    writes every parameter, the checksums come back from that process, and the engine computes
    the learner's logprobs. Engines of both kinds live in this one process (the vLLM environment
    cache is cleared around each build)."""
    from k3post.engine.transport.weight_check import checked_names, checksum
    from k3post.engine.vllm.vllm_engine import build_llm, load_weights_in_place, received_checksums, token_logprobs

    llm = build_llm(STUDENT, ENGINE, own_process=True)
    assert llm.k3post_own_process and type(llm.llm_engine.engine_core).__name__ != "InprocClient"
    learner = Learner(LearnerConfig(student=STUDENT, optim=OptimSpec(lr=3e-2, micro_batch_size=4), total_steps=2))
    _train_once(learner, hf_rollouts)
    weights = learner.weights()
    check = tuple(checked_names(list(weights), 1))
    load_weights_in_place(llm, weights, check)
    received = received_checksums(llm)
    assert set(received) == set(check) and all(received[n] == checksum(torch.as_tensor(weights[n])) for n in check)
    seq = (hf_rollouts.prompt_ids, hf_rollouts.completion_ids_BT, hf_rollouts.loss_mask_BT)
    mask = hf_rollouts.loss_mask_BT.bool()
    learner_BT = completion_logprobs(learner.model, *seq, learner.tokenizer.pad_token_id, 1.0).detach()
    torch.testing.assert_close(token_logprobs(llm, *seq)[mask], learner_BT[mask], atol=TOL, rtol=0)
    llm.llm_engine.engine_core.shutdown()
