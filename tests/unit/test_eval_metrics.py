"""Evaluation maths against brute force and closed forms: pass@k, Wilson, bootstrap, exact KL."""

from __future__ import annotations

import math
from itertools import combinations

import pytest
import torch

from k3post.algo.eval_metrics import bootstrap_paired_difference, bootstrap_ratio, pass_at_k, rate_estimate
from k3post.algo.eval_metrics import sequence_kl, sequence_nll
from k3post.algo.eval_metrics import wilson_interval, z_value


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of all k-subsets of the n samples (c of them correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumeration_over_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_not_the_biased_plug_in():
    # n=4, c=1, k=2: half of the 6 pairs contain the correct sample; 1-(1-c/n)^k = 0.4375 is biased.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the plain success rate
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_wilson_closed_forms():
    z = z_value(0.95)
    assert z == pytest.approx(1.959964, abs=1e-6)
    zero = wilson_interval(0, 10)  # p̂ = 0: the interval is [0, z²/(m + z²)]
    assert zero.low == pytest.approx(0, abs=1e-12) and zero.high == pytest.approx(z * z / (10 + z * z))
    full = wilson_interval(10, 10)
    assert full.high == pytest.approx(1.0) and full.low == pytest.approx(10 / (10 + z * z))
    a, b = wilson_interval(3, 20), wilson_interval(17, 20)  # mirror symmetry s ↔ m − s
    assert a.low == pytest.approx(1 - b.high) and a.high == pytest.approx(1 - b.low)
    assert a.low < a.value == 0.15 < a.high


def test_wilson_covers_the_true_rate_about_95_percent_of_the_time():
    generator = torch.Generator().manual_seed(0)
    p, m, trials = 0.3, 40, 2000
    draws = torch.binomial(torch.full((trials,), float(m)), torch.full((trials,), p), generator=generator)
    covered = sum(wilson_interval(float(s), m).low <= p <= wilson_interval(float(s), m).high for s in draws)
    assert 0.93 <= covered / trials <= 0.985


def test_rate_estimate_treats_prompts_as_the_unit():
    estimate = rate_estimate([1.0, 0.5, 0.0, 0.5])
    assert estimate.value == pytest.approx(0.5)
    assert estimate.method == "wilson" and (estimate.low, estimate.high) == pytest.approx(
        (wilson_interval(2.0, 4).low, wilson_interval(2.0, 4).high))


def test_bootstrap_ratio_point_width_and_determinism():
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(400, generator=generator, dtype=torch.float64) * 2.0 + 5.0
    estimate = bootstrap_ratio(values, torch.ones(400))
    assert estimate.value == pytest.approx(float(values.mean()))
    # The bootstrap interval of a mean approaches ±1.96·s/sqrt(n).
    half = 1.959964 * float(values.std()) / math.sqrt(400)
    assert (estimate.high - estimate.low) / 2 == pytest.approx(half, rel=0.15)
    assert bootstrap_ratio(values, torch.ones(400)) == estimate  # seeded: the same interval every time
    flat = bootstrap_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])  # every unit has ratio 2
    assert (flat.value, flat.low, flat.high) == pytest.approx((2.0, 2.0, 2.0))
    single = bootstrap_ratio([3.0], [2.0])
    assert (single.value, single.low, single.high) == (1.5, 1.5, 1.5)


def test_bootstrap_ratio_weights_units_by_their_tokens():
    # Token-mean, not mean of sequence means: (1 + 9) / (1 + 3) = 2.5, while the means average to 2.
    assert bootstrap_ratio([1.0, 9.0], [1.0, 3.0]).value == pytest.approx(2.5)


def boosted(V: int, a: float) -> torch.Tensor:
    """log q for q ∝ (e^a, 1, ..., 1) over V tokens."""
    logits = torch.zeros(V, dtype=torch.float64)
    logits[0] = a
    return torch.log_softmax(logits, dim=-1)


