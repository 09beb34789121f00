"""A teacher that returns only each position's top-K (vLLM's prompt logprobs) on the mapped support
(algo/cross_tokenizer.py: mapped_topk_of_topk), and the empty bins a payload with fewer than k ids
at a position is padded with (algo/topk.py: repeated_slots)."""

from __future__ import annotations

import pytest
import torch

from k3post.algo.cross_tokenizer import mapped_topk, mapped_topk_of_topk, student_of_teacher
from k3post.algo.topk import repeated_slots, topk_divergence

DIVERGENCES = [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.3)]


def random_case(seed: int, V_T: int = 12, V_S: int = 9, B: int = 2, U: int = 5, T: int = 6):
    gen = torch.Generator().manual_seed(seed)
    full_BUV = (3 * torch.randn(B, U, V_T, generator=gen)).log_softmax(-1)
    teacher_ids_M = torch.randperm(V_T, generator=gen)[:7]
    student_ids_M = torch.randperm(V_S, generator=gen)[:7]
    u_of_t_BT = torch.randint(-1, U, (B, T), generator=gen)
    return full_BUV, teacher_ids_M, student_ids_M, u_of_t_BT


def test_repeated_slots_marks_every_repeat_after_the_first():
    ids = torch.tensor([[[4, 2, 4, 4, 1], [0, 1, 2, 3, 5], [7, 7, 7, 7, 7]]])
    assert repeated_slots(ids).int().tolist() == [[[0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]]]


@pytest.mark.parametrize("divergence,beta", DIVERGENCES)
def test_a_repeated_slot_is_an_empty_bin(divergence, beta):
    """k ids with repeats give the divergence (and gradient) of the distinct ids alone, by brute force
    over the bins: the distinct ids' logprobs and the exact mass outside them, on both sides."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 1, 8, generator=gen, requires_grad=True)
    teacher_V = torch.randn(8, generator=gen).log_softmax(-1)
    distinct = torch.tensor([5, 1, 6])
    padded = torch.tensor([5, 1, 6, 5, 5])
    teacher_tail = torch.log1p(-teacher_V[distinct].exp().sum())

    def divergence_of(ids):
        values = teacher_V[ids].masked_fill(repeated_slots(ids[None, None])[0, 0], float("-inf"))
        student = logits.log_softmax(-1)
        return topk_divergence(student, ids[None, None], values[None, None], teacher_tail.view(1, 1),
                               torch.ones(1, 1), divergence, beta).sum()

    want = divergence_of(distinct)
    (g_want,) = torch.autograd.grad(want, logits)
    got = divergence_of(padded)
    (g_got,) = torch.autograd.grad(got, logits)
    assert float(want.detach()) > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_with_the_whole_vocabulary_returned_it_is_the_full_distributions_mapped_top_k(seed):
    full_BUV, teacher_ids_M, student_ids_M, u_of_t_BT = random_case(seed)
    want = mapped_topk(full_BUV, u_of_t_BT, teacher_ids_M, student_ids_M, 3)
    values_BUK, ids_BUK = full_BUV.topk(full_BUV.shape[-1], dim=-1)
    table_V = student_of_teacher(teacher_ids_M, student_ids_M, full_BUV.shape[-1])
    got = mapped_topk_of_topk(ids_BUK, values_BUK, u_of_t_BT, table_V, 3)
    signal = want.signal_BT
    assert torch.equal(got.signal_BT, signal) and signal.any() and (~signal).any()
    assert torch.equal(got.student_ids_BTK[signal], want.student_ids_BTK[signal])
    torch.testing.assert_close(got.logprobs_BTK[signal], want.logprobs_BTK[signal], rtol=0, atol=1e-6)
    # the tail as 1 − Σ in fp32 (an engine's top-K alone): equal as masses to fp32 rounding
    torch.testing.assert_close(got.tail_logprobs_BT[signal].exp(), want.tail_logprobs_BT[signal].exp(), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.mapped_mass_BT[signal], want.mapped_mass_BT[signal], rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_from_a_shorter_top_k_it_agrees_where_the_k_mapped_tokens_are_inside_it(seed):
    """K = 5 of 12: where the full path's k mapped tokens all rank in the teacher's top 5 the two agree;
    elsewhere the found mapped tokens are sent, the rest are empty bins, and the tail is 1 − their mass."""
    full_BUV, teacher_ids_M, student_ids_M, u_of_t_BT = random_case(seed)
    k, K = 3, 5
    want = mapped_topk(full_BUV, u_of_t_BT, teacher_ids_M, student_ids_M, k)
    values_BUK, ids_BUK = full_BUV.topk(K, dim=-1)
    table_V = student_of_teacher(teacher_ids_M, student_ids_M, full_BUV.shape[-1])
    got = mapped_topk_of_topk(ids_BUK, values_BUK, u_of_t_BT, table_V, k)
    kth_BT = values_BUK[..., -1].gather(1, u_of_t_BT.clamp(min=0))
    inside_BT = want.signal_BT & (want.logprobs_BTK[..., -1] >= kth_BT)
    assert inside_BT.any()
    assert torch.equal(got.student_ids_BTK[inside_BT], want.student_ids_BTK[inside_BT])
    torch.testing.assert_close(got.tail_logprobs_BT[inside_BT].exp(), want.tail_logprobs_BT[inside_BT].exp(), rtol=0,
                               atol=1e-6)
    empty_BTK = repeated_slots(got.student_ids_BTK)
    found_BTK = got.logprobs_BTK > float("-inf")
    assert torch.equal(empty_BTK[got.signal_BT], ~found_BTK[got.signal_BT])  # every slot found or empty
    mass_BT = got.logprobs_BTK.exp().sum(-1) + got.tail_logprobs_BT.exp()
    torch.testing.assert_close(mass_BT[got.signal_BT], torch.ones_like(mass_BT[got.signal_BT]), rtol=0, atol=1e-5)
    assert (got.mapped_mass_BT <= want.mapped_mass_BT + 1e-6)[got.signal_BT].all()


def test_by_hand_a_position_whose_top_k_holds_no_mapped_token_has_no_signal():
    """Teacher vocabulary 4 (p = 0.4, 0.3, 0.2, 0.1 for ids 2, 3, 0, 1), only teacher 0 and 1 map (to
    student 1 and 0). Top-2 = {2, 3}: nothing mapped. Top-3 = {2, 3, 0}: one mapped (p 0.2), k = 2
    sends it and an empty bin, tail 0.8."""
    full_BUV = torch.tensor([0.2, 0.1, 0.4, 0.3]).log()[None, None]
    table_V = student_of_teacher(torch.tensor([0, 1]), torch.tensor([1, 0]), 4)
    values, ids = full_BUV.topk(2, dim=-1)
    none = mapped_topk_of_topk(ids, values, torch.tensor([[0]]), table_V, 2)
    assert none.signal_BT.tolist() == [[False]]
    values, ids = full_BUV.topk(3, dim=-1)
    one = mapped_topk_of_topk(ids, values, torch.tensor([[0]]), table_V, 2)
    assert one.signal_BT.tolist() == [[True]] and one.student_ids_BTK.tolist() == [[[1, 1]]]
    assert one.logprobs_BTK.exp().tolist()[0][0] == pytest.approx([0.2, 0.0])
    assert one.tail_logprobs_BT.exp().item() == pytest.approx(0.8)
