"""Distillation losses on the teacher's top-k support plus one tail bucket.

Shipping a teacher's whole next-token distribution costs V floats per position (152k at a Qwen
vocabulary: 1.2 GB for one 2,048-token completion in fp32). A teacher can instead send, at every
completion position t, the ids S_t of its k most likely tokens and their logprobs, and the
learner compares the two distributions on k + 1 bins:

    bins:      v_1, ..., v_k  (S_t, the teacher's top-k ids)   and   "tail" (every other id)
    teacher:   p_T(v_i)                                                p_T(tail) = 1 − Σ_i p_T(v_i)
    student:   p_θ(v_i)                                                p_θ(tail) = Σ_{v ∉ S_t} p_θ(v)

Both are proper distributions on the k + 1 bins (they sum to 1), so every divergence below is
≥ 0 and is 0 exactly when the student matches the teacher's top-k probabilities and its tail
*mass* (how the tail mass is spread over the V − k ids is not seen). This is the "tail bucket"
(TRL's `loss_add_tail`): without it (renormalising over S_t, NeMo-RL's default) the loss is blind
to mass the student puts outside S_t, and at k = 1 it is identically zero.

The bins are a coarsening of the vocabulary, so by the data-processing inequality every KL over
the bins is ≤ the full-vocabulary KL, with equality at k = V (the tail is empty: both tails are
exactly 0, not a rounding residue). The student's tail is computed as the logsumexp of its logprobs
*outside* S_t, not as log(1 − Σ_{S_t} p): no cancellation when the top-k holds nearly all the mass,
and an exact −inf when S_t is the whole vocabulary. Whether the tail bin is empty is decided from
the ids and V alone: a student whose logprobs are −inf outside S_t (a masked vocabulary) has a
zero tail, but the teacher's tail is still its own mass (the forward KL is then +inf). A slot
that repeats an id an earlier slot holds is an empty bin on both sides (`repeated_slots`: how a
payload with fewer than k ids at a position is padded). The teacher's tail comes with its scores (the HF teacher computes it from its complement the same way;
a vLLM teacher only has its top-k and uses `tail_from_topk`).

Losses, with s = the student's k + 1 bin logprobs and t = the teacher's:

    forward  KL(T‖S) = Σ_b p_T(b) (log p_T(b) − log p_θ(b))     mass-covering (as in SFT on the teacher)
    reverse  KL(S‖T) = Σ_b p_θ(b) (log p_θ(b) − log p_T(b))     mode-seeking (what OPD minimises)
    JSD(β)           = β KL(T‖M) + (1 − β) KL(S‖M),  M = β p_T + (1 − β) p_θ   (0 < β < 1)

The β convention is TRL's `generalized_jsd_loss` (REFERENCE §2.5): β = 0 is the forward KL and
β = 1 the reverse KL. These end points are the mixture's limits up to scale: as β → 0,
JSD(β)/β → KL(T‖S), and as β → 1, JSD(β)/(1 − β) → KL(S‖T) (the unscaled mixture goes to 0 at both
ends, so the end points are defined as the KLs themselves). β = 0.5 is the symmetric JSD, bounded
by log 2.

Gradient. Each loss is a function of the student's k + 1 bin probabilities, which are functions of
its logits z: ∂ log p_θ(v)/∂z_u = 1[u = v] − p_θ(u). For the forward KL, ∂/∂z_u = p_θ(u) − p_T(b(u))
· p_θ(u)/p_θ(b(u)) (b(u) = u's bin): the teacher's top-k mass is pulled onto those ids and the tail
mass onto the rest in proportion to what the student has there. These are *losses* on the student's
distribution at each visited state, differentiated directly. They must never be turned into a
per-token advantage: the top-k KL at state s_t is the same number whatever token y_t was drawn, and
an action-independent advantage A has zero expected policy gradient, Σ_y π(y) A ∇log π(y) =
A ∇Σ_y π(y) = 0 (REFERENCE §2.2, miles #2362). That identity holds for any constant A, so it
is not tested; what tests/unit/test_algo_topk.py checks is that the learner's objective
(objectives.py: PerTeacherOPD) gives a top-k teacher's rows the gradient of the brute-force bin
divergence w.r.t. the logits whatever the batch's advantages hold, and that the check fails on a
top-k term implemented as an advantage.

Every function is over tensors with scalar arguments; `topk_loss` is masked and divided by the
step's global token count like every objective (aggregate.token_sum_normalized).
"""

from __future__ import annotations

import math

import torch

from k3post.algo.aggregate import token_sum_normalized
from k3post.algo.opd import kl_divergence

