"""OPD maths against closed forms, exact enumeration over a toy vocabulary, and brute force.

Toy "model": one softmax over V tokens per state, π_θ(·|s) = softmax(θ_s). To enumerate the
expectation over y ~ μ exactly, position t of row s holds token y = t, so a [S, V] tensor of
logprobs is a batch of S states × all V possible tokens, in the library's [B, T] layout.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3post.algo.opd import (
    discounted_future_sum,
    full_vocab_reverse_kl_loss,
    kl_divergence,
    sampled_token_advantages,
    teacher_kl_per_token,
)
from k3post.algo.policy_loss import importance_sampled_pg_loss

V = 5
DT = torch.float64


def toy_logits(seed: int, num_states: int = 3, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(num_states, V, generator=g, dtype=DT)


def exact_reverse_kl(student_logits_SV: torch.Tensor, teacher_logprobs_SV: torch.Tensor) -> torch.Tensor:
    """Σ_s KL(π_θ(·|s) ‖ π_T(·|s)) via kl_divergence (itself checked against a loop below)."""
    student_SV = torch.log_softmax(student_logits_SV, dim=-1)
    return kl_divergence(student_SV.unsqueeze(1), teacher_logprobs_SV.unsqueeze(1)).sum()


def expected_pg_loss(logits_SV: torch.Tensor, teacher_SV: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Σ_s Σ_y μ(y|s) ℓ(y) at θ = θ_old (μ = π_θ, detached), enumerating every token y."""
    student_SV = torch.log_softmax(logits_SV, dim=-1)
    sampler_SV = student_SV.detach()
    mask_SV = torch.ones_like(sampler_SV)
    advantages_SV = sampled_token_advantages(sampler_SV, teacher_SV, mask_SV, kl_coef)
    loss_SV = importance_sampled_pg_loss(student_SV, sampler_SV, advantages_SV)
    return (sampler_SV.exp() * loss_SV).sum()


