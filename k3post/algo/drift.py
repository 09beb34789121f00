"""Sampler-vs-learner drift: the per-step figures, the gate's decision, and the IS corrections.

The sampler draws y_t ~ μ(· | s_t) and records log μ(y_t); the learner recomputes log π(y_t)
with the same weights (one update older in async mode). With matching numerics π = μ and the
importance ratio ρ_t = π(y_t)/μ(y_t) is 1. Anything else — a bf16 engine, a kernel that depends
on the batch, a sampler at the wrong temperature, weights that did not arrive — shows up here.
Three figures per step, over the tokens of the loss mask (d_t = log μ(y_t) − log π(y_t)):

- mean |Δ log p| = mean_t |d_t|                  the plainest: 0 iff the numerics agree exactly;
- KL(μ‖π) ≈ mean_t k3_t,  k3 = e^{−d} − 1 + d = ρ − 1 − log ρ   Schulman's k3 estimator: with y ~ μ
  it is unbiased (E_μ[ρ] = 1 and E_μ[d] = KL(μ‖π)) and every term is ≥ 0, so a few tokens cannot
  cancel each other out;
- max_t ρ_t                                       the token whose gradient is blown up the most.

The gate (`drift_verdict`) reads mean |Δ log p| against two thresholds: above `stop` the run
stops; above `warn` it warns and, if the recipe names a correction, switches it on; below, it is
silent. The corrections reweight the policy-gradient term per token (verl/OpenRLHF's rollout
corrections; docs/learner.md). The sampled-token loss is ℓ_t = −ρ_t A_t (value ρ_t A_t, gradient
ρ_t A_t ∇log π); multiplying A_t by a constant factor f_t (no gradient) makes it

- TIS, truncated IS (cap C):  f_t = min(1, C/ρ_t)  ⇒ weight min(ρ_t, C): a token the learner finds
  far likelier than the sampler did no longer dominates the step; tokens with ρ_t ≤ C unchanged;
- MIS, masked IS (threshold c): f_t = 1 if 1/c ≤ ρ_t ≤ c else 0 (ICEPOP): a token whose ratio
  leaves the band contributes nothing to the objective — its policy-gradient term is 0 and it
  leaves the loss mask, so full-vocabulary and top-k terms skip it too; the rest are unchanged.

  The normaliser does not change. The step's loss is divided by N, its token count *before* the
  correction, so a dropped token still counts in the denominator:

      L_MIS = −(1/N) Σ_{t : 1/c ≤ ρ_t ≤ c} ρ_t A_t,     N = Σ_t mask_t   (kept and dropped alike)

  This is IcePop's objective (1/Σ|y_i| over every token, the mask inside the sum), and it is kept
  rather than renormalised by the kept count N_kept: each kept token's gradient is exactly what it
  was without the correction, so dropping tokens makes the step smaller and never amplifies the
  survivors (a renormalised MIS scales all of them by N / N_kept, most when the drift is worst);
  and N is read from the batch before any forward, the same on every rank and for any micro-batch
  size, while N_kept depends on log π of every micro-batch, so it would need all the forwards (or
  a collective) before the first backward. The KL-to-reference term and the drift figures still
  count every token of the uncorrected mask.

Both bias the estimator slightly (they change the weights of exactly the tokens where μ and π
disagree most) in exchange for bounded variance: the usual trade.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from k3post.algo.aggregate import masked_mean
from k3post.algo.policy_loss import importance_ratio_stats

Action = Literal["ok", "warn", "correct", "stop"]
CORRECTIONS = ("none", "tis", "mis")


@torch.no_grad()
def mismatch_stats(student_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor,
                   loss_mask_BT: torch.Tensor) -> dict[str, float]:
    """The step's drift figures over the masked-in tokens (all 0 for an empty mask): ratio_mean
    (mean ρ; E_μ[ρ] = 1), ratio_max, logprob_abs_diff (mean |d|) — policy_loss.py — and sampler_kl
    (mean k3, the estimate of KL(μ‖π))."""
    stats = importance_ratio_stats(student_logprobs_BT, sampler_logprobs_BT, loss_mask_BT)
    log_ratio_BT = (student_logprobs_BT - sampler_logprobs_BT).float()  # log ρ = −d
    k3_BT = torch.expm1(log_ratio_BT) - log_ratio_BT  # ρ − 1 − log ρ ≥ 0
    stats["sampler_kl"] = masked_mean(k3_BT, loss_mask_BT.float()).item()
    return stats


@torch.no_grad()
def is_correction_factor(student_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor, kind: str,
                         cap: float) -> torch.Tensor:
    """The per-token factor f_t (no gradient) that turns −ρ_t A_t into the `kind` correction:
    tis: min(1, cap/ρ_t); mis: 1 inside [1/cap, cap], else 0; none: 1 (module docstring)."""
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown IS correction {kind!r}; choose one of {CORRECTIONS}")
    if not cap > 1.0:
        raise ValueError(f"the IS correction's cap must be > 1, got {cap}")
    log_ratio_BT = (student_logprobs_BT - sampler_logprobs_BT).float().clamp(-20.0, 20.0)
    if kind == "tis":  # min(1, C/ρ) = exp(min(0, log C − log ρ))
        return torch.exp(torch.clamp(math.log(cap) - log_ratio_BT, max=0.0))
    if kind == "mis":  # 1/c ≤ ρ ≤ c  ⇔  |log ρ| ≤ log c
        return (log_ratio_BT.abs() <= math.log(cap)).float()
    return torch.ones_like(log_ratio_BT)


@dataclass(frozen=True)
class Verdict:
    """What the gate decided at one step, and the figure that decided it."""

    action: Action
    figure: str = ""  # the metric that decided (e.g. train/logprob_abs_diff)
    value: float = 0.0
    limit: float = 0.0  # the threshold it crossed

    def describe(self) -> str:
        return f"{self.figure}={self.value:.4g} > {self.limit:g}" if self.figure else "no drift"


def exact_verdict(max_abs_diff: float, figure: str) -> Verdict:
    """sampling.on_policy: bitwise promises log π(y_t) == log μ(y_t) for every token, so the largest
    |d_t| must be exactly 0: anything else (NaN included) stops. There is no tolerance to tune: a
    broken invariant is a bug (a kernel the mode does not cover, weights that differ), not noise."""
    if max_abs_diff == 0.0:
        return Verdict("ok")
    return Verdict("stop", figure, max_abs_diff, 0.0)


def drift_verdict(value: float, warn: float, stop: float | None, correction: str, figure: str) -> Verdict:
    """stop above `stop` (None: never); above `warn`: correct when a correction is named, else
    warn; otherwise ok. A NaN figure decides nothing (a non-finite step is skipped elsewhere)."""
    if stop is not None and value > stop:
        return Verdict("stop", figure, value, stop)
    if value > warn:
        return Verdict("correct" if correction != "none" else "warn", figure, value, warn)
    return Verdict("ok")
