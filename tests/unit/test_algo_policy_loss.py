"""The importance-sampled PG loss and the mismatch diagnostics, on hand-sized inputs."""

from __future__ import annotations

import math

import pytest
import torch

from k3post.algo.policy_loss import importance_ratio_stats, importance_sampled_pg_loss

DT = torch.float64


def test_loss_value_is_minus_ratio_times_advantage():
    student_BT = torch.tensor([[math.log(0.5), math.log(0.2)], [math.log(0.1), 0.0]], dtype=DT)
    sampler_BT = torch.tensor([[math.log(0.25), math.log(0.4)], [math.log(0.1), 0.0]], dtype=DT)
    advantages_BT = torch.tensor([[1.0, -2.0], [3.0, 0.0]], dtype=DT)
    # ratios: 0.5/0.25 = 2, 0.2/0.4 = 0.5, 1, 1
    expected_BT = torch.tensor([[-2.0, 1.0], [-3.0, 0.0]], dtype=DT)
    torch.testing.assert_close(importance_sampled_pg_loss(student_BT, sampler_BT, advantages_BT), expected_BT)


def test_gradient_at_old_policy_is_reinforce_gradient_and_constants_get_none():
    """At θ = θ_old, ∇ℓ_t = −A_t ∇log π_θ(y_t): compare with autograd of the REINFORCE surrogate."""
    torch.manual_seed(0)
    logits_BTV = torch.randn(2, 3, 4, dtype=DT, requires_grad=True)
    tokens_BT = torch.tensor([[0, 3, 1], [2, 2, 0]])

    def student_logprobs() -> torch.Tensor:
        return torch.log_softmax(logits_BTV, dim=-1).gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1)

    sampler_BT = student_logprobs().detach().requires_grad_(True)
    advantages_BT = torch.randn(2, 3, dtype=DT, requires_grad=True)
    loss = importance_sampled_pg_loss(student_logprobs(), sampler_BT, advantages_BT).sum()
    loss.backward()
    (reinforce_grad,) = torch.autograd.grad((-advantages_BT.detach() * student_logprobs()).sum(), logits_BTV)
    torch.testing.assert_close(logits_BTV.grad, reinforce_grad, atol=1e-12, rtol=0)
    assert reinforce_grad.abs().max() > 0.05
    assert sampler_BT.grad is None and advantages_BT.grad is None  # constants of the estimator


def test_gradient_off_policy_is_ratio_weighted():
    """d ℓ / d log π_θ(y) = −ρ A: the ratio reweights stale samples toward the current policy."""
    student_BT = torch.tensor([[math.log(0.3), math.log(0.6)]], dtype=DT, requires_grad=True)
    sampler_BT = torch.tensor([[math.log(0.1), math.log(0.9)]], dtype=DT)
    advantages_BT = torch.tensor([[2.0, -1.0]], dtype=DT)
    importance_sampled_pg_loss(student_BT, sampler_BT, advantages_BT).sum().backward()
    torch.testing.assert_close(student_BT.grad, torch.tensor([[-3.0 * 2.0, (0.6 / 0.9) * 1.0]], dtype=DT))


def test_importance_ratio_stats_hand_computed():
    student_BT = torch.tensor([[math.log(0.5), math.log(0.2), 0.0], [math.log(0.3), -1.0, -2.0]])
    sampler_BT = torch.tensor([[math.log(0.25), math.log(0.4), -5.0], [math.log(0.3), -9.0, -9.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # Masked-in ratios 2, 0.5, 1; the pads (ratios e^5, e^8, e^7) must be ignored.
    stats = importance_ratio_stats(student_BT, sampler_BT, mask_BT)
    assert set(stats) == {"ratio_mean", "ratio_max", "logprob_abs_diff", "logprob_abs_diff_max"}
    assert stats["ratio_mean"] == pytest.approx((2 + 0.5 + 1) / 3, rel=1e-6)
    assert stats["ratio_max"] == pytest.approx(2.0, rel=1e-6)
    assert stats["logprob_abs_diff"] == pytest.approx((math.log(2) + math.log(2) + 0) / 3, rel=1e-6)
    assert stats["logprob_abs_diff_max"] == pytest.approx(math.log(2), rel=1e-6)  # not the pads' 5, 8, 7
    assert all(isinstance(value, float) for value in stats.values())


def test_importance_ratio_stats_exact_match_and_empty_mask():
    logprobs_BT = -torch.rand(3, 4)
    stats = importance_ratio_stats(logprobs_BT, logprobs_BT.clone(), torch.ones(3, 4))
    assert stats == {"ratio_mean": 1.0, "ratio_max": 1.0, "logprob_abs_diff": 0.0, "logprob_abs_diff_max": 0.0}
    empty = importance_ratio_stats(logprobs_BT, logprobs_BT - 1, torch.zeros(3, 4))
    assert empty == {"ratio_mean": 0.0, "ratio_max": 0.0, "logprob_abs_diff": 0.0, "logprob_abs_diff_max": 0.0}
