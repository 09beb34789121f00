"""Per-token estimators of KL(π_θ ‖ π_ref) from sampled tokens (Schulman, "Approximating KL").

With y ~ π_θ and d = log π_θ(y) − log π_ref(y):

    k1 = d                  unbiased; can be negative per sample; as a loss its expected gradient
                            is 0 (use it as a reward/advantage term, or for logging)
    k2 = ½ d²               biased, ≥ 0; as a loss its expected gradient is ∇ KL(π_θ‖π_ref)
    k3 = e^{−d} − 1 + d     unbiased (E[e^{−d}] = Σ_y π_ref(y) = 1) and ≥ 0; as a loss its
                            expected gradient is ∇ KL(π_ref‖π_θ) (forward KL)

(REFERENCE §2.2/§3.) k3 is what GRPO-style "β·KL" terms use; the tests check these claims by
exact enumeration.

The one clamp, and why only one: −d is clamped to [−20, 20] inside k3's exponent (as verl), so
one wild token cannot overflow exp; the linear term d is not clamped, and neither is the value
(verl also clamps k3 to [−10, 10]). A clamp on the value, or on the d of the linear term, zeroes
the gradient exactly on the tokens furthest from the reference, which are the ones the penalty
exists to pull back; this way such a token still gets ∂k3/∂d = 1 − e^{−d} with the exponent
capped. For |d| ≤ 20 this is the plain formula; k3 is finite for every finite d.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

EXPONENT_CLAMP = 20.0


def _k1(d_BT: torch.Tensor) -> torch.Tensor:
    return d_BT


def _k2(d_BT: torch.Tensor) -> torch.Tensor:
    return 0.5 * d_BT.square()


def _k3(d_BT: torch.Tensor) -> torch.Tensor:
    # Only the exponent is clamped: the linear term keeps its gradient on every token.
    return torch.exp((-d_BT).clamp(-EXPONENT_CLAMP, EXPONENT_CLAMP)) - 1.0 + d_BT


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """The per-token estimate `kind` ∈ {k1, k2, k3}; differentiable w.r.t. `logprobs_BT` only
    (the reference is detached). Not masked or reduced."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logprobs_BT - ref_logprobs_BT.detach())
