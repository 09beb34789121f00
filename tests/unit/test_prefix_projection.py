"""The prefix projection of a teacher's next-token distribution onto the student's vocabulary
(`cross_tokenizer.dense_support: prefix`; algo/cross_tokenizer.py): each teacher token's mass on
the student token that is the longest byte prefix of it."""

from __future__ import annotations

import math
import random

import pytest
import torch

from k3post.algo.cross_tokenizer import (mapped_topk, prefix_pieces, projected_topk, projected_topk_of_topk,
                                         vocabulary_map)
from k3post.algo.topk import repeated_slots

# student ids:  0 "a"   1 "b"   2 " v"   3 "ac"   4 " va"
STUDENT = [b"a", b"b", b" v", b"ac", b" va"]
# teacher ids:  0 " vaccine"  1 "a"  2 "ab"  3 " v"  4 (special: no bytes)  5 "xy" (no student prefix)
TEACHER = [b" vaccine", b"a", b"ab", b" v", b"", b"xy"]


def test_the_pieces_by_hand():
    assert prefix_pieces(STUDENT, TEACHER).tolist() == [4, 0, 0, 2, -1, -1]


@pytest.mark.parametrize("seed", range(5))
def test_the_pieces_against_brute_force(seed):
    rng = random.Random(seed)
    word = lambda n: bytes(rng.choice(b"abc ") for _ in range(rng.randint(1, n)))  # noqa: E731
    student = [word(3) for _ in range(30)] + [b""]
    teacher = [word(6) for _ in range(60)] + [b""]
    got = prefix_pieces(student, teacher).tolist()
    for u, piece in enumerate(teacher):
        prefixes = [(len(s), -i) for i, s in enumerate(student) if s and piece.startswith(s)]
        assert got[u] == (-max(prefixes)[1] if prefixes else -1), (piece, got[u])


def test_the_projection_by_hand():
    """p_T = 0.4, 0.1, 0.2, 0.1, 0.05, 0.15 on the teacher ids above: q_T(" va") = 0.4 (" vaccine"),
    q_T("a") = 0.1 + 0.2 ("a", "ab"), q_T(" v") = 0.1; the special token and "xy" (0.2) go to the
    tail. k = 2 sends " va", "a" and a tail of 0.1 + 0.2; k = 4 sends the three with mass and an
    empty bin."""
    full_BUV = torch.tensor([0.4, 0.1, 0.2, 0.1, 0.05, 0.15]).log()[None, None]
    pieces = prefix_pieces(STUDENT, TEACHER)
    two = projected_topk(full_BUV, torch.tensor([[0]]), pieces, len(STUDENT), 2)
    assert two.student_ids_BTK.tolist() == [[[4, 0]]] and two.signal_BT.tolist() == [[True]]
    assert two.logprobs_BTK.exp()[0, 0].tolist() == pytest.approx([0.4, 0.3])
    assert two.tail_logprobs_BT.exp().item() == pytest.approx(0.3)
    assert two.mapped_mass_BT.item() == pytest.approx(0.8)
    four = projected_topk(full_BUV, torch.tensor([[0]]), pieces, len(STUDENT), 4)
    assert four.student_ids_BTK.tolist() == [[[4, 0, 2, 4]]]
    assert repeated_slots(four.student_ids_BTK).tolist() == [[[False, False, False, True]]]
    assert four.logprobs_BTK.exp()[0, 0].tolist() == pytest.approx([0.4, 0.3, 0.1, 0.0])
    assert four.tail_logprobs_BT.exp().item() == pytest.approx(0.2)


def random_case(seed: int, B: int = 2, U: int = 5, T: int = 6):
    rng = random.Random(seed)
    word = lambda n: bytes(rng.choice(b"ab ") for _ in range(rng.randint(1, n)))  # noqa: E731
    student = sorted({word(2) for _ in range(12)})
    teacher = [word(4) for _ in range(20)] + [b""]
    gen = torch.Generator().manual_seed(seed)
    full_BUV = (3 * torch.randn(B, U, len(teacher), generator=gen)).log_softmax(-1)
    u_of_t_BT = torch.randint(-1, U, (B, T), generator=gen)
    return student, teacher, full_BUV, u_of_t_BT


