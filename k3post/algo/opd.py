"""On-policy distillation (OPD): reverse KL to a teacher, estimated on the student's own samples.

The objective is the reverse KL of the student π_θ from the teacher π_T over the student's own
completions, KL(π_θ‖π_T) = E_{y~π_θ}[Σ_t log π_θ(y_t|s_t) − log π_T(y_t|s_t)]. Reverse KL is
mode-seeking: the student is punished for mass where the teacher has little, not for missing
some of the teacher's modes.

Sampled-token OPD. The sampler μ (= π_θ_old) drew y_t at state s_t; the teacher scores the same
token. The per-token estimator

    k_t = log μ(y_t|s_t) − log π_T(y_t|s_t)

has E_{y~μ}[k] = Σ_y μ(y)(log μ(y) − log π_T(y)) = KL(μ‖π_T)(s_t): an unbiased one-sample KL
estimate needing one teacher logprob per token instead of the full vocabulary. Using A_t = −k_t
as the advantage of an ordinary policy-gradient loss (policy_loss.py) gives, at θ = θ_old,

    E_{y~μ}[−A ∇log π_θ(y)] = Σ_y μ(y)(log μ(y) − log π_T(y)) ∇log π_θ(y) = ∇_θ KL(π_θ‖π_T)

because ∇KL(π_θ‖π_T) = Σ_y π_θ ∇log π_θ (log π_θ − log π_T) + Σ_y ∇π_θ, and Σ_y ∇π_θ = ∇1 = 0.
So minimising the PG loss descends the exact per-state reverse KL.

Discount. The choice of y_t also changes the later states s_{t'>t}. The sequence-level gradient
weights ∇log π_θ(y_t) by the reward-to-go −Σ_{t'≥t} k_{t'} (discount γ = 1); γ = 0 keeps only the
immediate term (lower variance, ignores that effect -- the common OPD default); 0 < γ < 1 sits
in between.
"""

from __future__ import annotations

import torch

from k3post.algo.aggregate import token_sum_normalized


def teacher_kl_per_token(
    sampler_logprobs_BT: torch.Tensor, teacher_logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor
) -> torch.Tensor:
    """k_t = (log μ(y_t) − log π_T(y_t)) · m_t; its mean under y ~ μ is KL(μ‖π_T) at state s_t.

    Padding positions are exactly 0, even where the teacher logprob is not finite there.
    """
    diff_BT = sampler_logprobs_BT - teacher_logprobs_BT
    # where(), not only "* mask": a -inf teacher logprob at a pad would give inf * 0 = nan.
    return torch.where(loss_mask_BT != 0, diff_BT * loss_mask_BT, torch.zeros_like(diff_BT))


def discounted_future_sum(values_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """out_t = Σ_{t' ≥ t} γ^{t'−t} values_{t'} along the last axis (the reward-to-go).

    Vectorised as one matmul with the upper-triangular matrix W[t, t'] = γ^{t'−t} for t' ≥ t
    (0 below the diagonal): out = values @ Wᵀ. This is O(T²) memory, fine for completion
    lengths, and, unlike the trick of rescaling a cumsum by γ^{−t}, never under/overflows.
    Exponents count positions, so masked-out positions inside a row still age the discount.
    γ = 0 returns the values unchanged (0⁰ = 1 on the diagonal); γ = 1 is a reversed cumsum.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if gamma == 0.0:
        return values_BT.clone()
    num_positions = values_BT.shape[-1]
    index_T = torch.arange(num_positions, device=values_BT.device)
    lag_TT = index_T.unsqueeze(0) - index_T.unsqueeze(1)  # lag_TT[t, t'] = t' − t
    # Powers in float64 so long sequences do not accumulate rounding in γ^k.
    powers_TT = torch.pow(torch.tensor(gamma, dtype=torch.float64), lag_TT.clamp(min=0).double())
    weight_TT = torch.where(lag_TT >= 0, powers_TT, torch.zeros_like(powers_TT)).to(values_BT.dtype)
    return values_BT @ weight_TT.T


def sampled_token_advantages(
    sampler_logprobs_BT: torch.Tensor,
    teacher_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    kl_coef: float,
    discount: float = 0.0,
) -> torch.Tensor:
    """A_t = −kl_coef · m_t · k_t (discount = 0), or m_t · Σ_{t'≥t} γ^{t'−t}(−kl_coef · m_{t'} k_{t'}).

    Detached: advantages are constants of the policy-gradient loss. Plugged into
    `importance_sampled_pg_loss`, the expected gradient at θ = θ_old is kl_coef · ∇KL(π_θ‖π_T)
    per state (module docstring). Padding positions are 0.
    """
    with torch.no_grad():
        k_BT = teacher_kl_per_token(sampler_logprobs_BT.detach(), teacher_logprobs_BT.detach(), loss_mask_BT)
        advantages_BT = -kl_coef * k_BT
        if discount != 0.0:  # discounted_future_sum rejects γ outside [0, 1]
            # The sum runs over later positions; re-mask so pads get no advantage of their own.
            advantages_BT = discounted_future_sum(advantages_BT, discount) * loss_mask_BT
    return advantages_BT


def kl_divergence(p_logprobs_BTV: torch.Tensor, q_logprobs_BTV: torch.Tensor) -> torch.Tensor:
    """Exact KL(p‖q) = Σ_v p(v) (log p(v) − log q(v)) over the last (vocabulary) axis.

    Terms where p(v) = 0 (log p = −inf) are 0, the limit of x log x as x → 0, instead of the
    0 · (−inf − ...) = nan that the plain formula gives; their gradient is 0 too. If q(v) = 0
    where p(v) > 0 the KL is +inf, as it should be. Reverse KL for OPD: p = student, q = teacher;
    forward KL (supervised distillation): p = teacher, q = student.
    """
    support_BTV = p_logprobs_BTV != float("-inf")
    zeros_BTV = torch.zeros_like(p_logprobs_BTV)
    # Replace log p off the support *before* the arithmetic: where() drops the unselected
    # branch's value, but its gradient exp(−inf)·(−inf − log q) = nan would still flow into p.
    safe_p_BTV = torch.where(support_BTV, p_logprobs_BTV, zeros_BTV)
    terms_BTV = torch.where(support_BTV, safe_p_BTV.exp() * (safe_p_BTV - q_logprobs_BTV), zeros_BTV)
    return terms_BTV.sum(dim=-1)


def full_vocab_reverse_kl_loss(
    student_logprobs_BTV: torch.Tensor,
    teacher_logprobs_BTV: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    num_tokens: float,
) -> torch.Tensor:
    """Σ_{b,t} m_{bt} KL(π_θ‖π_T)_{bt} / num_tokens, a scalar differentiable w.r.t. the student.

    The exact (zero-variance) counterpart of sampled-token OPD, for when full teacher
    distributions are available. The teacher is detached: it is the fixed target.
    `num_tokens` is the step's global token count (see aggregate.token_sum_normalized).
    """
    kl_BT = kl_divergence(student_logprobs_BTV, teacher_logprobs_BTV.detach())
    return token_sum_normalized(kl_BT, loss_mask_BT, num_tokens)
