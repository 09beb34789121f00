"""RL maths against loops, hand values and exact enumeration (k3post/algo/rl.py)."""

from __future__ import annotations

import pytest
import torch

from k3post.algo.rl import (
    aggregate,
    grpo_advantages,
    kl_penalty,
    ppo_clip_loss,
    rloo_advantages,
    sequence_to_token,
)

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


# ---------------------------------------------------------------- KL estimators


def toy():
    logits_V = torch.tensor([0.3, -1.2, 2.0, 0.1, -0.4], dtype=DT, requires_grad=True)
    ref_logprobs_V = torch.log_softmax(torch.tensor([1.0, 0.5, -0.3, 0.2, 0.0], dtype=DT), dim=-1)
    return logits_V, ref_logprobs_V


def exact_expectation(kind: str):
    """E_{y~π_θ}[k(y)] by enumerating the vocabulary; the sampling weights are held constant, so
    its gradient is the expected gradient of backpropagating k on a sampled token."""
    logits_V, ref_V = toy()
    logprobs_V = torch.log_softmax(logits_V, dim=-1)
    per_token_V = kl_penalty(logprobs_V.unsqueeze(0), ref_V.unsqueeze(0), kind).squeeze(0)
    expectation = (logprobs_V.exp().detach() * per_token_V).sum()
    (grad_V,) = torch.autograd.grad(expectation, logits_V)
    return expectation, grad_V


def exact_kl_and_grads():
    logits_V, ref_V = toy()
    logprobs_V = torch.log_softmax(logits_V, dim=-1)
    reverse = (logprobs_V.exp() * (logprobs_V - ref_V)).sum()  # KL(π_θ‖π_ref)
    forward = (ref_V.exp() * (ref_V - logprobs_V)).sum()  # KL(π_ref‖π_θ)
    (grad_reverse,) = torch.autograd.grad(reverse, logits_V, retain_graph=True)
    (grad_forward,) = torch.autograd.grad(forward, logits_V)
    return reverse.detach(), grad_reverse, grad_forward


def test_k1_and_k3_are_unbiased_and_k2_is_not():
    kl, _, _ = exact_kl_and_grads()
    assert exact_expectation("k1")[0].item() == pytest.approx(kl.item(), rel=1e-12)
    assert exact_expectation("k3")[0].item() == pytest.approx(kl.item(), rel=1e-12)
    assert abs(exact_expectation("k2")[0].item() - kl.item()) > 1e-2


def test_estimator_gradients_match_reference_2_2():
    _, grad_reverse, grad_forward = exact_kl_and_grads()
    assert torch.allclose(exact_expectation("k1")[1], torch.zeros(5, dtype=DT), atol=1e-12)  # E[∇k1] = 0
    assert torch.allclose(exact_expectation("k2")[1], grad_reverse, atol=1e-12)  # reverse KL
    assert torch.allclose(exact_expectation("k3")[1], grad_forward, atol=1e-12)  # forward KL
    assert not torch.allclose(grad_forward, grad_reverse, atol=1e-3)  # the distinction is real here


def test_k3_clamps_extreme_tokens_and_names_are_checked():
    logprobs = torch.tensor([[-0.1, -60.0, -0.5, -1.0]], dtype=DT)
    ref = torch.tensor([[-60.0, -0.1, -0.5, -2.0]], dtype=DT)
    k3 = kl_penalty(logprobs, ref, "k3")
    # d = ±59.9: −d is clamped to ∓20, then e^{−d} − 1 + d (19 or 4.9e8) is clamped to 10.
    assert k3[0, :2].tolist() == [10.0, 10.0]
    assert k3[0, 2].item() == 0.0  # d = 0
    assert k3[0, 3].item() == pytest.approx(torch.exp(torch.tensor(-1.0, dtype=DT)).item())  # d = 1: e^{−1} − 1 + 1
    assert kl_penalty(logprobs, ref, "k1")[0, 3].item() == pytest.approx(1.0)
    assert kl_penalty(logprobs, ref, "k2")[0, 3].item() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        kl_penalty(logprobs, ref, "k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_reference_is_a_constant(kind):
    logprobs = torch.tensor([[-1.0, -0.3]], dtype=DT, requires_grad=True)
    ref = torch.tensor([[-2.0, -0.1]], dtype=DT, requires_grad=True)
    kl_penalty(logprobs, ref, kind).sum().backward()
    assert ref.grad is None and logprobs.grad is not None


# ---------------------------------------------------------------- aggregation

LOSS_BT = torch.tensor(
    [[1.0, 2.0, 3.0, 0.0], [4.0, float("nan"), 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [5.0, 6.0, 7.0, 8.0]], dtype=DT
)
MASK_BT = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=DT)  # ragged, one empty row


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) / 8),
        ("seq-mean-token-sum", (6 + 4 + 26) / 3),  # the empty row is not a sequence
        ("seq-mean-token-mean", (2 + 4 + 6.5) / 3),
        ("seq-mean-token-sum-norm", (6 + 4 + 26) / (3 * 10)),
    ],
)
def test_aggregation_hand_values(mode, expected):
    assert aggregate(LOSS_BT, MASK_BT, mode, max_len=10).item() == pytest.approx(expected, abs=1e-12)


def test_aggregation_validation_and_empty_steps():
    with pytest.raises(ValueError):
        aggregate(LOSS_BT, MASK_BT, "seq-mean-token-sum-norm")  # max_len is required
    with pytest.raises(ValueError):
        aggregate(LOSS_BT, MASK_BT, "token-sum")
    with pytest.raises(ValueError):
        aggregate(LOSS_BT, MASK_BT, "token-mean", num_tokens=0)
    empty = torch.zeros(2, 3, dtype=DT)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert aggregate(torch.ones(2, 3, dtype=DT), empty, mode).item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_counts_sum_to_the_full_batch(mode):
    torch.manual_seed(1)
    lengths = [1, 5, 2, 6, 0, 3, 6, 4]
    loss_BT = torch.randn(8, 6, dtype=DT, requires_grad=True)
    mask_BT = (torch.arange(6).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).to(DT)
    full = aggregate(loss_BT, mask_BT, mode, max_len=6)
    (grad_full,) = torch.autograd.grad(full, loss_BT)
    num_tokens, num_seqs = float(mask_BT.sum()), float((mask_BT.sum(-1) > 0).sum())
    parts, start = [], 0
    for size in (1, 3, 2, 2):  # uneven micro-batches, each cut to its own padded width
        rows = slice(start, start + size)
        width = max(1, max(lengths[rows]))
        parts.append(aggregate(loss_BT[rows, :width], mask_BT[rows, :width], mode, num_tokens, num_seqs, max_len=6))
        start += size
    total = torch.stack(parts).sum()
    (grad_parts,) = torch.autograd.grad(total, loss_BT)
    assert total.item() == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(grad_parts, grad_full, atol=1e-12)


def test_local_counts_would_break_micro_batch_invariance():
    """The check above can fail: micro-batch means with local counts are not the full mean."""
    loss_BT, mask_BT = LOSS_BT.nan_to_num(), MASK_BT
    full = aggregate(loss_BT, mask_BT, "token-mean")
    naive = (aggregate(loss_BT[:1], mask_BT[:1], "token-mean") + aggregate(loss_BT[1:], mask_BT[1:], "token-mean")) / 2
    assert full.item() == pytest.approx(4.5) and naive.item() == pytest.approx((2 + 6) / 2)  # 3 vs 5 tokens
