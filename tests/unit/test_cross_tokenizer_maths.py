"""The cross-tokenizer maths (k3post/algo/cross_tokenizer.py): chunks by brute force, projections by
hand, every split mode's per-chunk sums."""

from __future__ import annotations

import random
from itertools import accumulate

import pytest
import torch

from k3post.algo.cross_tokenizer import (Alignment, align_chunks, alignment_counts, alignment_metrics, chunk_tensors,
                                         closable, mapped_topk, one_to_one_positions, project_teacher_logprobs,
                                         vocabulary_map)


def project(student_lp, teacher_lp, s_chunks, t_chunks, split, max_chunk=8):
    s_BT = torch.tensor([s_chunks])
    t_BU = torch.tensor([t_chunks])
    return project_teacher_logprobs(torch.tensor([student_lp]), torch.tensor([teacher_lp]), s_BT, t_BU, split,
                                    max_chunk)


def test_abcd_against_ab_cd_by_hand():
    """Student [a, b, c, d], teacher [ab, cd] with teacher logprobs −2, −3."""
    alignment = align_chunks([1, 2, 3, 4], [2, 4])
    assert alignment == Alignment((0, 0, 1, 1), (0, 1), 2)
    mu = [-0.5, -0.7, -0.2, -0.9]
    uniform = project(mu, [-2.0, -3.0], alignment.student_chunks, alignment.teacher_chunks, "uniform")
    assert uniform.teacher_logprobs_BT.tolist() == [[-1.0, -1.0, -1.5, -1.5]]
    broadcast = project(mu, [-2.0, -3.0], alignment.student_chunks, alignment.teacher_chunks, "broadcast")
    k = (torch.tensor(mu) - broadcast.teacher_logprobs_BT[0]).tolist()
    assert k == pytest.approx([-1.2 + 2, -1.2 + 2, -1.1 + 3, -1.1 + 3])  # L_S − L_T on every token of its chunk
    one = project(mu, [-2.0, -3.0], alignment.student_chunks, alignment.teacher_chunks, "one_to_one")
    assert one.teacher_logprobs_BT[0].tolist() == pytest.approx(mu)  # no 1:1 chunk: k = 0 everywhere
    assert not one.signal_BT.any()


def random_partition(rng: random.Random, length: int) -> list[int]:
    """Byte end offsets of a random tokenization of `length` bytes."""
    cuts = sorted(rng.sample(range(1, length), rng.randint(0, length - 1)))
    return cuts + [length]


@pytest.mark.parametrize("seed", range(30))
def test_chunks_are_the_common_boundaries_and_partition_both_sides(seed):
    rng = random.Random(seed)
    length = rng.randint(1, 30)
    s_ends, t_ends = random_partition(rng, length), random_partition(rng, length)
    a = align_chunks(s_ends, t_ends)
    common = sorted(set(s_ends) & set(t_ends))  # brute force: a chunk ends at every shared boundary
    assert a.num_chunks == len(common)
    for side_ends, chunks in ((s_ends, a.student_chunks), (t_ends, a.teacher_chunks)):
        assert list(chunks) == sorted(chunks) and min(chunks) == 0  # contiguous, in order, all covered
        for c, end in enumerate(common):  # each chunk's span ends at its common boundary on both sides
            assert max(e for e, k in zip(side_ends, chunks) if k == c) == end


def test_a_teacher_boundary_inside_a_character_cannot_close():
    """Byte-level pieces of one 4-byte emoji both carry the character's offsets (0, 4)."""
    starts, ends = [0, 0, 4], [4, 4, 5]
    a = align_chunks([3, 4, 5], ends, closable(starts, ends))
    assert a == Alignment((0, 0, 1), (0, 0, 1), 2)


def test_leftover_tokens_after_a_truncated_side_belong_to_no_chunk():
    a = align_chunks([2, 4, 6], [2, 3])
    assert a == Alignment((0, -1, -1), (0, -1), 1)


