"""MoE balance maths: load and metrics, histogram quantiles, Quantile Balancing, the sign update."""

from __future__ import annotations

import math

import pytest
import torch

from k3post.algo.moe import (
    exact_quantile_thresholds,
    expert_load,
    histogram_quantile,
    histogram_quantile_thresholds,
    load_balance_metrics,
    quantile_balancing_bias,
    route_top_k,
    score_histogram,
    sign_bias_update,
    threshold_route,
)

E, K = 8, 2


def skewed_scores(n: int, seed: int) -> torch.Tensor:
    """A toy router with opinions: expert e's logits are shifted by an offset from −2 to +2 and
    scaled differently, so plain top-k sends most tokens to the last experts."""
    g = torch.Generator().manual_seed(seed)
    offset_E = torch.linspace(-2.0, 2.0, E)
    scale_E = torch.linspace(0.7, 1.3, E)
    return torch.sigmoid(torch.randn(n, E, generator=g) * scale_E + offset_E)


def test_expert_load_counts_assignments_and_skips_padding():
    idx = torch.tensor([[0, 1], [0, 2], [3, 3]])
    assert expert_load(idx, 4).tolist() == [2 / 6, 1 / 6, 1 / 6, 2 / 6]
    assert expert_load(idx, 4, token_mask_N=torch.tensor([1, 1, 0])).tolist() == [0.5, 0.25, 0.25, 0.0]


def test_balance_metrics_at_the_extremes():
    uniform = load_balance_metrics(torch.full((E,), 1 / E))
    assert uniform == pytest.approx({"load_max_over_mean": 1.0, "load_cv": 0.0, "load_entropy": 1.0}, abs=1e-9)
    one_hot = load_balance_metrics(torch.eye(E)[0])
    assert one_hot == pytest.approx({"load_max_over_mean": E, "load_cv": math.sqrt(E - 1), "load_entropy": 0.0},
                                    abs=1e-9)


@pytest.mark.parametrize("q", [0.05, 0.5, 0.75, 0.97])
def test_histogram_quantile_is_within_one_bin_of_torch_quantile(q):
    g = torch.Generator().manual_seed(1)
    scores = torch.cat([torch.randn(5000, 3, generator=g), torch.rand(5000, 3, generator=g) ** 4], dim=1)
    lo, hi = scores.amin(0), scores.amax(0)
    for bins in (16, 256):
        approx = histogram_quantile(score_histogram(scores, lo, hi, bins), lo, hi, q)
        exact = torch.quantile(scores.double(), q, dim=0).float()
        assert ((approx - exact).abs() <= (hi - lo) / bins + 1e-6).all(), (bins, approx, exact)
    # With 256 bins it is far closer than the bound on these smooth distributions.
    assert ((approx - exact).abs() <= (hi - lo) / 256 / 4).all()


def test_histograms_merge_by_adding_counts():
    a, b = skewed_scores(300, 1), skewed_scores(500, 2)
    lo, hi = torch.zeros(E), torch.ones(E)  # sigmoid scores: a fixed range every rank shares
    merged = score_histogram(a, lo, hi, 64) + score_histogram(b, lo, hi, 64)
    assert torch.equal(merged, score_histogram(torch.cat([a, b]), lo, hi, 64))
    assert int(merged.sum()) == 800 * E


def test_threshold_rule_gives_each_expert_its_quantile_share():
    """The QB dual solution on its own batch: s > β_e selects N·k/E tokens per expert."""
    scores = skewed_scores(8000, 3)
    target = scores.shape[0] * K / E
    exact = threshold_route(scores, exact_quantile_thresholds(scores, K)).sum(0).float()
    assert (exact - target).abs().max() <= 1
    approx = threshold_route(scores, histogram_quantile_thresholds(scores, K, num_bins=256)).sum(0).float()
    assert (approx - target).abs().max() <= 0.02 * target


def test_quantile_bias_from_one_batch_balances_the_next():
    """Biases estimated on batch t, applied on batch t+1 (causal). The threshold rule (QB's own
    dual solution) is balanced up to sampling noise; top-k of s − β, our reading for fixed-k
    routers, is approximately balanced (exact only when the experts' scores differ by a shift)."""
    previous, current = skewed_scores(8192, 4), skewed_scores(8192, 5)
    plain = load_balance_metrics(expert_load(route_top_k(current, K), E))
    bias = quantile_balancing_bias(previous, K, num_bins=256)
    top_k = load_balance_metrics(expert_load(route_top_k(current, K, bias), E))
    chosen_NE = threshold_route(current, -bias)
    threshold = load_balance_metrics(chosen_NE.sum(0).double())
    assert plain["load_max_over_mean"] > 2.5  # the toy router is badly skewed
    assert threshold["load_max_over_mean"] < 1.1 and top_k["load_max_over_mean"] < 1.3
    assert top_k["load_cv"] < 0.15 * plain["load_cv"] and threshold["load_cv"] < 0.05 * plain["load_cv"]
    assert top_k["load_entropy"] > 0.99 > plain["load_entropy"]
    assert float(chosen_NE.sum(1).float().mean()) == pytest.approx(K, rel=0.03)  # k per token on average


def test_sign_update_moves_load_toward_uniform():
    """DeepSeek-V3's b += γ·sign(mean − load): slower than QB, but it gets there."""
    bias = torch.zeros(E)
    history = []
    for step in range(300):
        scores = skewed_scores(2048, 100 + step)
        load = expert_load(route_top_k(scores, K, bias), E)
        history.append(load_balance_metrics(load)["load_max_over_mean"])
        bias = sign_bias_update(bias, load, step_size=0.01)
    assert history[0] > 2.5
    assert max(history[-20:]) < 1.25
    assert sum(history[100:120]) < sum(history[:20])  # it moved, not just ended lucky
    # Underloaded experts (small offsets) were pushed up, overloaded ones down.
    assert bias[0] > 0 > bias[-1]
