"""The reference model held in the gradient buffers, against a separately loaded copy."""

from __future__ import annotations

import pytest
import torch

from k3post.config.schema import LoraSpec, ModelSpec, OptimSpec, QatSpec, ReferenceSpec, TinyModelSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.sharded.sharded_reference import swap_through
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import completion_logprobs
from k3post.model.training.grad_buffer import GradBufferReference
from k3post.types import TrainBatch
from tests.unit.test_learner import make_batch


def learner(spec, kind: str, kl_coef: float = 0.1, lora: int = 0, estimator: str = "k3", lr: float = 1e-2) -> Learner:
    reference = ReferenceSpec(kind=kind, kl_coef=kl_coef, estimator=estimator)
    return Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=lr, micro_batch_size=2), reference=reference,
                                 total_steps=100, num_threads=2, lora=LoraSpec(rank=lora)))


def test_buffer_reference_equals_a_separate_copy_exactly_after_training(tiny_spec):
    trick, copy = learner(tiny_spec, "grad_buffer"), learner(tiny_spec, "copy")
    batches = [make_batch(tiny_spec, seed=s) for s in range(3)]
    for batch in batches[:2]:
        m_trick, m_copy = trick.train_step(batch), copy.train_step(batch)
        assert m_trick["train/loss"] == m_copy["train/loss"]
        assert m_trick["train/grad_norm"] == m_copy["train/grad_norm"]
    mbs = batches[2].micro_batches(2)
    pad = trick.tokenizer.pad_token_id
    ref_trick = trick.reference.logprobs(mbs, pad, 1.0)
    ref_copy = copy.reference.logprobs(mbs, pad, 1.0)
    for a, b in zip(ref_trick, ref_copy):
        assert torch.equal(a, b)  # bit-identical: the same weights, the same kernels
    # ... and the reference is the *initial* model, not the trained one.
    initial = load_model(tiny_spec)[0]
    mb = mbs[0]
    with torch.no_grad():
        fresh = completion_logprobs(initial, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad)
        now = completion_logprobs(trick.model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad)
    assert torch.equal(ref_trick[0], fresh) and not torch.allclose(now, fresh, atol=1e-4)
    for (name, p), q in zip(trick.model.named_parameters(), copy.model.parameters()):
        assert torch.equal(p, q), name  # identical optimizer trajectories
        assert p.grad is not None  # the buffers are never freed


def test_swap_leaves_parameters_untouched_even_when_the_forward_raises(tiny_model):
    model, _ = tiny_model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = GradBufferReference(model, {n: p.detach() + 1.0 for n, p in model.named_parameters()})
    with pytest.raises(RuntimeError, match="boom"):
        with ref.reference_weights() as weights:
            assert torch.equal(weights["model.norm.weight"], before["model.norm.weight"] + 1.0)
            raise RuntimeError("boom")
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert torch.count_nonzero(p.grad) == 0, name  # zeroed, ready for backward


def test_freed_buffers_are_reported_not_silently_used(tiny_model):
    model, _ = tiny_model
    ref = GradBufferReference(model)
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="set_to_none=False"):
        with ref.reference_weights():
            pass


def test_frozen_parameters_are_their_own_reference(tiny_spec):
    lrn = learner(tiny_spec, "grad_buffer")
    lrn.model.model.norm.weight.requires_grad_(False)
    lrn.reference = type(lrn.reference)(lrn.model)
    with lrn.reference.buffers.reference_weights() as weights:
        assert weights["model.norm.weight"] is lrn.model.model.norm.weight


