"""The learner: micro-batch invariance, the zero-advantage fixed point, checkpoints, NaN guard."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from k3post.config.schema import OptimSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.samplers.sampler import HFSampler
from k3post.types import Prompt, SamplingParams, TrainBatch


def make_batch(spec, n=6, seed=0, advantages_scale=1.0) -> TrainBatch:
    sampler = HFSampler(spec, num_threads=2)
    prompts = [Prompt(f"u{i}", "s", "t", (("user", f"Question number {i}?" + "!" * i),)) for i in range(n)]
    r = sampler.sample(prompts, SamplingParams(max_new_tokens=6, seed=seed))
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(r.loss_mask_BT.shape, generator=g) * advantages_scale * r.loss_mask_BT
    return TrainBatch(r.prompt_ids, r.completion_ids_BT, r.loss_mask_BT, r.sampler_logprobs_BT, advantages)


def learner(spec, micro=4, lr=1e-3, **optim) -> Learner:
    return Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=lr, micro_batch_size=micro, **optim), total_steps=10,
                                 num_threads=2))


def params_of(lrn: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in lrn.model.named_parameters()}


def test_micro_batch_size_does_not_change_the_gradient(tiny_spec):
    """Global token normalisation: 6x1, 3x2 and 1x6 micro-batches accumulate the same gradient."""
    batch = make_batch(tiny_spec)
    grads, losses = [], []
    for micro in (1, 2, 6):
        lrn = learner(tiny_spec, micro=micro)
        losses.append(lrn.accumulate_gradients(batch)["train/loss"])
        grads.append({k: p.grad.clone() for k, p in lrn.model.named_parameters()})
    assert losses[0] == pytest.approx(losses[2], abs=1e-6) and losses[1] == pytest.approx(losses[2], abs=1e-6)
    assert any(g.abs().max() > 1e-4 for g in grads[2].values())
    for name, reference in grads[2].items():
        assert torch.allclose(grads[0][name], reference, atol=1e-6), name
        assert torch.allclose(grads[1][name], reference, atol=1e-6), name


def test_zero_advantages_leave_weights_unchanged(tiny_spec):
    """Student == teacher gives A = 0 everywhere: zero gradient, and AdamW moves nothing."""
    batch = make_batch(tiny_spec, advantages_scale=0.0)
    lrn = learner(tiny_spec)
    before = params_of(lrn)
    metrics = lrn.train_step(batch)
    assert metrics["train/grad_norm"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in params_of(lrn).items())
    # At equal weights the learner's logprobs are the sampler's: ratios are 1.
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["train/logprob_abs_diff"] < 1e-4


def test_positive_advantage_raises_the_tokens_probability(tiny_spec):
    batch = make_batch(tiny_spec, n=2)
    batch.advantages_BT = batch.loss_mask_BT.clone()  # reward every sampled token
    lrn = learner(tiny_spec, lr=1e-2)
    before = lrn.model
    from k3post.model.scoring.logprobs import completion_logprobs

    def mean_logprob():
        with torch.no_grad():
            lp = completion_logprobs(before, batch.prompt_ids, batch.completion_ids_BT, batch.loss_mask_BT,
                                     lrn.tokenizer.pad_token_id)
        return float((lp * batch.loss_mask_BT).sum() / batch.loss_mask_BT.sum())

    start = mean_logprob()
    for _ in range(3):
        lrn.train_step(batch)
    assert mean_logprob() > start + 0.05


def test_non_finite_gradient_skips_the_update(tiny_spec):
    batch = make_batch(tiny_spec)
    batch.advantages_BT[0, 0] = float("nan")
    lrn = learner(tiny_spec)
    before = params_of(lrn)
    metrics = lrn.train_step(batch)
    assert metrics["train/skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in params_of(lrn).items())


def test_checkpoint_round_trip_resumes_identically(tiny_spec, tmp_path):
    b1, b2 = make_batch(tiny_spec, seed=1), make_batch(tiny_spec, seed=2)
    straight = learner(tiny_spec)
    straight.train_step(b1)
    straight.save_checkpoint(str(tmp_path / "step-1"), {"step": 1, "data": {"pos": 3}})
    expected = straight.train_step(b2)

    resumed = learner(tiny_spec)
    state = resumed.load_checkpoint(str(tmp_path / "step-1"))
    assert state == {"step": 1, "data": {"pos": 3}}
    got = resumed.train_step(b2)
    # Exactly: the weights and AdamW's moments come back bit for bit (dcp/).
    assert (got["train/loss"], got["train/grad_norm"], got["train/lr"]) == (
        expected["train/loss"], expected["train/grad_norm"], expected["train/lr"])
    assert all(torch.equal(params_of(resumed)[k], v) for k, v in params_of(straight).items())
    # The checkpoint is a plain Hugging Face directory, plus the optimizer in DCP's layout
    # (a sharded learner resumes it: tests/unit/test_sharded_learner.py).
    assert (tmp_path / "step-1" / "dcp").is_dir()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "step-1")
    assert hf.config.num_hidden_layers == 2
    assert (tmp_path / "step-1" / "COMPLETE").is_file()
    assert json.loads((tmp_path / "step-1" / "run_state.json").read_text())["step"] == 1


def save_old_format(lrn: Learner, directory, run_state: dict) -> None:
    """A checkpoint as the learner wrote them before dcp/: HF weights, and the optimizer's own
    (index-keyed) state_dict in trainer_state.pt."""
    from k3post.track.atomic import mark_complete

    directory.mkdir(parents=True)
    lrn.model.save_pretrained(directory)
    lrn.tokenizer.save_pretrained(directory)
    torch.save({"optimizer": lrn.optimizer.state_dict(), "scheduler": lrn.scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(), "steps_done": lrn.steps_done}, directory / "trainer_state.pt")
    (directory / "run_state.json").write_text(json.dumps(run_state))
    mark_complete(directory)


def test_a_checkpoint_from_before_dcp_still_resumes_identically(tiny_spec, tmp_path):
    b1, b2 = make_batch(tiny_spec, seed=1), make_batch(tiny_spec, seed=2)
    straight = learner(tiny_spec)
    straight.train_step(b1)
    save_old_format(straight, tmp_path / "step-1", {"step": 1})
    expected = straight.train_step(b2)

    resumed = learner(tiny_spec)
    assert resumed.load_checkpoint(str(tmp_path / "step-1")) == {"step": 1}
    got = resumed.train_step(b2)
    assert (got["train/loss"], got["train/grad_norm"], got["train/lr"]) == (
        expected["train/loss"], expected["train/grad_norm"], expected["train/lr"])
    assert all(torch.equal(params_of(resumed)[k], v) for k, v in params_of(straight).items())
    assert resumed.steps_done == straight.steps_done == 2


def test_sync_makes_sampler_logprobs_equal_learner_logprobs(tiny_spec):
    batch = make_batch(tiny_spec)
    lrn = learner(tiny_spec, lr=1e-2)
    lrn.train_step(batch)
    sampler = HFSampler(tiny_spec)
    sampler.load_weights(lrn.weights(), version=1)
    p = [Prompt("x", "s", "t", (("user", "After the update?"),))]
    r = sampler.sample(p, SamplingParams(max_new_tokens=6, seed=4))
    from k3post.model.scoring.logprobs import completion_logprobs

    with torch.no_grad():
        lp = completion_logprobs(lrn.model, r.prompt_ids, r.completion_ids_BT, r.loss_mask_BT,
                                 lrn.tokenizer.pad_token_id)
    assert r.weight_version == 1
    assert torch.allclose(lp, r.sampler_logprobs_BT, atol=1e-4)


def test_gradient_buffers_are_freed_between_steps_unless_a_reference_lives_in_them(tiny_spec):
    """Without a grad-buffer reference the learner frees .grad after the step (the next backward
    writes instead of adding to zeros); a learner that keeps them, as the grad-buffer reference
    needs, reaches bit-identical weights over steps of two micro-batches."""
    from k3post.config.schema import ReferenceSpec  # noqa: PLC0415

    freed = learner(tiny_spec, micro=3)
    kept = Learner(LearnerConfig(student=tiny_spec, optim=OptimSpec(lr=1e-3, micro_batch_size=3), total_steps=10,
                                 num_threads=2, reference=ReferenceSpec(kind="grad_buffer", kl_coef=0.0)))
    assert kept.reference is not None and kept.reference.lives_in_grad_buffers
    for seed in range(3):
        batch = make_batch(tiny_spec, seed=seed)
        a, b = freed.train_step(batch), kept.train_step(batch)
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
    assert all(p.grad is None for p in freed.model.parameters())
    assert all(p.grad is not None for p in kept.model.parameters() if p.requires_grad)
    assert all(torch.equal(x, y) for x, y in zip(freed.model.parameters(), kept.model.parameters()))


def test_the_ratio_mean_of_exactly_equal_logprobs_is_exactly_one_whatever_the_micro_batches(tiny_spec):
    """Micro-batches of 1, 4 and 1 tokens: their float shares 1/6 + 4/6 + 1/6 add up to
    0.9999999999999999, so the mean must be taken from token counts (a bitwise run needs 1.0)."""
    assert 1 / 6 + 4 / 6 + 1 / 6 != 1.0
    lrn = learner(tiny_spec)
    sums = dict.fromkeys(("loss", "ref_kl", "ratio_mean", "logprob_abs_diff", "sampler_kl", "is_affected"), 0.0)
    maxima = {"ratio_max": 0.0, "logprob_abs_diff_max": 0.0}
    g = torch.Generator().manual_seed(0)
    for count in (1, 4, 1):
        mask = torch.zeros(1, 5)
        mask[0, :count] = 1.0
        logprobs = -torch.rand(1, 5, generator=g)
        mb = TrainBatch([[1, 2]], torch.ones(1, 5, dtype=torch.long), mask, logprobs.clone(), torch.zeros(1, 5))
        Learner._add_ratio_stats(sums, maxima, logprobs, mb)
    metrics = lrn._step_metrics(sums, maxima, 6.0, False)
    assert metrics["train/ratio_mean"] == 1.0 and metrics["train/ratio_max"] == 1.0
    assert metrics["train/logprob_abs_diff"] == 0.0 and metrics["train/sampler_kl"] == 0.0