def test_sequence_kl_matches_closed_forms():
    V, a = 7, 2.0
    uniform = torch.full((V,), -math.log(V), dtype=torch.float64)
    q = boosted(V, a)
    Z = math.exp(a) + V - 1
    kl_u_q = -math.log(V) + math.log(Z) - a / V  # KL(uniform ‖ q) = −log V + log Z − a/V
    # KL(q ‖ uniform) = log V − H(q)
    kl_q_u = math.log(V) + (math.exp(a) / Z) * (a - math.log(Z)) + ((V - 1) / Z) * (-math.log(Z))
    # Bernoulli(x) vs Bernoulli(y) on a 2-token vocabulary
    x, y = 0.2, 0.7
    bern = x * math.log(x / y) + (1 - x) * math.log((1 - x) / (1 - y))
    p_BTV = torch.stack([uniform, q, uniform])[None].expand(2, 3, V).clone()
    r_BTV = torch.stack([q, uniform, q])[None].expand(2, 3, V).clone()
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    got = sequence_kl(p_BTV, r_BTV, mask_BT)
    assert got.tolist() == pytest.approx([kl_u_q + kl_q_u, kl_q_u + kl_u_q], rel=1e-5)
    two = sequence_kl(torch.tensor([[[math.log(x), math.log(1 - x)]]]), torch.tensor([[[math.log(y), math.log(1 - y)]]]),
                      torch.ones(1, 1))
    assert float(two) == pytest.approx(bern, rel=1e-5)
    assert float(sequence_kl(p_BTV, p_BTV, mask_BT).abs().max()) < 1e-6  # KL(p‖p) = 0


def test_sequence_nll_sums_masked_token_logprobs():
    logprobs = torch.tensor([[-1.0, -2.0, -5.0], [-0.5, -0.5, -0.5]])
    assert sequence_nll(logprobs, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])).tolist() == [3.0, 1.5]


def exact_paired_bootstrap(base: tuple, other: tuple) -> list[float]:
    """Every one of the n^n equally likely paired resamples, enumerated: Δ of each."""
    from itertools import product

    (a, t), (b, u) = base, other
    out = []
    for index in product(range(len(a)), repeat=len(a)):
        out.append(sum(b[i] for i in index) / sum(u[i] for i in index) - sum(a[i] for i in index)
                   / sum(t[i] for i in index))
    return sorted(out)


def test_paired_difference_matches_the_enumerated_bootstrap():
    base = ([3.0, 1.0, 4.0, 1.5, 5.0], [2.0, 1.0, 3.0, 1.0, 4.0])
    other = ([2.5, 1.2, 3.0, 2.0, 4.5], [2.0, 1.0, 3.0, 1.0, 4.0])
    d = bootstrap_paired_difference(base, other, confidence=0.9, resamples=40_000)
    assert d.value == pytest.approx(sum(other[0]) / 11 - sum(base[0]) / 11, abs=1e-12)
    exact = exact_paired_bootstrap(base, other)  # 3125 resamples
    q = lambda p: exact[round(p * (len(exact) - 1))]  # noqa: E731
    assert d.low == pytest.approx(q(0.05), abs=0.01) and d.high == pytest.approx(q(0.95), abs=0.01)


def test_pairing_cancels_the_spread_the_two_sides_share():
    """Units that differ wildly but where `other` is `base` + 0.1 throughout: the paired interval
    is the point 0.1; the two separate intervals overlap almost entirely."""
    g = torch.Generator().manual_seed(0)
    base = (torch.rand(40, generator=g) * 10).tolist()
    ones = [1.0] * 40
    d = bootstrap_paired_difference((base, ones), ([x + 0.1 for x in base], ones))
    assert (d.value, d.low, d.high) == pytest.approx((0.1, 0.1, 0.1), abs=1e-9)
    separate = bootstrap_ratio(base, ones)
    assert separate.high - separate.low > 1.0  # unpaired, the 0.1 would be lost in this


def test_paired_difference_needs_the_same_units():
    with pytest.raises(ValueError, match="same non-empty units"):
        bootstrap_paired_difference(([1.0, 2.0], [1.0, 1.0]), ([1.0], [1.0]))
