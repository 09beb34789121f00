"""Policy losses (importance-sampled, PPO-clip) and the train/inference mismatch diagnostics.

Tokens y_t were drawn by the sampler μ (an inference engine holding the weights θ_old); the
learner recomputes log π_θ(y_t) itself. Per token,

    ℓ_t(θ) = − ρ_t(θ) · A_t,      ρ_t(θ) = π_θ(y_t) / μ(y_t) = exp(log π_θ(y_t) − log μ(y_t)),

with A_t and log μ(y_t) constants. Since ∇ρ_t = ρ_t ∇log π_θ(y_t),

    E_{y~μ}[∇ℓ_t] = − Σ_y μ(y) ρ(y) A(y) ∇log π_θ(y) = − E_{y~π_θ}[A ∇log π_θ],

the on-policy policy gradient even when μ ≠ π_θ (off-policy by a few steps, or the sampler's
numerics differing from the learner's). At θ = θ_old with matching numerics, ρ = 1 and the
gradient is − A_t ∇log π_θ(y_t). No ratio clipping is applied here: for OPD the advantages come
from a fixed teacher, not from a learned critic, and large ratios are surfaced by
`importance_ratio_stats` instead of being silently truncated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3post.algo.aggregate import masked_mean


def importance_sampled_pg_loss(
    student_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor, advantages_BT: torch.Tensor
) -> torch.Tensor:
    """Per-token loss − exp(log π_θ(y_t) − log μ(y_t)) · A_t; gradients flow into the student only.

    Not masked or reduced: aggregate with `token_sum_normalized`. Padding positions should hold
    A = 0 and sampler logprob 0, where the ratio is ≤ 1 (student logprobs are ≤ 0), so they stay
    finite; the aggregation ignores them anyway.
    """
    # Detach both constants: a gradient into A or log μ would change the estimator.
    log_ratio_BT = student_logprobs_BT - sampler_logprobs_BT.detach()
    return -torch.exp(log_ratio_BT) * advantages_BT.detach()


@torch.no_grad()
def importance_ratio_stats(
    student_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor
) -> dict[str, float]:
    """Masked diagnostics of how far the learner's logprobs are from the sampler's.

    - ratio_mean: mean over masked-in tokens of ρ_t = exp(log π_θ(y_t) − log μ(y_t)). Under
      y ~ μ its expectation is Σ_y π_θ(y) = 1, so a mean far from 1 means mismatch or staleness.
    - ratio_max: max of ρ_t over masked-in tokens (the tokens whose gradients blow up).
    - logprob_abs_diff: mean of |log π_θ(y_t) − log μ(y_t)| (0 iff the numerics agree exactly).
    - logprob_abs_diff_max: max of |log π_θ(y_t) − log μ(y_t)|: exactly 0 iff every token agrees
      bit for bit (a mean can round a single differing token away; a max cannot).

    All four are 0.0 when the mask is empty (nothing to compare).
    """
    log_ratio_BT = (student_logprobs_BT - sampler_logprobs_BT).float()
    mask_BT = loss_mask_BT.float()
    ratio_BT = torch.exp(log_ratio_BT)
    selected = mask_BT != 0
    any_selected = bool(selected.any())
    return {
        "ratio_mean": masked_mean(ratio_BT, mask_BT).item(),
        "ratio_max": ratio_BT[selected].max().item() if any_selected else 0.0,
        "logprob_abs_diff": masked_mean(log_ratio_BT.abs(), mask_BT).item(),
        "logprob_abs_diff_max": log_ratio_BT[selected].abs().max().item() if any_selected else 0.0,
    }


def ppo_clip_loss(
    student_logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """Per-token clipped surrogate  ℓ_t = max(−ρ_t A_t, −clip(ρ_t, 1−ε_low, 1+ε_high) A_t).

    ρ_t = exp(log π_θ(y_t) − log π_old(y_t)). The max of the two *losses* (= min of the two
    objectives) is pessimistic: once a step has moved ρ past the trust region in the direction
    the advantage favours (ρ > 1+ε_high with A > 0, or ρ < 1−ε_low with A < 0), the clipped
    branch is constant and the token stops pulling. In the other direction the unclipped branch
    wins, so a step that made a good token less likely (A > 0, ρ < 1−ε) still gets corrected.

    Dual clip (Ye et al. 2020, verl `clip_ratio_c`, typically 3): for A < 0 the loss −ρA grows
    without bound in ρ; it is capped at −c·A, i.e. ℓ = min(ℓ, −c·A) where A < 0, c > 1.

    The log-ratio is clamped to [−20, 20] before exp (as verl) so that stale or padded tokens
    cannot overflow; old logprobs and advantages are constants (detached). Not reduced: use
    `token_sum_normalized` (aggregate.py).
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (a cap on the ratio for negative advantages), got {dual_clip}")
    advantages_BT = advantages_BT.detach()
    log_ratio_BT = (student_logprobs_BT - old_logprobs_BT.detach()).clamp(-20.0, 20.0)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -ratio_BT * advantages_BT
    clipped_BT = -ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages_BT
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    if dual_clip is not None:
        capped_BT = torch.minimum(loss_BT, -dual_clip * advantages_BT)
        loss_BT = torch.where(advantages_BT < 0, capped_BT, loss_BT)
    return loss_BT


def _importance_sampled(student_logprobs_BT, old_logprobs_BT, advantages_BT, eps_low, eps_high, dual_clip):
    return importance_sampled_pg_loss(student_logprobs_BT, old_logprobs_BT, advantages_BT)


POLICY_LOSSES: dict[str, Callable[..., torch.Tensor]] = {"ppo_clip": ppo_clip_loss, "is": _importance_sampled}


def policy_loss(
    kind: str,
    student_logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """The per-token policy loss `kind`, not reduced:

    ppo_clip  max(−ρA, −clip(ρ, 1−ε_low, 1+ε_high)·A) (+ dual clip), `ppo_clip_loss`;
    is        −ρA, plain importance sampling (policy_loss.py), the ε arguments unused.

    ρ = exp(log π_θ − log π_old) with π_old the *sampler's* recorded logprobs (the behaviour
    policy that drew the tokens). With one update per batch, ρ = 1 up to train/inference
    numerics and both give the on-policy gradient −A∇log π; they differ once the learner has
    moved away from the sampler (stale samples, several updates, a mismatched engine).
    """
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r}; choose one of {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[kind](student_logprobs_BT, old_logprobs_BT, advantages_BT, eps_low, eps_high, dual_clip)


