"""The distribution a rollout token is drawn from, and a draw from it without a host sync.

Sampling semantics everywhere in k3post (model/generation/sampling.py): a token is drawn from
softmax(top_p(logits / temperature)) and nothing else (no model processors). `top_p_filter` is the
top-p rule transformers' `TopPLogitsWarper` applies (the same kept set, computed from the top down),
so the static-cache engine and the speculative verifier draw from exactly what `generate` draws from.
"""

from __future__ import annotations

import torch


def top_p_filter(scores_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf outside the smallest set of top tokens whose probability reaches top_p.

    A token is kept when the mass of the tokens ranked strictly above it is still below top_p,
    so the top token is always kept."""
    if top_p >= 1.0:
        return scores_BV
    sorted_BV, order_BV = torch.sort(scores_BV, dim=-1, descending=True)
    mass_before_BV = sorted_BV.softmax(dim=-1).cumsum(dim=-1) - sorted_BV.softmax(dim=-1)
    drop_sorted_BV = mass_before_BV >= top_p
    drop_BV = drop_sorted_BV.scatter(-1, order_BV, drop_sorted_BV)
    return scores_BV.masked_fill(drop_BV, float("-inf"))


def sampling_probs(logits_V: torch.Tensor, temperature: float, top_p: float, greedy: bool = False) -> torch.Tensor:
    """What a token is drawn from: softmax(top_p(logits / T)) over the last axis, or, greedy
    (the T → 0 limit), one-hot on the argmax (the first of tied maxima, as torch.argmax)."""
    scores_V = logits_V.float() / temperature if logits_V.dtype != torch.float64 else logits_V / temperature
    if greedy:
        return torch.nn.functional.one_hot(scores_V.argmax(dim=-1), scores_V.shape[-1]).to(scores_V.dtype)
    return torch.softmax(top_p_filter(scores_V, top_p), dim=-1)


def draw_exponential_race(probs_BV: torch.Tensor) -> torch.Tensor:
    """One categorical draw per row without a host sync: argmax_i p_i / E_i with E_i ~ Exp(1).

    P(i wins) = p_i: the race's winner is the first of independent exponential clocks of rates
    p_i. Zero-probability tokens never win (0 / E = 0 < any positive entry)."""
    race_BV = torch.empty_like(probs_BV).exponential_()
    return torch.argmax(probs_BV / race_BV, dim=-1)


def draw(probs_BV: torch.Tensor) -> torch.Tensor:
    """One categorical draw per row: `torch.multinomial` on a CPU (what `generate` draws, so
    a seeded run repeats it), the exponential race elsewhere (no host sync)."""
    if probs_BV.device.type == "cpu":
        return torch.multinomial(probs_BV, num_samples=1).squeeze(1)
    return draw_exponential_race(probs_BV)
