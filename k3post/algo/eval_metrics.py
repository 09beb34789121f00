"""Evaluation statistics: pass@k, confidence intervals, per-sequence exact KL.

pass@k, the unbiased estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code"). Draw n ≥ k samples for a prompt, c of them correct. The chance that k samples drawn
*without replacement* from those n are all wrong is C(n−c, k) / C(n, k), so

    pass@k = 1 − C(n−c, k) / C(n, k)

averaged over prompts is an unbiased estimate of "at least one of k fresh samples is correct".
(The naive 1 − (1 − c/n)^k is biased low.) The binomials overflow for large n; the ratio is the
product Π_{i=n−c+1}^{n} (1 − k/i), which stays in [0, 1].

Intervals, and why each one is valid.
- Rates (pass@k): the unit of independence is the *prompt*, not the sample (the n samples of
  one prompt are correlated through it). Each prompt contributes a number x_i ∈ [0, 1] whose
  variance is at most p(1−p) — a Bernoulli variable has the largest variance of any [0, 1]
  variable with mean p. So the Wilson score interval with "successes" Σ x_i and "trials" = the
  number of prompts is a (slightly conservative) interval for the mean rate. Wilson, unlike
  p ± z·sqrt(p(1−p)/m), never leaves [0, 1] and does not collapse to a point at p = 0 or 1.
- Token-mean KL and NLL are ratios Σ_i a_i / Σ_i t_i over sequences (a_i: the sequence's summed
  KL or NLL, t_i: its token count). The unit is the sequence; we resample sequences with
  replacement (percentile bootstrap, a seeded generator, so reruns give the same interval).

Exact KL per sequence: Σ_t mask_t · KL(p_t ‖ q_t) with the full-vocabulary KL of algo/opd.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from k3post.algo.opd import kl_divergence

BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class Estimate:
    """A point estimate with a two-sided interval at `confidence`, and how it was made."""

    value: float
    low: float
    high: float
    method: str
    confidence: float = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased P(at least one of k samples is correct) from c correct out of n samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def mean_pass_at_k(num_samples: int, correct_per_prompt: list[int], k: int) -> list[float]:
    """pass@k of each prompt (the caller averages them and puts an interval on the mean)."""
    return [pass_at_k(num_samples, c, k) for c in correct_per_prompt]


def z_value(confidence: float) -> float:
    """The two-sided normal quantile: 1.96 for 0.95."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: float, trials: int, confidence: float = 0.95) -> Estimate:
    """Wilson score interval of a rate: the p whose normal test at `confidence` accepts successes/trials.

    Solving |p̂ − p| = z·sqrt(p(1−p)/m) for p gives
        centre = (p̂ + z²/2m) / (1 + z²/m),  half = z/(1 + z²/m) · sqrt(p̂(1−p̂)/m + z²/4m²).
    `successes` may be fractional (a sum of per-prompt rates in [0, 1]; see the module notes).
    """
    if trials <= 0 or not 0 <= successes <= trials:
        raise ValueError(f"need trials > 0 and 0 <= successes <= trials, got {successes}/{trials}")
    z = z_value(confidence)
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    # The interval always contains p̂; min/max only absorb rounding at p̂ = 0 or 1.
    return Estimate(p, min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)), "wilson", confidence)


def rate_estimate(per_prompt: list[float], confidence: float = 0.95) -> Estimate:
    """Mean of per-prompt rates in [0, 1] with a Wilson interval over prompts."""
    return wilson_interval(float(sum(per_prompt)), len(per_prompt), confidence)


def bootstrap_ratio(numerators: list[float] | torch.Tensor, denominators: list[float] | torch.Tensor,
                    confidence: float = 0.95, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES) -> Estimate:
    """Σ a_i / Σ t_i with a percentile-bootstrap interval over the units i.

    Each resample draws len(a) units with replacement and recomputes the ratio; the interval is
    the (1 ± confidence)/2 quantiles of those ratios. With one unit there is nothing to resample
    and the interval is the point. A mean is the special case t_i = 1.
    """
    a = torch.as_tensor(numerators, dtype=torch.float64).flatten()
    t = torch.as_tensor(denominators, dtype=torch.float64).flatten()
    if a.numel() == 0 or a.shape != t.shape or float(t.sum()) <= 0:
        raise ValueError(f"need equal, non-empty numerators/denominators with a positive total, got {a.numel()}, "
                         f"{t.numel()} (total {float(t.sum()) if t.numel() else 0})")
    value = float(a.sum() / t.sum())
    if a.numel() == 1:
        return Estimate(value, value, value, "bootstrap", confidence)
    index_RN = _resamples(a.numel(), resamples, seed)
    return _percentile_interval(_ratios(a, t, index_RN), value, confidence, "bootstrap")


def _resamples(n: int, resamples: int, seed: int) -> torch.Tensor:
    return torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(seed))


def _ratios(a: torch.Tensor, t: torch.Tensor, index_RN: torch.Tensor) -> torch.Tensor:
    """Σ a / Σ t over each resample's units [R]; an all-empty resample counts as 0."""
    return a[index_RN].sum(dim=1) / t[index_RN].sum(dim=1).clamp(min=1e-12)


def _percentile_interval(samples_R: torch.Tensor, value: float, confidence: float, method: str) -> Estimate:
    tail = (1 - confidence) / 2
    low, high = torch.quantile(samples_R, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return Estimate(value, min(low, value), max(high, value), method, confidence)


def bootstrap_paired_difference(base: tuple, other: tuple, confidence: float = 0.95, seed: int = 0,
                                resamples: int = BOOTSTRAP_RESAMPLES) -> Estimate:
    """Δ = Σ b_i / Σ u_i − Σ a_i / Σ t_i for `other` = (b, u) against `base` = (a, t), measured on
    the same units i (the same prompts, the same reference replies), with a paired percentile
    bootstrap: each resample draws one set of units for both sides. The spread between units,
    which both sides share, cancels; the interval is that of the difference alone, much tighter
    than two separate intervals would suggest when the sides are correlated."""
    a, t, b, u = (torch.as_tensor(x, dtype=torch.float64).flatten() for x in (*base, *other))
    if not a.numel() == t.numel() == b.numel() == u.numel() > 0 or float(t.sum()) <= 0 or float(u.sum()) <= 0:
        raise ValueError(f"need the same non-empty units on both sides, got {a.numel()}, {t.numel()}, {b.numel()}, "
                         f"{u.numel()}")
    value = float(b.sum() / u.sum() - a.sum() / t.sum())
    if a.numel() == 1:
        return Estimate(value, value, value, "paired bootstrap", confidence)
    index_RN = _resamples(a.numel(), resamples, seed)
    return _percentile_interval(_ratios(b, u, index_RN) - _ratios(a, t, index_RN), value, confidence,
                                "paired bootstrap")


def sequence_kl(p_logprobs_BTV: torch.Tensor, q_logprobs_BTV: torch.Tensor, loss_mask_BT: torch.Tensor
                ) -> torch.Tensor:
    """Σ_t mask_t · KL(p_t ‖ q_t) for each sequence, [B] (float64: sums of many small terms)."""
    kl_BT = kl_divergence(p_logprobs_BTV.float(), q_logprobs_BTV.float())
    return (kl_BT.double() * loss_mask_BT.double()).sum(dim=1)


def sequence_nll(token_logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """−Σ_t mask_t · log p(y_t) for each sequence, [B]."""
    return -(token_logprobs_BT.double() * loss_mask_BT.double()).sum(dim=1)
