"""From rewards to a training batch (k3post/algo/advantages.py, policy_loss.py): flat group layout, sequence weights,
the policy-loss table and OPD mixed with rewards — against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from k3post.algo.advantages import group_advantages, mix_reward_advantages, sequence_mean_weights, token_advantages
from k3post.algo.aggregate import token_sum_normalized
from k3post.algo.policy_loss import policy_loss

DT = torch.float64


def sequence_mean_by_loop(loss_BT, mask_BT) -> float:
    """Σ_b (Σ_t m ℓ / n_b) / S over the rows with tokens, written as the plain loop it means."""
    means = [float((loss_BT[b] * mask_BT[b]).sum() / mask_BT[b].sum()) for b in range(len(mask_BT))
             if mask_BT[b].sum() > 0]
    return sum(means) / len(means)


def test_group_advantages_by_hand_on_a_flat_batch():
    # Two prompts, G = 3, rows of a group consecutive: [1, 0, 0 | 2, 2, 5].
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0], dtype=DT)
    # group 1: mean 1/3, Bessel std sqrt(((2/3)² + 2·(1/3)²)/2) = sqrt(1/3)
    # group 2: mean 3,   Bessel std sqrt((1 + 1 + 4)/2) = sqrt(3)
    s1, s2 = math.sqrt(1 / 3), math.sqrt(3)
    grpo = [(2 / 3) / s1, (-1 / 3) / s1, (-1 / 3) / s1, -1 / s2, -1 / s2, 2 / s2]
    assert group_advantages(rewards_B, 3, "grpo").tolist() == pytest.approx(grpo, rel=1e-5)
    dr = [2 / 3, -1 / 3, -1 / 3, -1.0, -1.0, 2.0]
    assert group_advantages(rewards_B, 3, "dr_grpo").tolist() == pytest.approx(dr, abs=1e-12)
    # RLOO: R_i − mean of the other two: 1 − 0, 0 − 0.5, 0 − 0.5 | 2 − 3.5, 2 − 3.5, 5 − 2
    assert group_advantages(rewards_B, 3, "rloo").tolist() == pytest.approx([1, -0.5, -0.5, -1.5, -1.5, 3], abs=1e-12)


def test_group_advantages_rejects_ragged_groups_and_unknown_estimators():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4, "grpo")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(torch.zeros(4), 2, "ppo")


def test_a_group_with_equal_rewards_gets_no_advantage():
    assert group_advantages(torch.tensor([1.0, 1.0, 0.3, 0.9]), 2, "grpo")[:2].tolist() == [0.0, 0.0]


def test_sequence_mean_weights_by_hand():
    mask_BT = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=DT)
    # n = [4, 1, 0, 2], N = 7, S = 3: w = 7 / (3 n); the empty row weighs 0.
    assert sequence_mean_weights(mask_BT).tolist() == pytest.approx([7 / 12, 7 / 3, 0.0, 7 / 6])
    assert sequence_mean_weights(torch.zeros(2, 3)).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("kind", ["ppo_clip", "is"])
def test_sequence_aggregation_through_weighted_advantages_is_the_sequence_mean(kind):
    """token-mean of ℓ(w·A) == seq-mean-token-mean of ℓ(A), for both losses (positive homogeneity),
    with ratios inside and outside the clip range and a dual clip."""
    torch.manual_seed(0)
    mask_BT = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=DT)
    old_BT = torch.randn(4, 5, dtype=DT) * 0.3 - 1.0
    student_BT = old_BT + torch.randn(4, 5, dtype=DT) * 0.5  # ratios well outside [0.8, 1.2] too
    advantages_B = torch.tensor([1.5, -0.7, 0.4, -2.0], dtype=DT)
    plain_BT = policy_loss(kind, student_BT, old_BT, token_advantages(advantages_B, mask_BT, "token"), 0.2, 0.28, 3.0)
    want = sequence_mean_by_loop(plain_BT, mask_BT)
    weighted_BT = policy_loss(kind, student_BT, old_BT, token_advantages(advantages_B, mask_BT, "sequence"),
                              0.2, 0.28, 3.0)
    got = token_sum_normalized(weighted_BT, mask_BT, float(mask_BT.sum()))
    assert float(got) == pytest.approx(want, rel=1e-12)
    # and it really differs from the token mean here (ragged lengths)
    assert float(token_sum_normalized(plain_BT, mask_BT, float(mask_BT.sum()))) != pytest.approx(want, rel=1e-3)


def test_policy_loss_table_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=DT))
    new = torch.log(torch.tensor([[0.75, 0.25]], dtype=DT))  # ratios 1.5 and 0.5
    adv = torch.tensor([[1.0, 1.0]], dtype=DT)
    assert policy_loss("is", new, old, adv)[0].tolist() == pytest.approx([-1.5, -0.5])
    # ppo_clip, ε = 0.2: token 1 clipped at 1.2 (A > 0); token 2 keeps the unclipped −0.5 (pessimistic max)
    assert policy_loss("ppo_clip", new, old, adv, 0.2, 0.2)[0].tolist() == pytest.approx([-1.2, -0.5])
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss("grpo", new, old, adv)


def test_mix_reward_advantages_by_hand():
    opd_BT = torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.0]], dtype=DT)
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=DT)
    mixed = mix_reward_advantages(opd_BT, torch.tensor([1.0, -1.0], dtype=DT), mask_BT, coef=0.5)
    assert mixed.flatten().tolist() == pytest.approx([0.6, 0.3, 0.0, -0.2, 0.0, 0.0])
    assert torch.equal(mix_reward_advantages(opd_BT, torch.tensor([1.0, -1.0], dtype=DT), mask_BT, 0.0), opd_BT)


def test_token_advantages_modes():
    mask_BT = torch.tensor([[1, 1], [1, 0]], dtype=DT)
    assert token_advantages(torch.tensor([2.0, -1.0], dtype=DT), mask_BT, "token").tolist() == [[2, 2], [-1, 0]]
    # N = 3, S = 2: w = [3/4, 3/2]
    sequence_BT = token_advantages(torch.tensor([2.0, -1.0], dtype=DT), mask_BT, "sequence")
    assert sequence_BT.flatten().tolist() == pytest.approx([1.5, 1.5, -1.5, 0])
    with pytest.raises(ValueError, match="aggregation"):
        token_advantages(torch.zeros(2), mask_BT, "batch")
