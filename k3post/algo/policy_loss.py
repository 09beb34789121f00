"""The importance-sampled policy-gradient loss and its train/inference mismatch diagnostics.

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

    All three are 0.0 when the mask is empty (nothing to compare).
    """
    log_ratio_BT = (student_logprobs_BT - sampler_logprobs_BT).float()
    mask_BT = loss_mask_BT.float()
    ratio_BT = torch.exp(log_ratio_BT)
    selected = mask_BT != 0
    ratio_max = ratio_BT[selected].max().item() if bool(selected.any()) else 0.0
    return {
        "ratio_mean": masked_mean(ratio_BT, mask_BT).item(),
        "ratio_max": ratio_max,
        "logprob_abs_diff": masked_mean(log_ratio_BT.abs(), mask_BT).item(),
    }
