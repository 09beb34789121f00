"""Top-k + tail-bucket losses (algo/topk.py) against closed forms, brute force and finite differences."""

from __future__ import annotations

import math
from decimal import Decimal, getcontext

import pytest
import torch

from k3post.algo.aggregate import token_sum_normalized
from k3post.algo.objectives import PerTeacherOPD, TeacherTerm
from k3post.algo.policy_loss import importance_sampled_pg_loss
from k3post.algo.topk import (bin_divergence, complement_logsumexp, log1mexp, tail_from_topk, topk_bins,
                              topk_divergence, topk_loss, topk_mass)
from k3post.types import TeacherPart, TeacherTopK, TrainBatch

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


def assert_the_objective_takes_the_top_k_kl_as_a_loss_on_the_logits(divergence: str, beta: float) -> None:
    """The learner's objective (algo/objectives.py: PerTeacherOPD, the path a top-k teacher's rows
    take in a run) on one top-k teacher's rows: its gradient w.r.t. the student's logits is the
    gradient of coef · Σ_t m_t D_t / N with D_t the brute-force (k+1)-bin divergence, whatever the
    batch's advantages and sampled tokens hold.

    The top-k KL at a state is one number whatever token y_t was drawn. Turned into a per-token
    advantage A_t = −coef·D_t of the policy gradient −ρ_t A_t (miles #2362), the gradient is
    coef·D_t·ρ_t·∇log π(y_t): along the sampled token only, and zero in expectation over y_t, where
    ∇D_t is not - so the first assertion fails. Reading the driver's advantages on these rows (the
    sampled-token −coef·k_t) would make the gradient move with them - so the second fails."""
    coef, N = 0.7, 5.0
    z = logits(13).requires_grad_(True)
    teacher = logits(14).log_softmax(-1)
    ids, values, tail = teacher_topk(teacher, 3)
    g = torch.Generator().manual_seed(15)
    tokens_BT = torch.randint(0, V, (B, T), generator=g)
    sampler_BT = (z.detach().log_softmax(-1).gather(-1, tokens_BT[..., None]).squeeze(-1)
                  + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64))
    objective = PerTeacherOPD((("t", TeacherTerm(f"topk_{divergence}", coef=coef, k=3, beta=beta)),))
    part = TeacherPart("t", tuple(range(B)), TeacherTopK(ids.int(), values, tail))

    def gradient(advantages_BT: torch.Tensor) -> torch.Tensor:
        batch = TrainBatch([[1]] * B, tokens_BT, MASK, sampler_BT, advantages_BT, teacher_parts=(part,))
        s_BTV = z.log_softmax(-1)
        s_BT = s_BTV.gather(-1, tokens_BT[..., None]).squeeze(-1)
        return torch.autograd.grad(objective.loss(batch, s_BT, s_BTV, N), z)[0]

    want = torch.autograd.grad(coef * (brute_force(z.log_softmax(-1), teacher, ids, divergence, beta) * MASK).sum() / N,
                               z)[0]
    got = gradient(torch.randn(B, T, generator=g, dtype=torch.float64))  # what the driver left there
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gradient(torch.zeros(B, T, dtype=torch.float64)), got, rtol=0, atol=0)


@pytest.mark.parametrize("divergence, beta", DIVS)
def test_the_pipeline_takes_a_top_k_kl_as_a_loss_on_the_logits_never_as_an_advantage(divergence, beta):
    assert_the_objective_takes_the_top_k_kl_as_a_loss_on_the_logits(divergence, beta)


