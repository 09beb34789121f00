"""The learner's `rl` objective: PPO-clip / IS against the sampler's logprobs, checked by hand."""

from __future__ import annotations

import pytest
import torch

from k3post.algo.objectives import RlPolicyLoss
from k3post.config.schema import OptimSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.types import TrainBatch
from tests.unit.test_learner import make_batch


def rl_learner(spec, micro=4, **rl) -> Learner:
    return Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-3, micro_batch_size=micro),
                                 objective=RlPolicyLoss(**rl), total_steps=10, num_threads=2))


def grads(lrn: Learner, batch: TrainBatch) -> tuple[float, dict[str, torch.Tensor]]:
    loss = lrn.accumulate_gradients(batch)["train/loss"]
    return loss, {k: p.grad.clone() for k, p in lrn.model.named_parameters()}


def test_on_policy_ppo_clip_and_is_give_the_policy_gradient_of_the_token_mean(tiny_spec):
    """At θ = θ_old (ratio 1, inside any clip range) both losses equal −Σ m A / N and their
    gradient is −Σ m A ∇log π / N, whatever the micro-batch split."""
    batch = make_batch(tiny_spec)
    mask = batch.loss_mask_BT
    want_loss = float(-(batch.advantages_BT * mask).sum() / mask.sum())
    loss_ppo, g_ppo = grads(rl_learner(tiny_spec, micro=1, kind="ppo_clip"), batch)
    loss_is, g_is = grads(rl_learner(tiny_spec, micro=6, kind="is"), batch)
    assert loss_ppo == pytest.approx(want_loss, abs=1e-5) and loss_is == pytest.approx(want_loss, abs=1e-5)
    assert any(g.abs().max() > 1e-4 for g in g_is.values())
    for name, reference in g_is.items():
        assert torch.allclose(g_ppo[name], reference, atol=1e-6), name


def test_the_clip_stops_tokens_that_moved_past_the_trust_region(tiny_spec):
    """Sampler logprobs 1 nat below the learner's (ratio e ≈ 2.7 > 1 + ε) with A > 0: PPO-clip's
    clipped branch is a constant, so no gradient; IS still pulls, with loss −e·A."""
    batch = make_batch(tiny_spec)
    positive = batch.advantages_BT.abs()
    stale = TrainBatch(batch.prompt_ids, batch.completion_ids_BT, batch.loss_mask_BT,
                       (batch.sampler_logprobs_BT - 1.0) * batch.loss_mask_BT, positive)
    mask = batch.loss_mask_BT
    _, g_ppo = grads(rl_learner(tiny_spec, kind="ppo_clip", clip_low=0.2, clip_high=0.28), stale)
    assert all(g.abs().max() < 1e-7 for g in g_ppo.values())
    loss_is, g_is = grads(rl_learner(tiny_spec, kind="is"), stale)
    assert loss_is == pytest.approx(float(-torch.e * (positive * mask).sum() / mask.sum()), rel=1e-4)
    assert any(g.abs().max() > 1e-4 for g in g_is.values())
