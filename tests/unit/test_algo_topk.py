"""Top-k + tail-bucket losses (algo/topk.py) against closed forms, brute force and finite differences."""

from __future__ import annotations

import math
from decimal import Decimal, getcontext

import pytest
import torch

from k3post.algo.topk import (complement_logsumexp, log1mexp, tail_from_topk, topk_divergence, topk_loss, topk_mass)

B, T, V = 2, 3, 7
DIVS = [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.5), ("jsd", 0.1), ("jsd", 0.9)]


def logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(B, T, V, generator=g)).double()


def teacher_topk(teacher_logprobs_BTV: torch.Tensor, k: int):
    """What an HF teacher sends: its top-k ids and logprobs and its exact tail logprob."""
    values, ids = teacher_logprobs_BTV.topk(k, dim=-1)
    return ids, values, complement_logsumexp(teacher_logprobs_BTV, ids)


def brute_force(student_BTV, teacher_BTV, ids_BTK, divergence, beta):
    """The (k+1)-bin divergence position by position, in plain probabilities (float64)."""
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            p_s, p_t = student_BTV[b, t].exp(), teacher_BTV[b, t].exp()
            ids = ids_BTK[b, t].tolist()
            rest = [v for v in range(V) if v not in ids]
            s = [p_s[v] for v in ids] + ([p_s[rest].sum()] if rest else [])
            q = [p_t[v] for v in ids] + ([1 - p_t[ids].sum()] if rest else [])
            s, q = torch.stack(s), torch.stack(q)
            kl = lambda p, r: (p * (p / r).log()).sum()  # noqa: E731
            if divergence == "forward":
                out[b, t] = kl(q, s)
            elif divergence == "reverse":
                out[b, t] = kl(s, q)
            else:
                m = beta * q + (1 - beta) * s
                out[b, t] = beta * kl(q, m) + (1 - beta) * kl(s, m)
    return out


MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


@pytest.mark.parametrize("divergence, beta", DIVS)
@pytest.mark.parametrize("k", [1, 3, V])
def test_equals_the_tail_bucket_formula_and_at_k_equal_v_the_exact_full_vocabulary_divergence(divergence, beta, k):
    z_s = logits(0).requires_grad_(True)
    student = z_s.log_softmax(-1)
    teacher = logits(1).log_softmax(-1)
    ids, values, tail = teacher_topk(teacher, k)
    got = topk_loss(student, ids, values, tail, MASK, 4.0, divergence, beta)
    expected = (brute_force(student, teacher, ids, divergence, beta) * MASK).sum() / 4.0
    assert float(got.detach()) == pytest.approx(float(expected), rel=1e-10, abs=1e-12)
    (grad_got,) = torch.autograd.grad(got, z_s, retain_graph=True)
    (grad_expected,) = torch.autograd.grad(expected, z_s)
    torch.testing.assert_close(grad_got, grad_expected, rtol=1e-8, atol=1e-10)
    if k == V:  # no tail: the exact full-vocabulary divergence, from its own closed form
        p_s, p_t = student.exp(), teacher.exp()
        full = {"forward": (p_t * (teacher - student)).sum(-1), "reverse": (p_s * (student - teacher)).sum(-1)}
        m = beta * p_t + (1 - beta) * p_s
        full["jsd"] = (beta * (p_t * (p_t / m).log()).sum(-1) + (1 - beta) * (p_s * (p_s / m).log()).sum(-1))
        assert float(got.detach()) == pytest.approx(float((full[divergence] * MASK).sum() / 4.0), rel=1e-10)


def test_the_bin_kl_never_exceeds_the_full_vocabulary_kl():
    student, teacher = logits(2).log_softmax(-1), logits(3).log_softmax(-1)
    full_reverse = (student.exp() * (student - teacher)).sum(-1)
    for k in range(1, V + 1):
        ids, values, tail = teacher_topk(teacher, k)
        binned = topk_divergence(student, ids, values, tail, torch.ones(B, T), "reverse")
        assert (binned <= full_reverse + 1e-12).all()