@pytest.mark.parametrize("seed", range(10))
def test_every_split_keeps_its_chunk_sum_and_unaligned_tokens_get_zero(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    s_ends, t_ends = random_partition(rng, 20), random_partition(rng, 20)
    a = align_chunks(s_ends, t_ends + [21])  # one teacher token past the student's text: unaligned
    s_BT, t_BU = chunk_tensors([a], len(s_ends) + 2, len(t_ends) + 1)  # two pads on the student side
    mu_BT = -torch.rand(1, s_BT.shape[1], generator=gen, dtype=torch.float64)
    teacher_BU = -torch.rand(1, t_BU.shape[1], generator=gen, dtype=torch.float64)
    for split in ("uniform", "broadcast", "one_to_one"):
        p = project_teacher_logprobs(mu_BT, teacher_BU, s_BT, t_BU, split, 100)
        k_T = (mu_BT - p.teacher_logprobs_BT)[0]
        assert k_T[s_BT[0] < 0].abs().max() == 0  # pads: k = 0
        for c in range(a.num_chunks):
            on_s, on_t = s_BT[0] == c, t_BU[0] == c
            l_s, l_t = mu_BT[0][on_s].sum(), teacher_BU[0][on_t].sum()
            if split == "uniform" or (split == "one_to_one" and on_s.sum() == 1 and on_t.sum() == 1):
                assert k_T[on_s].sum() == pytest.approx(float(l_s - l_t), abs=1e-12)
            elif split == "broadcast":
                assert k_T[on_s].tolist() == pytest.approx([float(l_s - l_t)] * int(on_s.sum()), abs=1e-12)
            else:
                assert k_T[on_s].abs().max() == 0


def test_chunks_longer_than_the_limit_carry_no_signal():
    a = align_chunks([1, 2, 3, 4], [3, 4])  # a 3:1 chunk and a 1:1 chunk
    s_BT, t_BU = chunk_tensors([a], 4, 2)
    mu = torch.tensor([[-0.1, -0.2, -0.3, -0.4]])
    p = project_teacher_logprobs(mu, torch.tensor([[-1.0, -2.0]]), s_BT, t_BU, "uniform", 2)
    assert p.signal_BT.tolist() == [[False, False, False, True]]
    assert p.teacher_logprobs_BT[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, -2.0])


def test_identical_tokenizations_give_the_teacher_logprobs_bit_for_bit():
    ends = list(accumulate([3, 1, 4, 1, 5]))
    a = align_chunks(ends, ends)
    assert a.student_chunks == a.teacher_chunks == tuple(range(5))
    teacher = torch.randn(1, 5).float()
    p = project_teacher_logprobs(torch.randn(1, 5), teacher, *chunk_tensors([a], 5, 5), "uniform", 8)
    assert torch.equal(p.teacher_logprobs_BT, teacher)


def test_metrics_from_counts():
    a = align_chunks([1, 2, 3, 4], [2, 3, 4])  # chunks: [a b | ab], [c | c], [d | d]
    s_BT, t_BU = chunk_tensors([a], 4, 3)
    p = project_teacher_logprobs(torch.zeros(1, 4), torch.zeros(1, 3), s_BT, t_BU, "one_to_one", 8)
    counts = alignment_counts([a], p.signal_BT, torch.ones(1, 4))
    assert alignment_metrics(counts, "t") == {"align/one_to_one/t": 2 / 3, "align/chunk_tokens/t": 4 / 3,
                                              "align/signal/t": 2 / 4}


def test_the_vocabulary_map_keeps_one_teacher_spelling_per_student_token():
    student = [b"a", b"b", b" c", b""]
    teacher = [b" c", b"x", b"a", b" c", b"b"]  # " c" twice (e.g. "\u2581c" and a byte-fallback spelling)
    teacher_ids, student_ids = vocabulary_map(student, teacher)
    assert list(zip(teacher_ids.tolist(), student_ids.tolist())) == [(0, 2), (2, 0), (4, 1)]


def test_one_to_one_positions_point_at_the_teacher_token():
    a = align_chunks([1, 2, 4], [2, 3, 4])
    s_BT, t_BU = chunk_tensors([a], 4, 3)  # one student pad
    assert a == Alignment((0, 0, 1), (0, 1, 1), 2)  # ends 4 vs 3, 4: the last chunk is 1:2
    assert one_to_one_positions(s_BT, t_BU).tolist() == [[-1, -1, -1, -1]]
    b = align_chunks([1, 3, 4], [1, 2, 3, 4])
    s_BT, t_BU = chunk_tensors([b], 3, 4)
    assert one_to_one_positions(s_BT, t_BU).tolist() == [[0, -1, 3]]