def test_lora_reference_is_the_base_model(tiny_spec):
    lrn = learner(tiny_spec, "none", kl_coef=0.5, lora=4)
    batch = make_batch(tiny_spec)
    for _ in range(3):
        lrn.train_step(batch)
    mbs = batch.micro_batches(2)
    pad = lrn.tokenizer.pad_token_id
    base = load_model(tiny_spec)[0]
    with torch.no_grad():
        expected = [completion_logprobs(base, m.prompt_ids, m.completion_ids_BT, m.loss_mask_BT, pad) for m in mbs]
        trained = completion_logprobs(lrn.model, mbs[0].prompt_ids, mbs[0].completion_ids_BT,
                                      mbs[0].loss_mask_BT, pad)
    for got, want in zip(lrn.reference.logprobs(mbs, pad, 1.0), expected):
        assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(trained, expected[0], atol=1e-4)  # the adapters did learn something
    # The samplers get plain base-model names with the adapters merged in.
    weights = lrn.weights()
    assert not any("lora_" in k or "base_layer" in k for k in weights)
    sampler_model = load_model(tiny_spec)[0]
    from k3post.model.training.weights import import_weights

    import_weights(sampler_model, weights)
    with torch.no_grad():
        synced = completion_logprobs(sampler_model, mbs[0].prompt_ids, mbs[0].completion_ids_BT,
                                     mbs[0].loss_mask_BT, pad)
    assert torch.allclose(synced, trained, atol=1e-5)


def test_reference_kl_term_pulls_the_student_back(tiny_spec):
    """Same random advantages; a strong k2 term keeps the student's logprobs near the reference's."""
    free = learner(tiny_spec, "grad_buffer", kl_coef=0.0, lr=1e-3)
    held = learner(tiny_spec, "grad_buffer", kl_coef=50.0, estimator="k2", lr=1e-3)
    batch = make_batch(tiny_spec, advantages_scale=3.0)
    for _ in range(8):
        free.train_step(batch)
        held.train_step(batch)

    def drift(lrn: Learner) -> float:
        pad = lrn.tokenizer.pad_token_id
        ref = torch.cat([r.flatten() for r in lrn.reference.logprobs(batch.micro_batches(6), pad, 1.0)])
        with torch.no_grad():
            now = completion_logprobs(lrn.model, batch.prompt_ids, batch.completion_ids_BT, batch.loss_mask_BT, pad)
        return float(((now.flatten() - ref).abs() * batch.loss_mask_BT.flatten()).sum() / batch.loss_mask_BT.sum())

    assert drift(held) < 0.3 * drift(free)  # measured 0.04 vs 0.36


def test_lora_weights_export_in_bfloat16(tiny_spec):
    """numpy has no bfloat16: a bf16 LoRA learner (the GPU case) exports merged host tensors,
    which a bf16 sampler model loads to the learner's own logprobs."""
    spec = tiny_spec.model_copy(update={"dtype": "bfloat16"})
    lrn = learner(spec, "none", kl_coef=0.0, lora=4, lr=1e-2)
    batch = make_batch(spec)
    lrn.train_step(batch)
    weights = lrn.weights()
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 and v.device.type == "cpu"
               for v in weights.values())
    from k3post.model.training.weights import import_weights

    sampler_model = load_model(spec)[0]
    import_weights(sampler_model, weights)
    mb = batch.micro_batches(2)[0]
    pad = lrn.tokenizer.pad_token_id
    with torch.no_grad():
        synced = completion_logprobs(sampler_model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad)
        trained = completion_logprobs(lrn.model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad)
        initial = completion_logprobs(load_model(spec)[0], mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad)
    assert torch.allclose(synced, trained, atol=0.05)  # bf16 merge rounding
    assert not torch.allclose(synced, initial, atol=1e-3)  # the sync carried the training