def test_jsd_end_points_are_the_two_kls_and_the_limits_of_the_scaled_mixture():
    student, teacher = logits(4).log_softmax(-1), logits(5).log_softmax(-1)
    ids, values, tail = teacher_topk(teacher, 3)
    mask = torch.ones(B, T)
    div = lambda d, beta=0.5: topk_divergence(student, ids, values, tail, mask, d, beta)  # noqa: E731
    torch.testing.assert_close(div("jsd", 0.0), div("forward"))
    torch.testing.assert_close(div("jsd", 1.0), div("reverse"))
    eps = 1e-5
    torch.testing.assert_close(div("jsd", eps) / eps, div("forward"), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(div("jsd", 1 - eps) / eps, div("reverse"), rtol=1e-3, atol=1e-6)
    assert (div("jsd", 0.5) <= math.log(2) + 1e-12).all()


@pytest.mark.parametrize("divergence, beta", DIVS)
def test_gradients_match_finite_differences(divergence, beta):
    teacher = logits(6).log_softmax(-1)
    ids, values, tail = teacher_topk(teacher, 2)

    def loss(z):
        return topk_loss(z.log_softmax(-1), ids, values, tail, MASK, 5.0, divergence, beta)

    assert torch.autograd.gradcheck(loss, (logits(7).requires_grad_(True),), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("divergence, beta", DIVS)
@pytest.mark.parametrize("k", [1, 4, V])
def test_student_equal_to_teacher_gives_zero_loss_and_zero_gradient(divergence, beta, k):
    z = logits(8).requires_grad_(True)
    student = z.log_softmax(-1)
    ids, values, tail = teacher_topk(student.detach(), k)
    loss = topk_loss(student, ids, values, tail, MASK, 5.0, divergence, beta)
    loss.backward()
    assert float(loss) == pytest.approx(0.0, abs=1e-12)
    assert z.grad.abs().max() < 1e-12


def test_padding_positions_with_garbage_teacher_scores_give_finite_zero_gradients():
    z = logits(9).requires_grad_(True)
    ids, values, tail = teacher_topk(logits(10).log_softmax(-1), 3)
    values, tail, ids = values.clone(), tail.clone(), ids.clone()
    values[1, 2], tail[1, 2], ids[1, 2] = 0.0, float("-inf"), 0  # what a pad may hold (MASK[1, 2] = 0)
    for divergence, beta in DIVS:
        z.grad = None
        loss = topk_loss(z.log_softmax(-1), ids, values, tail, MASK, 5.0, divergence, beta)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(z.grad).all()
        assert z.grad[1, 2].abs().max() == 0.0


def test_normalised_by_the_global_token_count_so_micro_batches_add_up():
    student, teacher = logits(11).log_softmax(-1), logits(12).log_softmax(-1)
    ids, values, tail = teacher_topk(teacher, 2)
    whole = topk_loss(student, ids, values, tail, MASK, 5.0, "jsd", 0.3)
    parts = sum(topk_loss(student[r], ids[r], values[r], tail[r], MASK[r], 5.0, "jsd", 0.3)
                for r in (slice(0, 1), slice(1, 2)))
    assert float(whole) == pytest.approx(float(parts), rel=1e-12)


def test_a_top_k_term_as_an_action_independent_advantage_has_zero_expected_gradient_the_loss_does_not():
    """miles #2362: the top-k KL at a state is one number whatever token was drawn. Used as the
    advantage A of a policy gradient −A log π(y), its expected gradient Σ_y π(y)·(−A ∇log π(y)) is
    0 (computed here exactly, by enumerating y); the loss's gradient is the true ∇KL ≠ 0."""
    z = logits(13)[0, 0].requires_grad_(True)  # one position, V logits
    teacher = logits(14)[0, 0].log_softmax(-1)
    values, ids = teacher.topk(3)
    tail = complement_logsumexp(teacher[None, None], ids[None, None])
    mask = torch.ones(1, 1)

    def kl(zz):
        return topk_loss(zz.log_softmax(-1)[None, None], ids[None, None], values[None, None], tail, mask, 1.0,
                         "reverse")

    (loss_grad,) = torch.autograd.grad(kl(z), z)
    advantage = -float(kl(z))  # the same for every action
    log_pi = z.log_softmax(-1)
    expected_pg = sum(log_pi[y].exp().detach() * torch.autograd.grad(-advantage * log_pi[y], z, retain_graph=True)[0]
                      for y in range(V))
    assert expected_pg.abs().max() < 1e-12
    assert loss_grad.norm() > 1e-3
    with torch.no_grad():  # and the loss gradient is a descent direction of the KL
        assert kl(z - 0.1 * loss_grad) < kl(z)


def test_log1mexp_and_the_tail_from_the_top_k_alone():
    x = torch.tensor([-1e-10, -1e-3, -0.5, -1.0, -30.0], dtype=torch.float64)
    getcontext().prec = 50  # the reference in 50-digit decimals: float64's 1 − e^x loses it at both ends
    exact = torch.tensor([float((1 - Decimal(v).exp()).ln()) for v in x.tolist()], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), exact, rtol=1e-12, atol=0)
    teacher = logits(15).log_softmax(-1)
    ids, values, exact = teacher_topk(teacher, 3)
    torch.testing.assert_close(tail_from_topk(values), exact)
    ones = torch.zeros(1, 1, 2).log_softmax(-1)  # Σ p = 1: a vLLM teacher's rounding, not an empty tail
    assert tail_from_topk(ones).item() == pytest.approx(math.log(1e-30))
    torch.testing.assert_close(topk_mass(values), values.exp().sum(-1))
