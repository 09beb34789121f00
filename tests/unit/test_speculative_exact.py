"""Speculative sampling preserves the student's distribution, exactly.

Every random step of a round (the K draft draws, the accept coins, the residual or bonus draw)
is replaced by a weighted branch, and every branch is enumerated on toy bigram / trigram target
and draft tables. The enumerator calls the same functions the engine calls
(k3post/algo/speculative.py: acceptance_probs, accept_count_probs, next_token_probs); only the
categorical draws of `verify_draft` become branches. The joint distribution of the first L
emitted tokens must equal the target's product of conditionals to 1e-12 (float64), and four
classic bugs must fail the same check.
"""

from __future__ import annotations

import itertools
from functools import lru_cache

import pytest
import torch

from k3post.algo.speculative import acceptance_probs, accept_count_probs, next_token_probs, verify_draft
from k3post.algo.token_draws import sampling_probs

L = 4  # emitted tokens compared
PROMPT = (0, 1)
TOL = 1e-12


class Table:
    """A toy n-gram model: probabilities of the next token given the last `order` tokens."""

    def __init__(self, vocab: int, order: int, make):
        self.vocab, self.order, self._make = vocab, order, make

    @lru_cache(maxsize=None)  # noqa: B019 (tables live for one test)
    def __call__(self, context: tuple[int, ...]) -> torch.Tensor:
        return self._make(context[-self.order:])


def table(vocab: int, order: int, seed: int, make_row) -> Table:
    """A table whose row for each context comes from make_row(generator, context)."""
    def make(ctx):
        g = torch.Generator().manual_seed(hash((seed, ctx)) % (2**31))
        return make_row(g, ctx)
    return Table(vocab, order, make)


def random_rows(vocab: int, spread: float = 1.5):
    return lambda g, ctx: torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * spread, 0)


def correct_rule(p_BK1V, q_BK1V, n_B):
    return next_token_probs(p_BK1V, q_BK1V[:, :-1], n_B)


def enumerate_emitted(p_of: Table, q_of: Table, K: int, rule=correct_rule, bonus: str = "emit"
                      ) -> dict[tuple[int, ...], float]:
    """P(first L emitted tokens) over every branch of every round. `bonus`: "emit" (the rule),
    "skip" (a round of K acceptances ends without a bonus) or "hidden" (the bug: the bonus is fed
    to the model but left out of the output)."""
    V = p_of.vocab
    drafts_BK = torch.tensor(list(itertools.product(range(V), repeat=K)), dtype=torch.long)
    states: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {(PROMPT, ()): 1.0}
    done: dict[tuple[int, ...], float] = {}
    for length in range(L):
        for (context, emitted), weight in [(s, w) for s, w in states.items() if len(s[1]) == length]:
            del states[(context, emitted)]
            expand_round(p_of, q_of, drafts_BK, context, emitted, weight, rule, bonus, states, done)
    assert not states
    return done


def expand_round(p_of, q_of, drafts_BK, context, emitted, weight, rule, bonus, states, done):
    B, K = drafts_BK.shape
    prefixes = [[context + tuple(d[:i].tolist()) for i in range(K + 1)] for d in drafts_BK]
    p_BK1V = torch.stack([torch.stack([p_of(c) for c in row]) for row in prefixes])
    q_BK1V = torch.stack([torch.stack([q_of(c) for c in row]) for row in prefixes])
    draft_weight_B = q_BK1V[:, :-1].gather(-1, drafts_BK[..., None]).squeeze(-1).prod(dim=1)
    counts_BK1 = accept_count_probs(acceptance_probs(p_BK1V[:, :-1], q_BK1V[:, :-1], drafts_BK))
    for n in range(K + 1):
        next_BV = rule(p_BK1V, q_BK1V, torch.full((B,), n, dtype=torch.long))
        for b in range(B):
            w = weight * float(draft_weight_B[b] * counts_BK1[b, n])
            if w == 0.0:
                continue
            accepted = tuple(drafts_BK[b, :n].tolist())
            if n == K and bonus == "skip":
                add(states, done, context + accepted, emitted + accepted, w)
                continue
            for y in range(next_BV.shape[1]):
                wy = w * float(next_BV[b, y])
                if wy == 0.0:
                    continue
                shown = emitted + accepted + (() if n == K and bonus == "hidden" else (y,))
                add(states, done, context + accepted + (y,), shown, wy)


def add(states, done, context, emitted, w):
    if len(emitted) >= L:
        key = emitted[:L]
        done[key] = done.get(key, 0.0) + w
    else:
        states[(context, emitted)] = states.get((context, emitted), 0.0) + w


def target_joint(p_of: Table) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(p_of.vocab), repeat=L):
        w, context = 1.0, PROMPT
        for tok in seq:
            w *= float(p_of(context)[tok])
            context += (tok,)
        joint[seq] = w
    return joint


def max_error(p_of: Table, q_of: Table, K: int, expected_of: Table | None = None, **kw) -> float:
    got = enumerate_emitted(p_of, q_of, K, **kw)
    expected = target_joint(expected_of or p_of)
    assert set(got) <= set(expected)
    return max(abs(got.get(s, 0.0) - e) for s, e in expected.items())


# ---- the cases: (target table, draft table) factories over (vocab, order) ----

def supports(vocab: int, keep):
    """Rows that are random but zero outside keep(ctx) (a list of allowed ids)."""
    def row(g, ctx):
        r = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64), 0)
        mask = torch.zeros(vocab, dtype=torch.float64)
        mask[keep(ctx)] = 1.0
        return r * mask / (r * mask).sum()
    return row