DIVERGENCES = ("forward", "reverse", "jsd")
# A teacher tail mass reported as 0 by an engine that only returns the top-k (a rounding residue,
# the tail is not empty) is floored at 1e-30: the reverse KL stays finite, the forward KL unaffected.
TAIL_FLOOR = math.log(1e-30)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − e^x) for x ≤ 0, accurate at both ends (Mächler 2012): log(−expm1(x)) near 0,
    log1p(−e^x) far below it. x ≥ 0 gives −inf (no mass left)."""
    x = x.clamp(max=0.0)
    near_zero = x > -math.log(2.0)
    # where() on the inputs too: the unselected branch's gradient must not be nan.
    a = torch.where(near_zero, x, torch.full_like(x, -1.0))
    b = torch.where(near_zero, torch.full_like(x, -1.0), x)
    return torch.where(near_zero, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(b)))


def tail_from_topk(topk_logprobs_BTK: torch.Tensor) -> torch.Tensor:
    """The teacher's tail logprob log(1 − Σ_k p) from its top-k logprobs alone (a vLLM teacher),
    floored at TAIL_FLOOR: a rounding residue Σ_k p ≥ 1 is not an empty tail. [B, T]."""
    return log1mexp(torch.logsumexp(topk_logprobs_BTK, dim=-1)).clamp(min=TAIL_FLOOR)


def complement(logprobs_BTV: torch.Tensor, ids_BTK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log Σ_{v ∉ ids} p(v), whether the ids cover the whole vocabulary), each [B, T].

    The log-mass is exactly −inf, with a zero gradient, where the complement holds no mass: where
    it is empty (the ids are every id), and where every logprob in it is −inf (a masked
    vocabulary). The two are different facts - an empty set of ids, a set of ids with zero mass -
    and only the first says that a *teacher's* tail is empty too (`topk_bins`)."""
    in_topk_BTV = torch.zeros_like(logprobs_BTV, dtype=torch.bool).scatter_(-1, ids_BTK, True)
    covered_BT = in_topk_BTV.all(dim=-1)
    outside_BTV = logprobs_BTV.masked_fill(in_topk_BTV, float("-inf"))
    massless_BT = (outside_BTV == float("-inf")).all(dim=-1)  # covered ⇒ massless
    # logsumexp over only −inf has a nan gradient: feed such rows zeros and overwrite the result.
    outside_BTV = torch.where(massless_BT[..., None], torch.zeros_like(outside_BTV), outside_BTV)
    lse_BT = torch.logsumexp(outside_BTV, dim=-1)
    return torch.where(massless_BT, torch.full_like(lse_BT, float("-inf")), lse_BT), covered_BT


def complement_logsumexp(logprobs_BTV: torch.Tensor, ids_BTK: torch.Tensor) -> torch.Tensor:
    """log Σ_{v ∉ ids} p(v) at every position, [B, T]; exactly −inf (with a zero gradient) where the
    ids cover the whole vocabulary or the rest holds no mass (`complement`)."""
    return complement(logprobs_BTV, ids_BTK)[0]