@pytest.mark.parametrize("seed", range(4))
def test_the_projection_against_brute_force(seed):
    """Every sent value is the sum of the teacher's probabilities over the tokens whose longest
    student prefix is that id; the ids are the k largest; bins and tail hold the whole mass."""
    student, teacher, full_BUV, u_of_t_BT = random_case(seed)
    pieces = prefix_pieces(student, teacher)
    got = projected_topk(full_BUV, u_of_t_BT, pieces, len(student), 3)
    for b, t in zip(*torch.nonzero(got.signal_BT, as_tuple=True)):
        p = full_BUV[b, u_of_t_BT[b, t]].exp()
        q = [float(p[pieces == s].sum()) for s in range(len(student))]
        want = sorted(range(len(student)), key=lambda s: -q[s])[:3]
        assert sorted(q[s] for s in got.student_ids_BTK[b, t].tolist()) == pytest.approx(sorted(q[s] for s in want))
        assert got.logprobs_BTK[b, t].exp().tolist() == pytest.approx([q[s] for s in got.student_ids_BTK[b, t]])
        total = got.logprobs_BTK[b, t].exp().sum() + got.tail_logprobs_BT[b, t].exp()
        assert float(total) == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(got.signal_BT, u_of_t_BT >= 0)


@pytest.mark.parametrize("seed", range(4))
def test_from_the_whole_top_k_it_is_the_full_distributions_projection(seed):
    """An engine that returns its top-K (vLLM) with K the whole vocabulary sends what the HF path does."""
    student, teacher, full_BUV, u_of_t_BT = random_case(seed)
    pieces = prefix_pieces(student, teacher)
    want = projected_topk(full_BUV, u_of_t_BT, pieces, len(student), 3)
    values_BUK, ids_BUK = full_BUV.topk(full_BUV.shape[-1], dim=-1)
    got = projected_topk_of_topk(ids_BUK, values_BUK, u_of_t_BT, pieces, 3)
    signal = want.signal_BT
    assert torch.equal(got.signal_BT, signal) and signal.any()
    torch.testing.assert_close(got.logprobs_BTK[signal], want.logprobs_BTK[signal], rtol=0, atol=1e-6)
    # ties in the sent mass may order ids differently; the masses must agree id by id
    for b, t in zip(*torch.nonzero(signal, as_tuple=True)):
        assert dict(zip(got.student_ids_BTK[b, t].tolist(), got.logprobs_BTK[b, t].tolist())) == pytest.approx(
            dict(zip(want.student_ids_BTK[b, t].tolist(), want.logprobs_BTK[b, t].tolist())))
    torch.testing.assert_close(got.tail_logprobs_BT[signal].exp(), want.tail_logprobs_BT[signal].exp(), rtol=0,
                               atol=1e-6)


def test_with_one_vocabulary_it_is_the_exact_map():
    """Every token is its own longest prefix: the projection is the teacher's distribution itself,
    as the exact map gives it."""
    vocab = [b"a", b"b", b"ab", b" a", b" ab", b"ba"]
    gen = torch.Generator().manual_seed(0)
    full_BUV = torch.randn(2, 4, len(vocab), generator=gen).log_softmax(-1)
    u_of_t_BT = torch.tensor([[0, 1, -1, 3], [2, -1, 0, 1]])
    want = mapped_topk(full_BUV, u_of_t_BT, *vocabulary_map(vocab, vocab), 3)
    got = projected_topk(full_BUV, u_of_t_BT, prefix_pieces(vocab, vocab), len(vocab), 3)
    assert torch.equal(got.student_ids_BTK, want.student_ids_BTK) and torch.equal(got.signal_BT, want.signal_BT)
    torch.testing.assert_close(got.logprobs_BTK, want.logprobs_BTK, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.tail_logprobs_BT.exp(), want.tail_logprobs_BT.exp(), rtol=0, atol=1e-6)
    assert got.mapped_mass_BT.flatten().tolist() == pytest.approx([1.0] * 8)
    assert math.isfinite(float(got.tail_logprobs_BT.min()))


def test_added_tokens_map_only_to_the_same_added_token():
    """"<|im_end|>" is a marker: it must not lend its mass to the student's "<" (an ordinary token)."""
    student = [b"<", b"<|im_end|>", b"a"]
    teacher = [b"<|im_end|>", b"<|x|>", b"<a", b"ab"]
    pieces = prefix_pieces(student, teacher, student_added={1}, teacher_added={0, 1})
    assert pieces.tolist() == [1, -1, 0, 2]
    # an ordinary teacher token never maps onto an added student token
    assert prefix_pieces([b"<|im_end|>"], [b"<|im_end|>x"], student_added={0}).tolist() == [-1]
