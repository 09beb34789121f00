"""Per-token estimators of KL(π_θ ‖ π_ref) from sampled tokens (Schulman, "Approximating KL").

With y ~ π_θ and d = log π_θ(y) − log π_ref(y):

    k1 = d                  unbiased; as a loss its expected gradient is 0 (use it for logging)
    k2 = ½ d²               biased;   as a loss its expected gradient is ∇ KL(π_θ‖π_ref)
    k3 = e^{−d} − 1 + d     unbiased and ≥ 0; as a loss its expected gradient is ∇ KL(π_ref‖π_θ)

(REFERENCE §2.2/§3.) k3 is what GRPO-style "β·KL" terms use; the tests check these claims by
exact enumeration. As in verl, −d is clamped to [−20, 20] inside k3 so one wild token cannot
overflow exp.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """The per-token estimate `kind` ∈ {k1, k2, k3}; differentiable w.r.t. `logprobs_BT`."""
    d_BT = logprobs_BT - ref_logprobs_BT.detach()
    if kind == "k1":
        return d_BT
    if kind == "k2":
        return 0.5 * d_BT.square()
    if kind == "k3":
        neg_d_BT = (-d_BT).clamp(-20.0, 20.0)
        return torch.exp(neg_d_BT) - 1.0 - neg_d_BT
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")