def one_hot(vocab: int):
    return lambda g, ctx: torch.nn.functional.one_hot(torch.randint(vocab, (), generator=g), vocab).double()


def processed(vocab: int, temperature: float, top_p: float):
    """softmax(top_p(logits / T)) of random logits: the sampler's own processing (token_draws.py)."""
    return lambda g, ctx: sampling_probs(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, temperature, top_p)


CASES = {
    "p equals q": (3, lambda V, o: (table(V, o, 1, random_rows(V)), table(V, o, 1, random_rows(V)))),
    "random p and q": (4, lambda V, o: (table(V, o, 1, random_rows(V)), table(V, o, 2, random_rows(V)))),
    "one-hot q": (3, lambda V, o: (table(V, o, 1, random_rows(V)), table(V, o, 2, one_hot(V)))),
    "q zero where p positive": (4, lambda V, o: (table(V, o, 1, random_rows(V)),
                                                table(V, o, 2, supports(V, lambda c: [sum(c) % V, (sum(c) + 1) % V])))),
    "p zero where q positive": (4, lambda V, o: (table(V, o, 1, supports(V, lambda c: [sum(c) % V, (sum(c) + 2) % V])),
                                                table(V, o, 2, random_rows(V)))),
    "disjoint supports": (4, lambda V, o: (table(V, o, 1, supports(V, lambda c: [0, 1])),
                                          table(V, o, 2, supports(V, lambda c: [2, 3])))),
    "temperature and top-p on p": (5, lambda V, o: (table(V, o, 1, processed(V, 0.7, 0.8)),
                                                    table(V, o, 2, processed(V, 1.3, 1.0)))),
}


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target_exactly(case, order, K):
    vocab, make = CASES[case]
    p_of, q_of = make(vocab, order)
    if case == "temperature and top-p on p":  # top-p really truncated some rows
        assert any((p_of(c) == 0).any() for c in itertools.product(range(vocab), repeat=order))
    assert max_error(p_of, q_of, K) < TOL


def test_a_round_without_a_bonus_is_still_exact_only_slower():
    p_of, q_of = CASES["random p and q"][1](3, 2)
    assert max_error(p_of, q_of, 2, bonus="skip") < TOL


# ---- negative controls: each classic bug must fail the same check ----

def resample_from_p(p_BK1V, q_BK1V, n_B):
    return p_BK1V[torch.arange(len(n_B)), n_B]


def bonus_from_q(p_BK1V, q_BK1V, n_B):
    K = q_BK1V.shape[1] - 1
    right = correct_rule(p_BK1V, q_BK1V, n_B)
    return torch.where((n_B == K)[:, None], q_BK1V[:, K], right)


def test_resampling_from_p_instead_of_the_residual_is_biased_by_the_textbook_amount():
    p_of = Table(2, 1, lambda c: torch.tensor([0.5, 0.5], dtype=torch.float64))
    q_of = Table(2, 1, lambda c: torch.tensor([0.9, 0.1], dtype=torch.float64))
    drafts_BK = torch.tensor([[0], [1]])
    for rule, expected in ((correct_rule, [0.5, 0.5]), (resample_from_p, [0.7, 0.3])):
        states, done = {}, {}
        expand_round(p_of, q_of, drafts_BK, PROMPT, (), 1.0, rule, "emit", states, done)
        first = [sum(w for (c, e), w in states.items() if e[0] == v) for v in (0, 1)]
        assert first == pytest.approx(expected, abs=TOL)
    p_of, q_of = CASES["random p and q"][1](3, 2)
    assert max_error(p_of, q_of, 2, rule=resample_from_p) > 1e-3


@pytest.mark.parametrize("K", [1, 3])
def test_a_dropped_bonus_token_fails(K):
    p_of, q_of = CASES["random p and q"][1](3, 2)
    assert max_error(p_of, q_of, K, bonus="hidden") > 1e-3


def test_a_bonus_drawn_from_q_fails():
    p_of, q_of = CASES["random p and q"][1](3, 2)
    assert max_error(p_of, q_of, 2, rule=bonus_from_q) > 1e-3


def test_p_taken_before_top_p_fails():
    """Verifying with softmax(logits / T) while the plain sampler draws from its top-p truncation."""
    raw_of = table(4, 1, 1, processed(4, 0.7, 1.0))
    p_of = table(4, 1, 1, processed(4, 0.7, 0.8))
    q_of = table(4, 1, 2, processed(4, 1.3, 1.0))
    assert max_error(p_of, q_of, 2) < TOL
    assert max_error(raw_of, q_of, 2, expected_of=p_of) > 1e-3


# ---- the engine's random draws follow the enumerated branch weights ----

def test_verify_draft_draws_follow_the_branch_weights():
    torch.manual_seed(0)
    B, K, V = 200_000, 2, 3
    p_K1V = torch.softmax(torch.randn(K + 1, V) * 1.5, -1)
    q_KV = torch.softmax(torch.randn(K, V) * 1.5, -1)
    draft = torch.tensor([[1, 0]])
    n_B, y_B = verify_draft(p_K1V.expand(B, -1, -1), q_KV.expand(B, -1, -1), draft.expand(B, -1))
    counts = accept_count_probs(acceptance_probs(p_K1V[None, :K], q_KV[None], draft))[0]
    for n in range(K + 1):
        nxt = next_token_probs(p_K1V[None], q_KV[None], torch.tensor([n]))[0]
        for y in range(V):
            empirical = float(((n_B == n) & (y_B == y)).float().mean())
            assert empirical == pytest.approx(float(counts[n] * nxt[y]), abs=4e-3)
