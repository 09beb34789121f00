"""Advantages and the PPO-clip loss against loops, hand values and exact enumeration
(k3post/algo/advantages.py, policy_loss.py)."""

from __future__ import annotations

import pytest
import torch

from k3post.algo.advantages import grpo_advantages, rloo_advantages, sequence_to_token
from k3post.algo.policy_loss import ppo_clip_loss

DT = torch.float64


# ---------------------------------------------------------------- advantages


def test_grpo_matches_a_loop_with_bessel_std():
    rewards_PG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4], [3.0, -1.0, 2.0, 0.5]], dtype=DT)
    expected = torch.empty_like(rewards_PG)
    for p in range(rewards_PG.shape[0]):
        group = rewards_PG[p]
        expected[p] = (group - group.mean()) / (torch.std(group, unbiased=True) + 1e-6)
    assert torch.allclose(grpo_advantages(rewards_PG), expected, atol=1e-12)
    # by hand, group 0: mean 0.5, Bessel std sqrt(1/3) → ±0.5·sqrt(3)
    assert grpo_advantages(rewards_PG)[0, 0].item() == pytest.approx(0.5 * 3**0.5, rel=1e-5)


def test_dr_grpo_is_mean_centred_only():
    rewards_PG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [5.0, 1.0, 0.0, 2.0]], dtype=DT)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [3.0, -1.0, -2.0, 0.0]], dtype=DT)
    assert torch.allclose(grpo_advantages(rewards_PG, normalize_std=False), expected)


def test_degenerate_groups_get_zero_advantage():
    single_P1 = torch.tensor([[3.0], [-1.0]], dtype=DT)
    assert torch.equal(grpo_advantages(single_P1), torch.zeros_like(single_P1))
    assert torch.equal(rloo_advantages(single_P1), torch.zeros_like(single_P1))
    same_PG = torch.full((2, 4), 0.7, dtype=DT)
    assert torch.equal(grpo_advantages(same_PG), torch.zeros_like(same_PG))
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(4))


def test_rloo_equals_the_leave_one_out_loop():
    torch.manual_seed(0)
    rewards_PG = torch.randn(3, 5, dtype=DT)
    expected = torch.empty_like(rewards_PG)
    for p in range(3):
        for i in range(5):
            others = [rewards_PG[p, j] for j in range(5) if j != i]
            expected[p, i] = rewards_PG[p, i] - sum(others) / len(others)
    assert torch.allclose(rloo_advantages(rewards_PG), expected, atol=1e-12)
    # hand value: [1, 0] → 1 − 0 = 1 and 0 − 1 = −1
    assert rloo_advantages(torch.tensor([[1.0, 0.0]])).tolist() == [[1.0, -1.0]]


def test_sequence_to_token_broadcasts_under_the_mask():
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert sequence_to_token(torch.tensor([2.0, -1.0]), mask_BT).tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


# ---------------------------------------------------------------- PPO clip


def ppo_at(ratio: float, advantage: float, eps_low=0.2, eps_high=0.2, dual_clip=None):
    """(loss, d loss / d log π_θ) for one token with ρ = ratio."""
    logprob = torch.tensor([[torch.log(torch.tensor(ratio, dtype=DT)).item()]], dtype=DT, requires_grad=True)
    old, adv = torch.zeros(1, 1, dtype=DT), torch.tensor([[advantage]], dtype=DT)
    loss = ppo_clip_loss(logprob, old, adv, eps_low, eps_high, dual_clip)
    loss.sum().backward()
    return loss.item(), logprob.grad.item()


# (ratio, advantage, loss, gradient) by hand with ε = 0.2:
#   ℓ = max(−ρA, −clip(ρ, 0.8, 1.2)A); the gradient is −ρA where the unclipped branch is the max, else 0.
PPO_HAND = [
    (0.5, +1.0, -0.5, -0.5),  # good token made less likely: unclipped (−0.5 > −0.8), keeps pulling up
    (1.0, +1.0, -1.0, -1.0),
    (1.5, +1.0, -1.2, 0.0),  # already pushed past 1+ε: clipped, no more push
    (0.5, -1.0, 0.8, 0.0),  # bad token already pushed below 1−ε: clipped
    (1.0, -1.0, 1.0, 1.0),
    (1.5, -1.0, 1.5, 1.5),  # bad token made more likely: unclipped (1.5 > 1.2), keeps pushing down
]


@pytest.mark.parametrize("ratio,advantage,loss,grad", PPO_HAND)
def test_ppo_clip_hand_values(ratio, advantage, loss, grad):
    got_loss, got_grad = ppo_at(ratio, advantage)
    assert got_loss == pytest.approx(loss, abs=1e-12)
    assert got_grad == pytest.approx(grad, abs=1e-12)


def test_ppo_asymmetric_clip_uses_eps_high_above_and_eps_low_below():
    assert ppo_at(1.25, +1.0, eps_low=0.2, eps_high=0.28)[0] == pytest.approx(-1.25)  # inside [0.8, 1.28]
    assert ppo_at(1.4, +1.0, eps_low=0.2, eps_high=0.28)[0] == pytest.approx(-1.28)
    assert ppo_at(0.5, -1.0, eps_low=0.1, eps_high=0.28)[0] == pytest.approx(0.9)


def test_dual_clip_caps_negative_advantages_only():
    assert ppo_at(5.0, -1.0, dual_clip=3.0) == pytest.approx((3.0, 0.0))  # capped at c·|A|, no gradient
    assert ppo_at(2.0, -1.0, dual_clip=3.0) == pytest.approx((2.0, 2.0))  # under the cap: unchanged
    assert ppo_at(5.0, -1.0) == pytest.approx((5.0, 5.0))  # without dual clip it grows with ρ
    assert ppo_at(5.0, +1.0, dual_clip=3.0) == pytest.approx((-1.2, 0.0))  # A > 0 untouched
    with pytest.raises(ValueError):
        ppo_at(1.0, 1.0, dual_clip=1.0)


def test_ppo_old_logprobs_and_advantages_get_no_gradient():
    old = torch.zeros(1, 2, dtype=DT, requires_grad=True)
    adv = torch.ones(1, 2, dtype=DT, requires_grad=True)
    new = torch.zeros(1, 2, dtype=DT, requires_grad=True)
    ppo_clip_loss(new, old, adv, 0.2, 0.2).sum().backward()
    assert old.grad is None and adv.grad is None and new.grad is not None