@pytest.mark.parametrize("scratch_size", [1, 7, 13 * 5, 1000])
def test_swap_through_a_small_scratch_exchanges_every_element(scratch_size):
    """Pieces of the scratch's size with a short last one (7 into 65), one piece (65), more room
    than needed (1000): either way each tensor ends as exactly the other one was."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(13, 5, generator=g), torch.randn(13, 5, generator=g)
    a0, b0 = a.clone(), b.clone()
    swap_through(a, b, torch.full((scratch_size,), float("nan")))
    assert torch.equal(a, b0) and torch.equal(b, a0)


def save_dropout_model(directory, attention_dropout: float = 0.5) -> ModelSpec:
    """A tiny Llama whose attention drops half its probabilities in train mode, as a model directory."""
    from k3post.model.loading.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(TinyModelSpec(hidden_size=32, num_layers=2, seed=3), tokenizer)
    model.config.attention_dropout = attention_dropout
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return ModelSpec(path=str(directory))


def record_modes(model) -> list[bool]:
    """The `training` flag of the first attention module at each of its forwards, in order."""
    seen: list[bool] = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda module, _: seen.append(module.training))
    return seen


@pytest.mark.parametrize("kind,lora", [("grad_buffer", 0), ("copy", 0), ("none", 4)])
def test_the_reference_runs_in_eval_mode_and_the_policy_in_train_mode(tmp_path, kind, lora):
    """With attention dropout 0.5 a train-mode reference would be a random draw: two reference
    passes give identical logprobs, equal to an eval-mode forward of the initial model, and the
    policy forward of the step still runs in train mode (dropout on)."""
    spec = save_dropout_model(tmp_path / "dropout")
    lrn = learner(spec, kind, kl_coef=0.5, lora=lora)
    batch = make_batch(spec, n=4)
    seen = record_modes(lrn.model)
    lrn.train_step(batch)  # the policy moves away from the reference
    # grad_buffer / LoRA: the reference runs these same modules, first (2 micro-batches), then the policy.
    assert seen == ([False, False] if kind != "copy" else []) + [True, True]
    mbs, pad = batch.micro_batches(2), lrn.tokenizer.pad_token_id
    lrn.model.train()  # as the step leaves it for the reference pass
    first, second = lrn.reference.logprobs(mbs, pad, 1.0), lrn.reference.logprobs(mbs, pad, 1.0)
    assert all(m.training for m in lrn.model.modules())  # the mode it had, restored
    initial = load_model(spec)[0]  # eval mode
    with torch.no_grad():
        expected = [completion_logprobs(initial, m.prompt_ids, m.completion_ids_BT, m.loss_mask_BT, pad) for m in mbs]
    for a, b, want in zip(first, second, expected):
        assert torch.equal(a, b)
        assert torch.allclose(a, want, atol=1e-6, rtol=0)
    with torch.no_grad():  # ... and train mode is stochastic here: the test can tell the two apart
        drawn = completion_logprobs(initial.train(), mbs[0].prompt_ids, mbs[0].completion_ids_BT,
                                    mbs[0].loss_mask_BT, pad)
    assert not torch.allclose(drawn, expected[0], atol=1e-3)


def qat_learner(spec, kind: str, after: int = 0) -> Learner:
    return Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-2, micro_batch_size=2),
                                 reference=ReferenceSpec(kind=kind, kl_coef=0.1), total_steps=100, num_threads=2,
                                 qat=QatSpec(enabled=True, fake_quant_after_n_steps=after)))


def max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("after", [0, 1])
def test_under_qat_the_copy_and_the_grad_buffer_are_one_reference(tiny_spec, after):
    """Under FP8 QAT the reference is the model the learner trains, fake-quantised, at the
    reference weights, whichever kind holds them: the copy is prepared like the learner and
    follows its fake-quant switch (`after`: off for the first step). The kinds' reference logprobs,
    losses and train/ref_kl agree; at step 1 (equal weights) the reference KL is 0 and the
    reference is the learner's own fake-quantised forward, which a plain model is not."""
    trick, copy = qat_learner(tiny_spec, "grad_buffer", after), qat_learner(tiny_spec, "copy", after)
    batches = [make_batch(tiny_spec, seed=s) for s in range(3)]
    for step, batch in enumerate(batches[:2]):
        m_trick, m_copy = trick.train_step(batch), copy.train_step(batch)
        assert m_trick["train/fake_quant"] == m_copy["train/fake_quant"] == float(step >= after)
        for key in ("train/loss", "train/ref_kl", "train/grad_norm"):
            assert m_trick[key] == pytest.approx(m_copy[key], abs=1e-7, rel=1e-6), (step, key)
        if step == 0:
            assert m_trick["train/ref_kl"] == m_copy["train/ref_kl"] == 0.0
    mbs, pad = batches[2].micro_batches(2), trick.tokenizer.pad_token_id
    trick._update_fake_quant(), copy._update_fake_quant()  # as a step does first
    ref_trick, ref_copy = trick.reference.logprobs(mbs, pad, 1.0), copy.reference.logprobs(mbs, pad, 1.0)
    assert max_gap(ref_trick, ref_copy) <= 1e-6
    plain = load_model(tiny_spec)[0]  # the initial weights without fake quantisation
    with torch.no_grad():
        unquantised = [completion_logprobs(plain, m.prompt_ids, m.completion_ids_BT, m.loss_mask_BT, pad) for m in mbs]
    assert max_gap(ref_copy, unquantised) > 1e-4  # the quantisation is visible at this size


