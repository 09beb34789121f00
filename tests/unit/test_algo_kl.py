"""KL estimators against exact enumeration on a toy softmax policy (REFERENCE §2.2)."""

from __future__ import annotations

import math

import pytest
import torch

from k3post.algo.kl import kl_estimate


def exact_expectation_and_grad(kind: str):
    torch.manual_seed(0)
    theta = torch.randn(6, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6), -1)
    logp = torch.log_softmax(theta, -1)
    probs = logp.exp().detach()
    # E_{y~π_θ}[k(y)] with the sampling distribution held fixed (what a loss on samples sees).
    expectation = sum(probs[y] * kl_estimate(logp[y:y + 1], ref[y:y + 1], kind)[0] for y in range(6))
    grad = torch.autograd.grad(expectation, theta)[0]
    return theta, ref, expectation.detach(), grad


def kl(p_log, q_log):
    return (p_log.exp() * (p_log - q_log)).sum()


def test_k1_and_k3_are_unbiased_k2_is_not():
    for kind, unbiased in (("k1", True), ("k3", True), ("k2", False)):
        theta, ref, expectation, _ = exact_expectation_and_grad(kind)
        true = kl(torch.log_softmax(theta.detach(), -1), ref)
        assert torch.isclose(expectation, true, atol=1e-6) == unbiased, kind


def test_gradients_of_the_estimators_as_losses():
    theta, ref, _, g1 = exact_expectation_and_grad("k1")
    assert g1.abs().max() < 1e-6  # k1 as a loss: zero expected gradient
    _, _, _, g2 = exact_expectation_and_grad("k2")
    _, _, _, g3 = exact_expectation_and_grad("k3")
    t = theta.detach().clone().requires_grad_(True)
    reverse = torch.autograd.grad(kl(torch.log_softmax(t, -1), ref), t)[0]
    forward = torch.autograd.grad(kl(ref, torch.log_softmax(t, -1)), t)[0]
    assert torch.allclose(g2, reverse, atol=1e-5)   # k2 → ∇ KL(π_θ‖π_ref)
    assert torch.allclose(g3, forward, atol=1e-5)   # k3 → ∇ KL(π_ref‖π_θ)
    assert not torch.allclose(reverse, forward, atol=1e-3)


def test_k3_is_nonnegative_zero_at_equality_and_clamped():
    d = torch.tensor([-50.0, -1.0, 0.0, 1.0, 50.0])
    k3 = kl_estimate(d, torch.zeros(5), "k3")
    assert (k3 >= 0).all() and k3[2] == 0 and torch.isfinite(k3).all()


def test_extreme_tokens_stay_finite_and_keep_their_gradient():
    """The one clamp is on k3's exponent: the value is not clamped, so the tokens furthest from
    the reference still get a gradient (a value clamp would give them exactly 0)."""
    d = torch.tensor([-59.9, 59.9, 0.0, 1.0], dtype=torch.float64, requires_grad=True)
    k3 = kl_estimate(d, torch.zeros(4, dtype=torch.float64), "k3")
    # the exponent −d capped at ±20, the linear term kept: e^{20} − 1 − 59.9 and e^{−20} − 1 + 59.9
    assert k3[0].item() == pytest.approx(math.exp(20) - 60.9) and k3[1].item() == pytest.approx(math.exp(-20) + 58.9)
    assert k3[2].item() == 0.0 and k3[3].item() == pytest.approx(math.exp(-1.0))
    (grad,) = torch.autograd.grad(k3.sum(), d)
    assert grad[0].item() == 1.0 and grad[1].item() == 1.0  # the linear term's 1 where exp is capped, not 0
    assert grad[3].item() == pytest.approx(1 - math.exp(-1.0))  # 1 − e^{−d} inside the clamp range


def test_names_are_checked_and_the_reference_is_a_constant():
    logprobs = torch.tensor([[-1.0, -0.3]], requires_grad=True)
    ref = torch.tensor([[-2.0, -0.1]], requires_grad=True)
    for kind in ("k1", "k2", "k3"):
        kl_estimate(logprobs, ref, kind).sum().backward()
    assert ref.grad is None and logprobs.grad is not None
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logprobs, ref, "k4")
