"""MoE routing balance: expert load, balance metrics, and two loss-free balancing rules.

Setting. A router scores every token i against every expert e, s_ie (Kimi Linear and
DeepSeek-V3: s = sigmoid(router logit)); each token goes to its top-k experts. Out of N tokens
and E experts the ideal is N·k/E assignments per expert. `expert_load` gives the fraction of
the N·k assignments each expert received (ideal: 1/E each); `load_balance_metrics` summarises
how far from that a batch is.

Loss-free balancing adds a per-expert bias b_e to the scores *for the choice only* (the
mixing weights stay the raw scores): token i picks top-k of s_ie + b_e. Two ways to set b:

1. Sign update (DeepSeek-V3 report, arXiv 2412.19437 §2.1.2, "auxiliary-loss-free load
   balancing" — public): after each step, b_e += γ·sign(mean load − load_e): overloaded experts
   are pushed down, underloaded ones up, by a fixed γ. It converges slowly (γ per step) and
   keeps oscillating by about γ. transformers' Kimi/DeepSeek routers hold this b as the buffer
   `e_score_correction_bias` (added to the sigmoid scores before top-k).

2. Quantile Balancing (QB). Public part (Su Jianlin, kexue.fm "MoE Travelogue" 6-8, archives
   11626 and 11760): drop the "exactly k per token" constraint and solve
       max Σ_ie x_ie s_ie   s.t.  Σ_i x_ie = N·k/E  for every expert e,   x_ie ∈ [0, 1].
   Its Lagrange dual has one multiplier β_e per expert and the optimum is x_ie = 1 iff
   s_ie > β_e: β_e is the (1 − k/E) quantile of expert e's scores over the batch, and each
   expert then gets exactly N·k/E tokens (tokens get k experts on average, not each).
   Because the batch's own quantile uses later tokens to route earlier ones (not causal), a
   β estimated on one batch is applied to the next (third-party summary:
   jonathanc.net/blog/causal-routing-bias.html).
   OUR READING (REFERENCE §8.5 marks the exact rule unverified; not checked against the
   original's code): (a) `quantile_balancing_bias` returns b_e = −β_e from the previous batch,
   used like DeepSeek's bias, i.e. top-k of s_ie − β_e; with top-k the balance is approximate,
   exact only for the threshold rule `threshold_route`. (b) No EMA or step size: each batch's
   β replaces the last. (c) The quantile is computed from a fixed-bin histogram, not a sort.

Histogram quantiles. Sorting N scores per expert costs O(N log N) and the sorted shards of
data-parallel ranks cannot be merged cheaply. A histogram of `num_bins` equal bins over
[lo_e, hi_e] per expert costs O(N) (one scatter-add), merges across ranks and micro-batches by
summing counts (given shared ranges), and the quantile read from its cumulative counts with
linear interpolation inside the bin is within one bin width (hi − lo)/num_bins of the exact
one. Shapes are suffixes: _N tokens, _K chosen experts, _E experts, _B bins.
"""

from __future__ import annotations

import math

import torch