def test_a_top_k_term_implemented_as_an_advantage_fails_that_check(monkeypatch):
    """The check above can fail: the mutation the design forbids (the top-k divergence turned into
    a per-token advantage A_t = −coef·D_t of the importance-sampled policy gradient) is caught,
    as is a top-k term that adds the driver's advantages on its rows."""
    import k3post.algo.objectives as objectives

    def as_advantage(term, mb, part, s_BT, s_BTV, num_tokens):
        student_bins, teacher_bins = topk_bins(s_BTV, part.payload.ids_BTK.long(), part.payload.logprobs_BTK,
                                               part.payload.tail_logprobs_BT)
        div_BT = bin_divergence(student_bins, teacher_bins, term.kind.removeprefix("topk_"), term.beta)
        advantages_BT = -term.coef * div_BT.detach()
        loss_BT = importance_sampled_pg_loss(s_BT, mb.sampler_logprobs_BT, advantages_BT)
        return token_sum_normalized(loss_BT, mb.loss_mask_BT, num_tokens), div_BT.detach(), None

    def plus_the_drivers_advantages(term, mb, part, s_BT, s_BTV, num_tokens):
        loss, kl_BT, mass_BT = objectives._topk_term(term, mb, part, s_BT, s_BTV, num_tokens)
        pg_BT = importance_sampled_pg_loss(s_BT, mb.sampler_logprobs_BT, mb.advantages_BT)
        return loss + token_sum_normalized(pg_BT, mb.loss_mask_BT, num_tokens), kl_BT, mass_BT

    for mutant in (as_advantage, plus_the_drivers_advantages):
        monkeypatch.setitem(objectives.TERM_LOSSES, "topk_reverse", mutant)
        with pytest.raises(AssertionError):
            assert_the_objective_takes_the_top_k_kl_as_a_loss_on_the_logits("reverse", 0.5)


def _kl(p: list[float], q: list[float]) -> float:
    """KL(p‖q) in Python floats with 0·log 0 = 0 and p·log(p/0) = +inf for p > 0."""
    return sum(0.0 if a == 0 else (math.inf if b == 0 else a * math.log(a / b)) for a, b in zip(p, q))


@pytest.mark.parametrize("divergence, beta", DIVS)
def test_a_student_with_no_mass_outside_the_top_k_keeps_the_teachers_tail(divergence, beta):
    """A masked vocabulary (a constrained decoder): the student's logprobs are −inf outside the
    teacher's top-k, V = 6, k = 3. The ids do not cover the vocabulary, so the teacher's tail mass
    is a bin of its own - p_T(tail) = 1 − Σ_k p_T > 0 against p_θ(tail) = 0 - not dropped (that
    made the forward KL negative). The (k+1)-bin divergence equals brute force in float64 (the
    forward KL is +inf: the student cannot hold mass the teacher has), and the gradient w.r.t.
    the logits is finite (no nan from a logsumexp over only −inf)."""
    v, k = 6, 3
    g = torch.Generator().manual_seed(21)
    teacher = torch.randn(1, 1, v, generator=g, dtype=torch.float64).log_softmax(-1)
    values, ids = teacher.topk(k, dim=-1)
    tail = complement_logsumexp(teacher, ids)
    allowed = torch.zeros(1, 1, v, dtype=torch.bool).scatter_(-1, ids, True)
    z = torch.randn(1, 1, v, generator=g, dtype=torch.float64).requires_grad_(True)
    student = z.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    got = topk_divergence(student, ids, values, tail, torch.ones(1, 1), divergence, beta)
    (grad,) = torch.autograd.grad(got.sum(), z)
    p_t = teacher[0, 0].exp().tolist()
    p_s = student[0, 0].detach().exp().tolist()
    top = ids[0, 0].tolist()
    q = [p_t[i] for i in top] + [1 - sum(p_t[i] for i in top)]
    s = [p_s[i] for i in top] + [0.0]
    if divergence == "forward":
        want = _kl(q, s)
    elif divergence == "reverse":
        want = _kl(s, q)
    else:
        m = [beta * a + (1 - beta) * b for a, b in zip(q, s)]
        want = beta * _kl(q, m) + (1 - beta) * _kl(s, m)
    assert q[-1] > 0.05  # the teacher's tail is not negligible
    assert float(got) == pytest.approx(want, rel=1e-9)
    assert torch.isfinite(grad).all() and float(grad.abs().sum()) > 0
    assert grad[~allowed].abs().max() == 0  # masked logits get no gradient


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
