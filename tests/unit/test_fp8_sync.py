"""The FP8 weight sync (`sampling.weights: fp8`; model/quant/fp8_sync.py, model/quant/fp8_linear.py), in process
and over a gloo broadcast group. (Over a real Ray cluster: tests/integration/test_ray_fp8_sync.py.)

- What the learner sends is its QAT forward's weight grid: each quantised Linear's e4m3 bytes and
  fp32 scales, and the sampler holds exactly those bytes (round trip bit for bit); q·s is the
  learner's fake-quantised weight bit for bit.
- The weight check hashes them: one flipped byte of an e4m3 weight, or of a scale, stops the sync.
- The bytes: measured from the payloads of a bf16 student, the FP8 sync moves exactly
  out·in + 4·out bytes per quantised Linear against 2·out·in (half, plus 2/in), and the whole
  payload of the benchmark's 0.40B student is 0.556 of bf16's.
- After an FP8 sync the sampler's logprobs equal the learner's fake-quantised forward (< 1e-6),
  and before the learner's fake quantisation turns on it sends, and the sampler holds, the
  full weights.
- The FP8 manifest of a broadcast group is the payload's, and a sharded learner broadcasts, exports
  and checks what the one-process one does, in either form (the group carrying both forms from a
  one-process learner: tests/unit/test_weight_broadcast.py).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp

import numpy as np
import pytest
import torch

from k3post.algo.fp8 import dequantize_rows
from k3post.config.schema import ModelSpec, OptimSpec, QatSpec, TinyModelSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.samplers.sampler import HFSampler
from k3post.engine.transport.weight_broadcast import WeightGroup, fp8_manifest, manifest_of, open_store
from k3post.engine.transport.weight_check import WeightSyncMismatch, checked_names, checksum
from k3post.launch.in_process import DirectWeightSync, LocalSamplers
from k3post.model.quant.fp8_sync import as_e4m3, fp8_payload, payload_bytes, scale_name
from k3post.model.training.weights import unique_state
from k3post.types import SamplingParams
from tests.spawned_rank import leave_without_teardown
from tests.unit.test_fp8_rollouts import PROMPTS, SPEC, learner_logprobs

BF16 = ModelSpec(tiny=TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, seed=4, init_std=0.05),
                 dtype="bfloat16")


def fp8_learner(spec: ModelSpec = SPEC, after: int = 0) -> Learner:
    lrn = Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-3, micro_batch_size=4), total_steps=10,
                                num_threads=2, qat=QatSpec(enabled=True, fake_quant_after_n_steps=after),
                                fp8_weights=True))
    with torch.no_grad():  # trained weights, not the initial ones the sampler also builds
        g = torch.Generator().manual_seed(7)
        for p in lrn.model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.dtype))
    return lrn


def as_bytes(value) -> torch.Tensor:
    return torch.as_tensor(value).contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def synced():
    lrn, sampler = fp8_learner(), HFSampler(SPEC, num_threads=2, fp8_from_version=0)
    return lrn, sampler, DirectWeightSync(lrn, LocalSamplers(sampler))


def test_the_sampler_holds_the_bytes_sent_and_they_are_the_learners_qat_weights_bit_for_bit(synced):
    lrn, sampler, sync = synced
    sync.push(1)
    sent, held = lrn.weights(), unique_state(sampler.model)
    assert len(lrn.qat_layers) == 14 and set(sent) == set(held)
    for layer in lrn.qat_layers:
        name = f"{layer}.weight"
        assert sent[name].dtype == np.uint8 and held[name].dtype == torch.uint8
        assert torch.equal(as_bytes(sent[name]), as_bytes(held[name]))
        assert torch.equal(as_bytes(sent[scale_name(name)]), as_bytes(held[scale_name(name)]))
        module = lrn.model.get_submodule(layer)
        with torch.no_grad():
            qat_weight = module.weight_fake_quantizer(module.weight)
        assert torch.equal(dequantize_rows(as_e4m3(held[name]), held[scale_name(name)], torch.float32), qat_weight)
    for name in set(sent) - {f"{layer}.{s}" for layer in lrn.qat_layers for s in ("weight", "weight_scale")}:
        assert torch.equal(as_bytes(sent[name]), as_bytes(held[name])), name


def flipping(sampler: HFSampler, name: str, monkeypatch) -> None:
    """The transport flips the lowest bit of `name`'s first byte on its way to the sampler."""
    load = HFSampler.load_weights

    def load_flipped(weights: dict, version: int) -> int:
        weights = dict(weights)
        flipped = as_bytes(weights[name]).clone()
        flipped.view(-1)[0] ^= 1
        weights[name] = flipped.view(torch.as_tensor(weights[name]).dtype)
        return load(sampler, weights, version)

    monkeypatch.setattr(sampler, "load_weights", load_flipped)