def test_student_equal_teacher_gives_zero_advantages_and_zero_gradient():
    torch.manual_seed(0)
    logits_BTV = torch.randn(2, 4, V, dtype=DT, requires_grad=True)
    student_BTV = torch.log_softmax(logits_BTV, dim=-1)
    tokens_BT = torch.multinomial(student_BTV.detach().exp().view(-1, V), 1).view(2, 4)
    student_BT = student_BTV.gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1)
    sampler_BT = student_BT.detach()
    teacher_BT = torch.log_softmax(logits_BTV.detach().clone(), dim=-1).gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1)
    mask_BT = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]], dtype=DT)
    for discount in (0.0, 0.7, 1.0):
        advantages_BT = sampled_token_advantages(sampler_BT, teacher_BT, mask_BT, kl_coef=1.0, discount=discount)
        assert torch.equal(advantages_BT, torch.zeros_like(advantages_BT))
    (grad,) = torch.autograd.grad(importance_sampled_pg_loss(student_BT, sampler_BT, advantages_BT).sum(), logits_BTV)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_teacher_kl_estimator_mean_equals_exact_kl_by_enumeration():
    sampler_SV = torch.log_softmax(toy_logits(1), dim=-1)
    teacher_SV = torch.log_softmax(toy_logits(2), dim=-1)
    k_SV = teacher_kl_per_token(sampler_SV, teacher_SV, torch.ones_like(sampler_SV))  # k(y) for every y
    expectation_S = (sampler_SV.exp() * k_SV).sum(dim=-1)  # Σ_y μ(y) k(y)
    exact_S = kl_divergence(sampler_SV.unsqueeze(1), teacher_SV.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(expectation_S, exact_S, atol=1e-12, rtol=0)
    assert (exact_S > 0.05).all()  # a non-trivial pair, so the comparison means something


def test_teacher_kl_estimator_monte_carlo_within_four_standard_errors():
    torch.manual_seed(0)
    sampler_V = torch.log_softmax(toy_logits(3, num_states=1)[0], dim=-1)
    teacher_V = torch.log_softmax(toy_logits(4, num_states=1)[0], dim=-1)
    n = 200_000
    y_N = torch.multinomial(sampler_V.exp(), n, replacement=True)
    k_N = teacher_kl_per_token(sampler_V[y_N], teacher_V[y_N], torch.ones(n, dtype=DT))
    standard_error = k_N.std().item() / math.sqrt(n)
    exact = kl_divergence(sampler_V.view(1, 1, V), teacher_V.view(1, 1, V)).item()
    assert abs(k_N.mean().item() - exact) < 4 * standard_error
    assert standard_error < 0.05 * exact  # the tolerance is tight relative to the KL itself


def test_teacher_kl_per_token_masks_padding_even_if_teacher_is_minus_inf():
    sampler_BT = torch.tensor([[-0.5, -1.0, 0.0]])
    teacher_BT = torch.tensor([[-1.5, -0.25, float("-inf")]])
    k_BT = teacher_kl_per_token(sampler_BT, teacher_BT, torch.tensor([[1.0, 1.0, 0.0]]))
    assert torch.equal(k_BT, torch.tensor([[1.0, -0.75, 0.0]]))


@pytest.mark.parametrize("kl_coef", [1.0, 0.3])
def test_expected_pg_gradient_equals_reverse_kl_gradient(kl_coef: float):
    """The core claim: E_{y~μ}[∇ℓ] with A = −kl_coef·k equals kl_coef · ∇KL(π_θ‖π_T) at θ = θ_old."""
    teacher_SV = torch.log_softmax(toy_logits(6), dim=-1)
    logits_SV = toy_logits(5).requires_grad_(True)
    (pg_grad,) = torch.autograd.grad(expected_pg_loss(logits_SV, teacher_SV, kl_coef), logits_SV)
    (kl_grad,) = torch.autograd.grad(exact_reverse_kl(logits_SV, teacher_SV), logits_SV)
    torch.testing.assert_close(pg_grad, kl_coef * kl_grad, atol=1e-12, rtol=0)
    assert kl_grad.abs().max() > 0.05


def test_enumerated_gradient_steps_drive_reverse_kl_to_zero():
    teacher_SV = torch.log_softmax(toy_logits(8), dim=-1)
    logits_SV = toy_logits(7).requires_grad_(True)
    kls = [exact_reverse_kl(logits_SV, teacher_SV).item()]
    for _ in range(300):
        (grad,) = torch.autograd.grad(expected_pg_loss(logits_SV, teacher_SV, kl_coef=1.0), logits_SV)
        with torch.no_grad():
            logits_SV -= 1.0 * grad
        kls.append(exact_reverse_kl(logits_SV, teacher_SV).item())
    assert kls[1] < kls[0]
    assert kls[-1] < 1e-4 * kls[0]


def test_sampled_gradient_steps_drive_reverse_kl_near_zero():
    """The estimator as the pipeline uses it: sampled tokens only, one teacher logprob each."""
    torch.manual_seed(0)
    teacher_SV = torch.log_softmax(toy_logits(10), dim=-1)
    logits_SV = toy_logits(9).requires_grad_(True)
    start = exact_reverse_kl(logits_SV, teacher_SV).item()
    for _ in range(100):
        student_SV = torch.log_softmax(logits_SV, dim=-1)
        y_SN = torch.multinomial(student_SV.detach().exp(), 2000, replacement=True)
        student_SN = student_SV.gather(1, y_SN)
        sampler_SN, mask_SN = student_SN.detach(), torch.ones_like(student_SN)
        advantages_SN = sampled_token_advantages(sampler_SN, teacher_SV.gather(1, y_SN), mask_SN, kl_coef=1.0)
        loss = importance_sampled_pg_loss(student_SN, sampler_SN, advantages_SN).sum() / y_SN.shape[1]
        (grad,) = torch.autograd.grad(loss, logits_SV)
        with torch.no_grad():
            logits_SV -= 1.0 * grad
    assert exact_reverse_kl(logits_SV, teacher_SV).item() < 0.01 * start


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 1.0])
def test_discounted_future_sum_matches_python_double_loop(gamma: float):
    torch.manual_seed(0)
    values_BT = torch.randn(3, 7, dtype=DT)
    expected_BT = torch.zeros_like(values_BT)
    for b in range(3):
        for t in range(7):
            expected_BT[b, t] = sum(gamma ** (u - t) * values_BT[b, u].item() for u in range(t, 7))
    torch.testing.assert_close(discounted_future_sum(values_BT, gamma), expected_BT, atol=1e-12, rtol=0)
    if gamma == 0.0:
        assert torch.equal(discounted_future_sum(values_BT, gamma), values_BT)