def expert_load(router_indices_NK: torch.Tensor, num_experts: int, token_mask_N: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Fraction of the routed assignments each expert received, [E], summing to 1.

    `token_mask_N` (1 = real token) leaves padding out of the count."""
    indices = router_indices_NK if token_mask_N is None else router_indices_NK[token_mask_N.bool()]
    counts_E = torch.bincount(indices.reshape(-1).long(), minlength=num_experts)[:num_experts].double()
    return counts_E / counts_E.sum().clamp(min=1)


def load_balance_metrics(load_E: torch.Tensor) -> dict[str, float]:
    """How uneven a load is (1/E each is perfect).

    max_over_mean: max_e load_e / mean load (1 = balanced; DeepSeek's MaxVio is this − 1);
    cv: coefficient of variation std/mean (0 = balanced);
    entropy: −Σ p log p / log E of the load as a distribution (1 = balanced, 0 = one expert)."""
    load = load_E.double()
    mean = load.mean()
    p = load / load.sum().clamp(min=1e-12)
    entropy = -(p * p.clamp(min=1e-30).log()).sum() / math.log(load.numel()) if load.numel() > 1 else p.new_ones(())
    return {
        "load_max_over_mean": float(load.max() / mean),
        "load_cv": float(load.std(unbiased=False) / mean),
        "load_entropy": float(entropy),
    }


def route_top_k(scores_NE: torch.Tensor, k: int, bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """The k experts each token picks: top-k of score + bias (the bias only steers the choice)."""
    choice_NE = scores_NE if bias_E is None else scores_NE + bias_E
    return torch.topk(choice_NE, k, dim=-1).indices


def threshold_route(scores_NE: torch.Tensor, thresholds_E: torch.Tensor) -> torch.Tensor:
    """QB's dual solution as a routing rule: token i uses expert e iff s_ie > β_e, [N, E] bool.
    Tokens get a variable number of experts; each expert gets its quantile's share."""
    return scores_NE > thresholds_E


def sign_bias_update(bias_E: torch.Tensor, load_E: torch.Tensor, step_size: float) -> torch.Tensor:
    """DeepSeek-V3's loss-free update: b_e + γ·sign(mean load − load_e) (a new tensor)."""
    return bias_E + step_size * torch.sign(load_E.mean() - load_E).to(bias_E.dtype)


def exact_quantile_thresholds(scores_NE: torch.Tensor, k: int) -> torch.Tensor:
    """β_e = the exact (1 − k/E) quantile of expert e's scores (torch.quantile; sorts), [E]."""
    q = 1.0 - k / scores_NE.shape[-1]
    return torch.quantile(scores_NE.double(), q, dim=0).to(scores_NE.dtype)


def score_histogram(scores_NE: torch.Tensor, lo_E: torch.Tensor, hi_E: torch.Tensor, num_bins: int
                    ) -> torch.Tensor:
    """Counts of each expert's scores in `num_bins` equal bins over [lo_e, hi_e], [E, B].

    Scores outside the range land in the first/last bin. Summing the counts of several batches
    (or ranks) with the same ranges gives the histogram of their union."""
    N, E = scores_NE.shape
    width_E = ((hi_E - lo_E) / num_bins).clamp(min=1e-12)
    bins_NE = ((scores_NE - lo_E) / width_E).floor().long().clamp(0, num_bins - 1)
    flat_NE = bins_NE + torch.arange(E, device=scores_NE.device) * num_bins
    return torch.bincount(flat_NE.reshape(-1), minlength=E * num_bins).view(E, num_bins)


def histogram_quantile(counts_EB: torch.Tensor, lo_E: torch.Tensor, hi_E: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile of each expert's histogram, [E], within one bin width of the exact one.

    The value below which a fraction q of the mass lies: find the first bin whose cumulative
    count reaches r = q·total, then interpolate linearly inside it (scores assumed spread
    uniformly within a bin)."""
    counts = counts_EB.double()
    E, B = counts.shape
    cum_EB = counts.cumsum(-1)
    r_E1 = q * cum_EB[:, -1:]
    bin_E1 = torch.searchsorted(cum_EB.contiguous(), r_E1, side="left").clamp(max=B - 1)
    before_E1 = torch.where(bin_E1 > 0, cum_EB.gather(1, (bin_E1 - 1).clamp(min=0)), torch.zeros_like(r_E1))
    inside_E1 = counts.gather(1, bin_E1).clamp(min=1)
    position_E = (bin_E1 + ((r_E1 - before_E1) / inside_E1).clamp(0, 1)).squeeze(1)
    width_E = (hi_E.double() - lo_E.double()) / B
    return (lo_E.double() + position_E * width_E).to(lo_E.dtype)


def histogram_quantile_thresholds(scores_NE: torch.Tensor, k: int, num_bins: int = 256) -> torch.Tensor:
    """β_e ≈ the (1 − k/E) quantile of expert e's scores, from a histogram over the batch's own
    per-expert range [min, max] (no sort), [E]; error ≤ (max − min)/num_bins."""
    lo_E, hi_E = scores_NE.amin(dim=0), scores_NE.amax(dim=0)
    counts_EB = score_histogram(scores_NE, lo_E, hi_E, num_bins)
    return histogram_quantile(counts_EB, lo_E, hi_E, 1.0 - k / scores_NE.shape[-1])


def quantile_balancing_bias(scores_NE: torch.Tensor, k: int, num_bins: int = 256) -> torch.Tensor:
    """Quantile Balancing as an additive routing bias b_e = −β_e (our reading; module docstring).

    Estimate on one batch, apply to the next: top-k of s + b there (or `threshold_route` with
    β = −b). In transformers' Kimi/DeepSeek routers, b goes into `e_score_correction_bias`."""
    return -histogram_quantile_thresholds(scores_NE, k, num_bins)