def test_the_mapped_top_k_by_hand():
    """Teacher vocabulary of 4, student of 3; teacher tokens 0 and 2 exist on the student side (as
    1 and 0). At the one 1:1 position the teacher's top-1 mapped token is its token 2 (p = 0.4,
    unmapped token 3 has 0.3 and is in the tail with token 0's 0.2 and token 1's 0.1)."""
    p_V = torch.tensor([0.2, 0.1, 0.4, 0.3]).log()
    full_BUV = torch.stack([p_V, p_V.flip(0)])[None]  # teacher positions 0 and 1
    u_of_t_BT = torch.tensor([[1, -1, 0]])  # student 0 ↔ teacher 1, student 2 ↔ teacher 0
    out = mapped_topk(full_BUV, u_of_t_BT, torch.tensor([0, 2]), torch.tensor([1, 0]), 1)
    assert out.signal_BT.tolist() == [[True, False, True]]
    # at teacher position 1 (p flipped: 0.3, 0.4, 0.1, 0.2) the mapped tokens 0 (0.3) and 2 (0.1): top-1 is 0
    assert out.student_ids_BTK[0, 0].tolist() == [1] and out.student_ids_BTK[0, 2].tolist() == [0]
    assert out.logprobs_BTK[0, 2].exp().tolist() == pytest.approx([0.4])
    assert out.tail_logprobs_BT[0, 2].exp().item() == pytest.approx(0.6)
    assert out.mapped_mass_BT[0, 2].item() == pytest.approx(0.6) and out.mapped_mass_BT[0, 0].item() == pytest.approx(0.4)


def test_a_dense_term_across_tokenizers_takes_the_sampled_token_term_off_its_1to1_chunks():
    """PerTeacherOPD's top-k term with a signal mask = the top-k term on the signal positions + the
    importance-sampled PG on the driver's advantages at the others (each over the global N)."""
    from k3post.algo.objectives import PerTeacherOPD, TeacherTerm
    from k3post.types import TeacherPart, TeacherTopK, TrainBatch

    gen = torch.Generator().manual_seed(0)
    B, T, V, K = 2, 4, 7, 3
    logits_BTV = torch.randn(B, T, V, generator=gen, requires_grad=True)
    student_BTV = logits_BTV.log_softmax(-1)
    ids_BT = torch.randint(0, V, (B, T), generator=gen)
    student_BT = student_BTV.gather(-1, ids_BT[..., None]).squeeze(-1)
    mask_BT = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    teacher_BTV = torch.randn(B, T, V, generator=gen).log_softmax(-1)
    values_BTK, top_BTK = teacher_BTV.topk(K, dim=-1)
    tail_BT = (1 - values_BTK.exp().sum(-1)).clamp(min=1e-6).log()
    signal_BT = torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 0]])
    batch = TrainBatch([[0]] * B, ids_BT, mask_BT, student_BT.detach() - 0.1, torch.randn(B, T, generator=gen))

    def loss(signal):
        part = TeacherPart("t", (0, 1), TeacherTopK(top_BTK.int(), values_BTK, tail_BT, signal))
        objective = PerTeacherOPD((("t", TeacherTerm("topk_reverse", coef=2.0, k=K)),))
        from dataclasses import replace
        return objective.loss(replace(batch, teacher_parts=(part,)), student_BT, student_BTV, 6.0)

    dense_only = loss(None)  # every position dense
    mixed = loss(signal_BT)
    # by hand: the dense term on the signal positions, the PG term on the rest
    from k3post.algo.aggregate import token_sum_normalized
    from k3post.algo.policy_loss import importance_sampled_pg_loss
    from k3post.algo.topk import bin_divergence, topk_bins

    s_bins, t_bins = topk_bins(student_BTV, top_BTK, values_BTK, tail_BT)
    on = mask_BT * signal_BT
    t_bins = torch.where((on != 0)[..., None], t_bins, s_bins.detach())
    want = 2.0 * token_sum_normalized(bin_divergence(s_bins, t_bins, "reverse"), on, 6.0)
    pg_BT = importance_sampled_pg_loss(student_BT, batch.sampler_logprobs_BT, batch.advantages_BT)
    want = want + token_sum_normalized(pg_BT, mask_BT * (1 - signal_BT), 6.0)
    assert float(mixed) == pytest.approx(float(want), rel=1e-6)
    assert float(mixed) != pytest.approx(float(dense_only), rel=1e-3)