def test_discounted_advantages_match_loop_masked_and_detached():
    torch.manual_seed(0)
    sampler_BT = -torch.rand(2, 5, dtype=DT, requires_grad=True)
    teacher_BT = -3 * torch.rand(2, 5, dtype=DT)
    mask_BT = torch.tensor([[1.0, 0, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=DT)  # a gap, then trailing pads
    advantages_BT = sampled_token_advantages(sampler_BT, teacher_BT, mask_BT, kl_coef=0.5, discount=0.8)
    assert not advantages_BT.requires_grad
    for b in range(2):
        for t in range(5):
            future = sum(
                0.8 ** (u - t) * -0.5 * mask_BT[b, u].item() * (sampler_BT[b, u] - teacher_BT[b, u]).item()
                for u in range(t, 5)
            )
            assert advantages_BT[b, t].item() == pytest.approx(mask_BT[b, t].item() * future, abs=1e-12)


def brute_force_kl(p_logprobs_V: torch.Tensor, q_logprobs_V: torch.Tensor) -> float:
    total = 0.0
    for lp, lq in zip(p_logprobs_V.tolist(), q_logprobs_V.tolist()):
        if lp != float("-inf"):  # 0 · log 0 = 0
            total += math.exp(lp) * (lp - lq)
    return total


def test_kl_divergence_matches_loop_zero_on_identical_and_asymmetric():
    p_BTV = torch.log_softmax(toy_logits(11, num_states=6).view(2, 3, V), dim=-1)
    q_BTV = torch.log_softmax(toy_logits(12, num_states=6).view(2, 3, V), dim=-1)
    kl_BT = kl_divergence(p_BTV, q_BTV)
    assert kl_BT.shape == (2, 3)
    for b in range(2):
        for t in range(3):
            assert kl_BT[b, t].item() == pytest.approx(brute_force_kl(p_BTV[b, t], q_BTV[b, t]), abs=1e-12)
    assert torch.equal(kl_divergence(p_BTV, p_BTV), torch.zeros(2, 3, dtype=DT))
    reverse_BT, forward_BT = kl_BT, kl_divergence(q_BTV, p_BTV)
    assert (reverse_BT > 0).all() and (forward_BT > 0).all()
    assert (reverse_BT - forward_BT).abs().min() > 1e-3


def test_kl_divergence_zero_probability_token_gives_no_nan():
    p_V = torch.tensor([math.log(0.5), math.log(0.5), float("-inf")], dtype=DT, requires_grad=True)
    q_V = torch.log(torch.tensor([0.25, 0.25, 0.5], dtype=DT))
    kl = kl_divergence(p_V.view(1, 1, 3), q_V.view(1, 1, 3))
    assert kl.item() == pytest.approx(math.log(2), abs=1e-12)  # Σ_{p>0} 0.5 · log(0.5/0.25)
    kl.sum().backward()
    assert torch.isfinite(p_V.grad).all() and p_V.grad[2] == 0
    # The other direction: q has no mass where p does → +inf, not nan.
    assert kl_divergence(q_V.view(1, 1, 3), p_V.detach().view(1, 1, 3)).item() == float("inf")
    # Both without mass on token 2 (e.g. a banned token): finite, and finite gradients to both.
    q_both_V = torch.log(torch.tensor([0.25, 0.75, 0.0], dtype=DT)).requires_grad_(True)
    p_V.grad = None
    kl = kl_divergence(p_V.view(1, 1, 3), q_both_V.view(1, 1, 3)).sum()
    assert kl.item() == pytest.approx(0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75), abs=1e-12)
    kl.backward()
    assert torch.isfinite(p_V.grad).all() and torch.isfinite(q_both_V.grad).all() and q_both_V.grad[2] == 0


def test_full_vocab_loss_ignores_masked_positions_and_matches_brute_force():
    student_BTV = torch.log_softmax(toy_logits(13, num_states=6).view(2, 3, V), dim=-1)
    teacher_BTV = torch.log_softmax(toy_logits(14, num_states=6).view(2, 3, V), dim=-1)
    mask_BT = torch.tensor([[1.0, 1, 0], [1, 0, 0]], dtype=DT)
    loss = full_vocab_reverse_kl_loss(student_BTV, teacher_BTV, mask_BT, num_tokens=10.0)
    expected = sum(brute_force_kl(student_BTV[b, t], teacher_BTV[b, t]) for b, t in [(0, 0), (0, 1), (1, 0)]) / 10
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    changed_BTV = teacher_BTV.clone()
    changed_BTV[0, 2] = torch.log_softmax(torch.randn(V, dtype=DT), dim=-1)
    changed_BTV[1, 1] = float("-inf")  # even garbage at a pad must not matter
    assert full_vocab_reverse_kl_loss(student_BTV, changed_BTV, mask_BT, 10.0).item() == loss.item()
    changed_BTV[0, 1] = changed_BTV[0, 2]  # ...while a masked-in position does
    assert full_vocab_reverse_kl_loss(student_BTV, changed_BTV, mask_BT, 10.0).item() != loss.item()


def test_full_vocab_loss_gradient_matches_finite_differences():
    teacher_BTV = torch.log_softmax(toy_logits(16, num_states=4).view(2, 2, V), dim=-1)
    mask_BT = torch.tensor([[1.0, 1], [1, 0]], dtype=DT)

    def loss_of(logits_BTV: torch.Tensor) -> torch.Tensor:
        return full_vocab_reverse_kl_loss(torch.log_softmax(logits_BTV, dim=-1), teacher_BTV, mask_BT, 3.0)

    logits_BTV = toy_logits(15, num_states=4).view(2, 2, V).requires_grad_(True)
    # gradcheck: autograd's Jacobian against central finite differences (eps 1e-6, float64).
    assert torch.autograd.gradcheck(loss_of, (logits_BTV,), eps=1e-6, atol=1e-8, rtol=0)
    (grad_BTV,) = torch.autograd.grad(loss_of(logits_BTV), logits_BTV)
    assert grad_BTV[0].abs().max() > 1e-2 and torch.equal(grad_BTV[1, 1], torch.zeros(V, dtype=DT))
