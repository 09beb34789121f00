"""Masked reductions, and micro-batch invariance of global-token normalisation."""

from __future__ import annotations

import pytest
import torch

from k3post.algo.aggregate import masked_mean, masked_sum, token_sum_normalized
from k3post.algo.policy_loss import importance_sampled_pg_loss

DT = torch.float64
LENGTHS = [1, 2, 1, 3, 6, 5, 6, 4]  # ragged: micro-batches of 2 or 4 rows hold different token counts
B, T, D, V = 8, 6, 3, 7


def test_masked_sum_and_mean_match_loops_and_ignore_nonfinite_pads():
    torch.manual_seed(0)
    x_BT = torch.randn(3, 4, dtype=DT)
    mask_BT = torch.tensor([[1.0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=DT)
    picked = [x_BT[b, t].item() for b in range(3) for t in range(4) if mask_BT[b, t] == 1]
    x_BT[0, 3], x_BT[1, 2] = float("nan"), float("inf")  # pads holding garbage
    assert masked_sum(x_BT, mask_BT).item() == pytest.approx(sum(picked), abs=1e-12)
    assert masked_mean(x_BT, mask_BT).item() == pytest.approx(sum(picked) / len(picked), abs=1e-12)


def test_masked_mean_of_empty_mask_is_zero_with_finite_gradient():
    x_BT = torch.randn(2, 3, dtype=DT, requires_grad=True)
    mean = masked_mean(x_BT, torch.zeros(2, 3, dtype=DT))
    mean.backward()
    assert mean.item() == 0.0 and torch.equal(x_BT.grad, torch.zeros(2, 3, dtype=DT))


def test_token_sum_normalized_value_and_validation():
    loss_BT = torch.tensor([[1.0, 2.0, 5.0], [3.0, 7.0, 11.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert token_sum_normalized(loss_BT, mask_BT, num_tokens=4.0).item() == pytest.approx((1 + 2 + 3) / 4)
    with pytest.raises(ValueError):
        token_sum_normalized(loss_BT, mask_BT, num_tokens=0.0)


def make_problem():
    """A linear softmax policy shared by all rows, sampled tokens, a mismatched sampler, ragged masks."""
    g = torch.Generator().manual_seed(0)
    features_BTD = torch.randn(B, T, D, generator=g, dtype=DT)
    weight_DV = torch.randn(D, V, generator=g, dtype=DT, requires_grad=True)
    mask_BT = (torch.arange(T).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)).to(DT)
    with torch.no_grad():
        probs_BTV = torch.softmax(features_BTD @ weight_DV, dim=-1)
    tokens_BT = torch.multinomial(probs_BTV.view(-1, V), 1, generator=g).view(B, T)
    sampler_BT = (probs_BTV.log().gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1) - 0.1 * torch.rand(B, T, generator=g, dtype=DT)) * mask_BT
    advantages_BT = torch.randn(B, T, generator=g, dtype=DT) * mask_BT
    return features_BTD, weight_DV, tokens_BT, mask_BT, sampler_BT, advantages_BT


def micro_batch_gradient(problem, rows_per_micro_batch: int, naive: bool) -> torch.Tensor:
    """Gradient accumulated over micro-batches, each with its own forward and backward pass."""
    features_BTD, weight_DV, tokens_BT, mask_BT, sampler_BT, advantages_BT = problem
    num_tokens = float(mask_BT.sum())  # the global count of the whole step
    num_micro_batches = B // rows_per_micro_batch
    weight_DV.grad = None
    for start in range(0, B, rows_per_micro_batch):
        rows = slice(start, start + rows_per_micro_batch)
        logprobs_mTV = torch.log_softmax(features_BTD[rows] @ weight_DV, dim=-1)
        student_mT = logprobs_mTV.gather(-1, tokens_BT[rows].unsqueeze(-1)).squeeze(-1)
        loss_mT = importance_sampled_pg_loss(student_mT, sampler_BT[rows], advantages_BT[rows])
        if naive:  # the pitfall: a per-micro-batch token mean, averaged over micro-batches
            loss = masked_mean(loss_mT, mask_BT[rows]) / num_micro_batches
        else:
            loss = token_sum_normalized(loss_mT, mask_BT[rows], num_tokens)
        loss.backward()
    return weight_DV.grad.clone()


def full_batch_token_mean_gradient(problem) -> torch.Tensor:
    """Brute force: the gradient of (1/N) Σ_{b,t} m ℓ, the sum written out as a python loop."""
    features_BTD, weight_DV, tokens_BT, mask_BT, sampler_BT, advantages_BT = problem
    logprobs_BTV = torch.log_softmax(features_BTD @ weight_DV, dim=-1)
    total, count = 0.0, 0
    for b in range(B):
        for t in range(LENGTHS[b]):
            ratio = torch.exp(logprobs_BTV[b, t, tokens_BT[b, t]] - sampler_BT[b, t])
            total, count = total - ratio * advantages_BT[b, t], count + 1
    (grad_DV,) = torch.autograd.grad(total / count, weight_DV)
    return grad_DV


@pytest.mark.parametrize("rows_per_micro_batch", [8, 4, 2, 1])
def test_global_token_normalisation_is_micro_batch_invariant(rows_per_micro_batch: int):
    problem = make_problem()
    expected_DV = full_batch_token_mean_gradient(problem)
    assert expected_DV.abs().max() > 1e-2
    got_DV = micro_batch_gradient(problem, rows_per_micro_batch, naive=False)
    torch.testing.assert_close(got_DV, expected_DV, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows_per_micro_batch", [4, 2])
def test_naive_per_micro_batch_mean_is_not_invariant(rows_per_micro_batch: int):
    problem = make_problem()
    expected_DV = full_batch_token_mean_gradient(problem)
    # One micro-batch: naive and correct coincide; the split is what breaks the naive mean.
    torch.testing.assert_close(micro_batch_gradient(problem, 8, naive=True), expected_DV, atol=1e-6, rtol=0)
    naive_DV = micro_batch_gradient(problem, rows_per_micro_batch, naive=True)
    assert (naive_DV - expected_DV).abs().max() > 1e-3