def group_batch(spec, n: int = 4, T: int = 6) -> TrainBatch:
    """Two chat prompts of different lengths, n completions each (a group per prompt, as
    `sampling.n` makes them), completions of varied lengths."""
    from k3post.model.generation.sampling import render_prompts
    from k3post.types import Prompt

    model, tokenizer = load_model(spec)
    chats = [Prompt("a", "s", "t", (("user", "Name a colour."),)), Prompt("b", "s", "t", (("user", "Why?"),))]
    prompt_ids = [ids for ids in render_prompts(tokenizer, chats) for _ in range(n)]
    g = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(5, model.config.vocab_size, (len(prompt_ids), T), generator=g)
    mask_BT = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (len(prompt_ids),), generator=g)[:, None]).float()
    zeros = torch.zeros_like(mask_BT)
    return TrainBatch(prompt_ids, ids_BT * mask_BT.long(), mask_BT, zeros, zeros)


def embedded(model) -> list[torch.Tensor]:
    """The input ids of every forward through `model`'s token embedding, in order (the module
    found by name: under FSDP the root is a wrapper without `get_input_embeddings`)."""
    calls: list[torch.Tensor] = []
    embedding = next(m for name, m in model.named_modules() if name.endswith("embed_tokens"))
    embedding.register_forward_pre_hook(lambda _, args: calls.append(args[0].detach().clone()))
    return calls


def encoded_once(calls: list[torch.Tensor], batch: TrainBatch, pad: int) -> list[str]:
    """What is wrong with `calls` for a grouped reference pass over `batch` (empty when nothing):
    one forward of the distinct prompts, one row each, right-padded, then one of the completions
    alone (every row's tokens 0..T-2, no prompt token again)."""
    distinct = list(dict.fromkeys(tuple(p) for p in batch.prompt_ids))
    if len(calls) != 2:
        return [f"{len(calls)} forwards, not 2"]
    prompts_UL, completions = calls
    wrong = []
    if prompts_UL.shape[0] != len(distinct):
        wrong.append(f"{prompts_UL.shape[0]} prompt rows for {len(distinct)} distinct prompts")
    for row, p in zip(prompts_UL.tolist(), distinct):
        if tuple(row[:len(p)]) != p or any(t != pad for t in row[len(p):]):
            wrong.append(f"prompt row {row} is not {list(p)} then pads")
    if not torch.equal(completions, batch.completion_ids_BT[:, :-1]):
        wrong.append("the second forward is not the completions alone")
    return wrong


@pytest.mark.parametrize("kind,lora", [("grad_buffer", 0), ("copy", 0), ("none", 4)])
def test_the_reference_encodes_each_groups_prompt_once_and_equals_the_ungrouped_forward(tiny_spec, kind, lora):
    """n = 4 samples of each of two prompts in one micro-batch: the reference (grad-buffer, copy,
    LoRA base) runs the token embedding over each distinct prompt once (2 rows, not 8: a quarter
    of the prompt tokens) and then over the completions alone, and its logprobs equal the initial
    model's ungrouped forward (`completion_logprobs`, every row whole) within 1e-5."""
    lrn = learner(tiny_spec, kind, kl_coef=0.1, lora=lora)
    batch, pad = group_batch(tiny_spec), lrn.tokenizer.pad_token_id
    calls = embedded(lrn.reference.model if kind == "copy" else lrn.model)  # the copy is a model of its own
    got = lrn.reference.logprobs([batch], pad, 1.0)[0]
    assert encoded_once(calls, batch, pad) == []
    with torch.no_grad():
        want = completion_logprobs(load_model(tiny_spec)[0], batch.prompt_ids, batch.completion_ids_BT,
                                   batch.loss_mask_BT, pad)
    assert float((got - want).abs().max()) <= 1e-5