def topk_bins(student_logprobs_BTV: torch.Tensor, topk_ids_BTK: torch.Tensor, teacher_topk_logprobs_BTK: torch.Tensor,
              teacher_tail_logprobs_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's and the teacher's logprobs on the k + 1 bins (the teacher's top-k ids, then
    the tail), each [B, T, k + 1].

    Where the ids cover the vocabulary (decided from the ids and V, not from the student's
    numbers) both tails are −inf: the tail bin is empty. A student with no mass outside the ids
    (−inf logprobs there: a masked vocabulary, a constrained decoder) has a tail of −inf while the
    teacher keeps its own, so the teacher's bins still sum to 1: the forward KL is then +inf (the
    student cannot hold mass the teacher has), the reverse KL and the JSD finite."""
    student_topk_BTK = student_logprobs_BTV.gather(-1, topk_ids_BTK)
    student_tail_BT, covered_BT = complement(student_logprobs_BTV, topk_ids_BTK)
    teacher_tail_BT = torch.where(covered_BT, torch.full_like(student_tail_BT, float("-inf")),
                                  teacher_tail_logprobs_BT.to(student_tail_BT.dtype))
    teacher_topk_BTK = teacher_topk_logprobs_BTK.to(student_topk_BTK.dtype)
    empty_BTK = repeated_slots(topk_ids_BTK)
    if empty_BTK.any():  # an engine that had fewer than k ids for a position (mapped_topk_of_topk)
        student_topk_BTK = student_topk_BTK.masked_fill(empty_BTK, float("-inf"))
        teacher_topk_BTK = teacher_topk_BTK.masked_fill(empty_BTK, float("-inf"))
    student_bins = torch.cat([student_topk_BTK, student_tail_BT[..., None]], dim=-1)
    teacher_bins = torch.cat([teacher_topk_BTK, teacher_tail_BT[..., None]], dim=-1)
    return student_bins, teacher_bins


def repeated_slots(ids_BTK: torch.Tensor) -> torch.Tensor:
    """Which slots repeat an id an earlier slot of the same position holds, [B, T, K] bool.

    A payload with fewer than k ids at a position fills the rest by repeating one of them; such a
    slot is an empty bin (−inf on both sides: its id's mass is counted once, in its first slot).
    torch.topk's ids never repeat, so this changes nothing for a teacher that sends k distinct ids.
    """
    sorted_BTK, order_BTK = ids_BTK.sort(dim=-1, stable=True)  # stable: the earliest slot comes first
    again_BTK = torch.zeros_like(ids_BTK, dtype=torch.bool)
    again_BTK[..., 1:] = sorted_BTK[..., 1:] == sorted_BTK[..., :-1]
    return torch.zeros_like(again_BTK).scatter(-1, order_BTK, again_BTK)


def mixture_logprobs(student_bins: torch.Tensor, teacher_bins: torch.Tensor, beta: float) -> torch.Tensor:
    """log M = log(β p_T + (1 − β) p_θ), elementwise, for 0 < β < 1; −inf (zero gradient) where
    both are 0."""
    a = student_bins + math.log1p(-beta)
    b = teacher_bins + math.log(beta)
    hi, lo = torch.maximum(a, b), torch.minimum(a, b)
    finite = torch.isfinite(hi)
    hi_safe = torch.where(finite, hi, torch.zeros_like(hi))
    lo_safe = torch.where(finite, lo, torch.zeros_like(lo))
    return torch.where(finite, hi_safe + torch.log1p(torch.exp(lo_safe - hi_safe)), hi)


def generalized_jsd(student_bins: torch.Tensor, teacher_bins: torch.Tensor, beta: float) -> torch.Tensor:
    """JSD(β) over the last axis (module docstring): β = 0 → KL(T‖S), β = 1 → KL(S‖T)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return kl_divergence(teacher_bins, student_bins)
    if beta == 1.0:
        return kl_divergence(student_bins, teacher_bins)
    mix = mixture_logprobs(student_bins, teacher_bins, beta)
    return beta * kl_divergence(teacher_bins, mix) + (1.0 - beta) * kl_divergence(student_bins, mix)


def bin_divergence(student_bins: torch.Tensor, teacher_bins: torch.Tensor, divergence: str,
                   beta: float = 0.5) -> torch.Tensor:
    """forward | reverse | jsd over the last axis, [B, T]. The teacher is detached (a fixed target)."""
    teacher_bins = teacher_bins.detach()
    if divergence == "forward":
        return kl_divergence(teacher_bins, student_bins)
    if divergence == "reverse":
        return kl_divergence(student_bins, teacher_bins)
    if divergence == "jsd":
        return generalized_jsd(student_bins, teacher_bins, beta)
    raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")


def topk_divergence(student_logprobs_BTV: torch.Tensor, topk_ids_BTK: torch.Tensor,
                    teacher_topk_logprobs_BTK: torch.Tensor, teacher_tail_logprobs_BT: torch.Tensor,
                    loss_mask_BT: torch.Tensor, divergence: str, beta: float = 0.5) -> torch.Tensor:
    """The per-position divergence on the k + 1 bins, [B, T] (0 at padding positions).

    At padding positions the teacher's bins are replaced by the student's own (detached): whatever
    an engine left there (zeros, a tail of −inf) gives a zero term with a finite zero gradient, not
    an inf whose 0 · inf = nan would reach the weights through the masked sum's backward.
    """
    student_bins, teacher_bins = topk_bins(student_logprobs_BTV, topk_ids_BTK, teacher_topk_logprobs_BTK,
                                           teacher_tail_logprobs_BT)
    valid_BT1 = (loss_mask_BT != 0)[..., None]
    teacher_bins = torch.where(valid_BT1, teacher_bins, student_bins.detach())
    return bin_divergence(student_bins, teacher_bins, divergence, beta)


def topk_loss(student_logprobs_BTV: torch.Tensor, topk_ids_BTK: torch.Tensor, teacher_topk_logprobs_BTK: torch.Tensor,
              teacher_tail_logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor, num_tokens: float,
              divergence: str, beta: float = 0.5) -> torch.Tensor:
    """Σ_{b,t} m_{bt} D_{bt} / num_tokens, a scalar differentiable w.r.t. the student's logits
    (through `student_logprobs_BTV` = log_softmax of them). `num_tokens`: the step's global count."""
    div_BT = topk_divergence(student_logprobs_BTV, topk_ids_BTK, teacher_topk_logprobs_BTK, teacher_tail_logprobs_BT,
                             loss_mask_BT, divergence, beta)
    return token_sum_normalized(div_BT, loss_mask_BT, num_tokens)


def topk_mass(teacher_topk_logprobs_BTK: torch.Tensor) -> torch.Tensor:
    """Σ_{v ∈ S_t} p_T(v): how much of the teacher's distribution its top-k covers, [B, T]."""
    return teacher_topk_logprobs_BTK.exp().sum(dim=-1)