@pytest.mark.parametrize("target", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.o_proj.weight_scale"])
def test_one_flipped_byte_of_an_fp8_weight_or_a_scale_stops_the_sync(synced, target, monkeypatch):
    lrn, sampler, sync = synced
    names = list(lrn.weights())
    version = next(v for v in range(1, 100) if target in checked_names(names, v))
    flipping(sampler, target, monkeypatch)
    with pytest.raises(WeightSyncMismatch, match=rf"v{version}: sampler replica 0 does not hold the learner's "
                                                 rf"'{target}'"):
        sync.push(version)
    monkeypatch.undo()
    sync.push(version)  # the transport restored: the same sync passes


def test_the_checksum_hashes_e4m3_bytes_bit_for_bit():
    q = torch.randn(300, 70).to(torch.float8_e4m3fn)
    flipped = q.view(torch.uint8).clone()
    flipped[123, 45] ^= 0x80  # the sign bit: the same magnitude, another value
    a, b, c = checksum(q), checksum(q.view(torch.uint8)), checksum(flipped)
    assert (a.plain, a.weighted) == (b.plain, b.weighted) and a.dtype == "float8_e4m3fn"
    assert c.plain != b.plain and c.weighted != b.weighted


def test_an_fp8_sync_moves_half_of_bf16s_bytes_per_quantised_linear():
    lrn = fp8_learner(BF16)
    full, fp8 = lrn.full_weights(), lrn.weights()
    shapes = [tuple(full[f"{layer}.weight"].shape) for layer in lrn.qat_layers]
    elements, rows = sum(o * i for o, i in shapes), sum(o for o, _ in shapes)
    assert all(v.dtype == torch.bfloat16 for v in full.values())
    assert payload_bytes(fp8) == payload_bytes(full) - 2 * elements + elements + 4 * rows  # measured = closed form
    linears_fp8 = sum(payload_bytes({n: fp8[n]}) for n in fp8 if any(n.startswith(f"{la}.") for la in lrn.qat_layers))
    ratio = linears_fp8 / (2 * elements)
    assert 0.5 < ratio <= 0.5 + 2 / min(i for _, i in shapes)


def test_the_payload_of_the_benchmarks_04b_student_is_056_of_bf16s():
    """The 0.40B Qwen2 of bench/opd/opd_step_gpu.py, built on the meta device (bytes without data): its
    tied 49,152 × 896 embedding stays bf16, the 168 quantised Linears halve."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from k3post.model.quant.qat import fp8_eligible

    config = Qwen2Config(vocab_size=49152, tie_word_embeddings=True, hidden_size=896, num_hidden_layers=24,
                         intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    layers = [n for n, m in model.named_modules() if fp8_eligible(m, n)]
    full = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: sent once
    ratio = payload_bytes(fp8_payload(full, layers)) / payload_bytes(full)
    assert len(layers) == 168 and 0.556 < ratio < 0.557, ratio  # 447,266,560 / 803,876,608 bytes


def gap(lrn: Learner, sampler: HFSampler, version: int) -> float:
    sampler.load_weights(lrn.weights(), version)
    rollouts = sampler.sample(PROMPTS, SamplingParams(max_new_tokens=8, seed=version))
    mask = rollouts.loss_mask_BT.bool()
    return float((rollouts.sampler_logprobs_BT - learner_logprobs(lrn, rollouts))[mask].abs().max())


def holds_fp8(sampler: HFSampler) -> bool:
    from k3post.model.quant.fp8_linear import Fp8Linear

    forms = {m.holds_fp8 for m in sampler.model.modules() if isinstance(m, Fp8Linear)}
    assert len(forms) == 1
    return forms.pop()


def test_after_an_fp8_sync_the_samplers_logprobs_are_the_learners_qat_forward():
    """qat.fake_quant_after_n_steps = 2: the weights of step 1 go full (the learner's step 2 does
    not quantise), those of step 2 on in FP8; the sampler's logprobs are the learner's either way."""
    lrn, sampler = fp8_learner(after=2), HFSampler(SPEC, num_threads=2, fp8_from_version=2)
    lrn.steps_done = 1
    assert gap(lrn, sampler, 1) < 1e-6 and not holds_fp8(sampler)
    lrn.steps_done = 2
    assert gap(lrn, sampler, 2) < 1e-6 and holds_fp8(sampler)


LAYERS = ["a"]


def two_forms(seed: int) -> tuple[dict, dict]:
    """Full weights as learners export them (fp32 numpy and torch, bf16) and their FP8 payload."""
    g = torch.Generator().manual_seed(seed)
    full = {"a.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16), "a.bias": torch.randn(32, generator=g),
            "norm.weight": torch.randn(16, generator=g).numpy()}
    return full, fp8_payload(full, LAYERS)


def test_the_fp8_manifest_is_the_payloads():
    full, fp8 = two_forms(1)
    assert fp8_manifest(manifest_of(full), LAYERS) == manifest_of(fp8)
    assert [(i.name, i.dtype) for i in manifest_of(fp8)] == [("a.weight", "uint8"), ("a.weight_scale", "float32"),
                                                             ("a.bias", "float32"), ("norm.weight", "float32")]


def received_bytes(step: dict) -> dict:
    return {name: (str(t.dtype), as_bytes(t).numpy()) for name, t in step.items()}


def _receiver(queue, out) -> None:
    port, manifest, fp8 = queue.get(timeout=120)
    group = WeightGroup(open_store("127.0.0.1", port, 2, 1), 2, 1, "gloo", manifest, fp8)
    out.put([received_bytes(group.receive()) for _ in range(2)])
    group.close()
    leave_without_teardown(out)


def test_a_sharded_learner_sends_and_checks_what_the_one_process_learner_does():
    """One FSDP2 rank (gloo) with fake quantisation from step 1: at step 0 it broadcasts the full
    weights, at step 1 the FP8 payload; both, its object-store export and its checksums equal the
    one-process learner's, bit for bit."""
    from k3post.engine.sharded.rank import RankSpec, destroy_group
    from k3post.engine.sharded.sharded_learner import ShardedLearner
    from tests.unit.test_sharded_learner import ALWAYS, config, free_port

    cfg = dataclasses.replace(config(qat=True), fp8_weights=True, qat=QatSpec(enabled=True, fake_quant_after_n_steps=1))
    ctx = mp.get_context("spawn")
    queue, out = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_receiver, args=(queue, out))
    receiver.start()
    try:
        sharded, single = ShardedLearner(cfg, RankSpec(0, 1, "gloo", "127.0.0.1", free_port()), ALWAYS), Learner(cfg)
        queue.put((sharded.open_weight_store("127.0.0.1", 2), sharded.weight_manifest(), sharded.fp8_weight_manifest()))
        sharded.join_weight_group(2, "gloo")
        sent = []
        for step in (0, 1):
            sharded.steps_done = single.steps_done = step
            sharded.broadcast_weights()
            want = single.weights()
            sent.append(want)
            assert {n: as_bytes(v) for n, v in sharded.weights().items()}.keys() == want.keys()
            assert all(torch.equal(as_bytes(v), as_bytes(want[n])) for n, v in sharded.weights().items())
            for version in range(6):
                got, expected = sharded.weight_checksums(version), single.weight_checksums(version)
                assert got == expected and len(got) == 4
        received = out.get(timeout=120)
        sharded.leave_weight_group()
    finally:
        destroy_group()
        receiver.join(timeout=60)
    assert receiver.exitcode == 0
    assert any(n.endswith("weight_scale") for n in sent[1]) and not any(n.endswith("weight_scale") for n in sent[0])
    for want, got in zip(sent, received):
        assert list(got) == list(want)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name][1], as_bytes(value).numpy())
