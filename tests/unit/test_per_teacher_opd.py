"""Per-teacher OPD: teacher top-k / full / hidden-state scoring (HF), the chunked exact KL, the
per-teacher objective against the single-loss objectives, and the teacher YAML's loss key."""

from __future__ import annotations

import pytest
import torch

from k3post.algo.chunked_kl import chunked_reverse_kl
from k3post.algo.objectives import FullVocabReverseKL, PerTeacherOPD, SampledTokenPG, TeacherTerm
from k3post.algo.opd import kl_divergence
from k3post.config.loss_schema import TeacherLossSpec, resolve_teacher_loss
from k3post.config.schema import ModelSpec, TeacherSpec, TinyModelSpec
from k3post.engine.sampler import HFSampler
from k3post.engine.teacher import TeacherScorer
from k3post.types import Prompt, SamplingParams, TeacherPart, TrainBatch

TEACHER = TeacherSpec(model=ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=11, init_std=0.2)),
                      system_prompt="Be brief.")
STUDENT = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=1))
PROMPTS = [Prompt(f"p{i}", "chat", "t", (("user", text),)) for i, text in enumerate(["2+2?", "Name a colour", "Hi"])]


@pytest.fixture(scope="module")
def teacher():
    return TeacherScorer("t", TEACHER)


@pytest.fixture(scope="module")
def rollouts():
    return HFSampler(STUDENT).sample(PROMPTS, SamplingParams(max_new_tokens=6, seed=2))


def test_hf_top_k_is_the_head_of_the_full_distribution_with_an_exact_tail(teacher, rollouts):
    full_BTV = teacher.score_full(rollouts)
    V = full_BTV.shape[-1]
    token_BT, topk = teacher.score_topk(rollouts, 5)
    mask = rollouts.loss_mask_BT.bool()
    torch.testing.assert_close(token_BT[mask], teacher.score(rollouts)[mask], atol=1e-5, rtol=0)
    assert topk.ids_BTK.dtype == torch.int32 and topk.logprobs_BTK.shape == (*mask.shape, 5)
    torch.testing.assert_close(topk.logprobs_BTK, full_BTV.topk(5, dim=-1).values)
    torch.testing.assert_close(full_BTV.gather(-1, topk.ids_BTK.long()), topk.logprobs_BTK)
    torch.testing.assert_close(topk.tail_logprobs_BT.exp(), 1 - topk.logprobs_BTK.exp().sum(-1), atol=1e-6, rtol=0)
    _, everything = teacher.score_topk(rollouts, V)  # k = V: no tail at all
    assert torch.isinf(everything.tail_logprobs_BT).all()


def test_hidden_states_and_the_output_head_give_the_teachers_distribution(teacher, rollouts):
    token_BT, hidden = teacher.score_with_hidden(rollouts)
    head_VH = teacher.output_head()
    assert hidden.hidden_BTH.shape[-1] == head_VH.shape[1] < head_VH.shape[0]
    full_BTV = (hidden.hidden_BTH @ head_VH.T / hidden.temperature).log_softmax(-1)
    torch.testing.assert_close(full_BTV, teacher.score_full(rollouts), atol=1e-5, rtol=0)
    mask = rollouts.loss_mask_BT.bool()
    torch.testing.assert_close(token_BT[mask], teacher.score(rollouts)[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [7, 64, 10_000])
def test_the_chunked_kl_equals_the_full_vocabulary_kl_values_and_gradients(chunk):
    g = torch.Generator().manual_seed(0)
    hidden_BTH, head_VH = torch.randn(2, 3, 8, generator=g, dtype=torch.float64), torch.randn(50, 8, generator=g,
                                                                                                 dtype=torch.float64)
    z = torch.randn(2, 3, 50, generator=g, dtype=torch.float64, requires_grad=True)
    student = z.log_softmax(-1)
    teacher = (hidden_BTH @ head_VH.T / 0.7).log_softmax(-1)
    want = kl_divergence(student, teacher)
    got = chunked_reverse_kl(student, hidden_BTH, head_VH, 0.7, chunk)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), z, retain_graph=True)
    (g_want,) = torch.autograd.grad(want.sum(), z)
    torch.testing.assert_close(g_got, g_want)


def batch_for(rollouts, teacher_parts=()):
    g = torch.Generator().manual_seed(3)
    advantages = torch.randn(rollouts.loss_mask_BT.shape, generator=g) * rollouts.loss_mask_BT
    return TrainBatch(rollouts.prompt_ids, rollouts.completion_ids_BT, rollouts.loss_mask_BT,
                      rollouts.sampler_logprobs_BT, advantages, teacher_parts=tuple(teacher_parts))


def student_outputs(rollouts, vocab: int = 101):  # the tiny models' vocabulary
    g = torch.Generator().manual_seed(4)
    z = torch.randn(*rollouts.loss_mask_BT.shape, vocab, generator=g).requires_grad_(True)
    full = z.log_softmax(-1)
    return z, full.gather(-1, rollouts.completion_ids_BT[..., None]).squeeze(-1), full


def test_one_sampled_token_teacher_is_exactly_the_sampled_token_objective(rollouts):
    _, s_BT, s_BTV = student_outputs(rollouts)
    batch = batch_for(rollouts, [TeacherPart("t", (0, 1, 2))])
    got = PerTeacherOPD((("t", TeacherTerm("sampled_token")),)).loss(batch, s_BT, s_BTV, 7.0)
    assert torch.equal(got, SampledTokenPG().loss(batch, s_BT, s_BTV, 7.0))


def test_full_vocab_teachers_by_logprobs_by_hidden_states_and_by_top_k_at_k_equal_v_agree(teacher, rollouts):
    _, s_BT, s_BTV = student_outputs(rollouts)
    _, full = teacher.score_with_full(rollouts)
    _, hidden = teacher.score_with_hidden(rollouts)
    _, topk = teacher.score_topk(rollouts, full.logprobs_BTV.shape[-1])
    hidden.head_VH = teacher.output_head()
    reference = FullVocabReverseKL().loss(
        TrainBatch(**{**batch_for(rollouts).__dict__, "teacher_full_logprobs_BTV": full.logprobs_BTV}), s_BT, s_BTV, 9.0)
    for kind, payload in (("full_vocab", full), ("full_vocab", hidden), ("topk_reverse", topk)):
        objective = PerTeacherOPD((("t", TeacherTerm(kind, coef=2.0)),))
        loss, sums = objective.loss_and_sums(batch_for(rollouts, [TeacherPart("t", (0, 1, 2), payload)]), s_BT, s_BTV,
                                             9.0)
        assert float(loss) == pytest.approx(2.0 * float(reference), rel=1e-4), (kind, type(payload).__name__)
        assert sums["kl/t"] == pytest.approx(float(reference), rel=1e-4)


def test_rows_go_to_their_own_teachers_term_and_micro_batches_add_up(teacher, rollouts):
    """Rows 0 and 2 to a top-k JSD teacher, row 1 to a sampled-token one: the loss is the sum of each
    objective alone on its rows, and the micro-batches' losses and figures add up to the batch's."""
    _, s_BT, s_BTV = student_outputs(rollouts)
    _, topk = teacher.score_topk(rollouts.select([0, 2]), 4)
    objective = PerTeacherOPD((("a", TeacherTerm("topk_jsd", coef=0.5, k=4, beta=0.3)),
                               ("b", TeacherTerm("sampled_token"))))
    batch = batch_for(rollouts, [TeacherPart("a", (0, 2), topk), TeacherPart("b", (1,))])
    total, sums = objective.loss_and_sums(batch, s_BT, s_BTV, 8.0)
    only_b = SampledTokenPG().loss(TrainBatch(**{**batch.__dict__, "loss_mask_BT": batch.loss_mask_BT
                                                 * torch.tensor([[0.0], [1.0], [0.0]])}), s_BT, s_BTV, 8.0)
    assert float(total) == pytest.approx(sums["loss/a"] + float(only_b), rel=1e-6)
    assert sums["loss/b"] == pytest.approx(float(only_b), rel=1e-6)
    assert 0 < sums["topk_mass/a"] / sums["tokens/a"] < 1
    parts = [objective.loss_and_sums(mb, s_BT[i:i + 1, :mb.loss_mask_BT.shape[1]],
                                     s_BTV[i:i + 1, :mb.loss_mask_BT.shape[1]], 8.0)
             for i, mb in enumerate(batch.micro_batches(1))]
    assert sum(float(loss) for loss, _ in parts) == pytest.approx(float(total), rel=1e-5)
    assert sum(s.get("loss/a", 0.0) for _, s in parts) == pytest.approx(sums["loss/a"], rel=1e-5)
    figures = objective.finish_sums({k: sum(s.get(k, 0.0) for _, s in parts) for k in objective.sum_names()})
    assert set(figures) == {"train/loss/a", "train/kl/a", "train/topk_mass/a", "train/loss/b"}


def test_a_teacher_yaml_names_its_loss_and_a_teacher_that_names_none_takes_the_recipes():
    assert resolve_teacher_loss(None, "full_vocab", 0.5) == TeacherLossSpec(kind="full_vocab", coef=0.5)
    own = TeacherLossSpec(kind="topk_jsd", k=32, beta=0.2)
    assert resolve_teacher_loss(own, "sampled_token", 3.0).coef == 3.0
    assert resolve_teacher_loss(own.model_copy(update={"coef": 0.1}), "sampled_token", 3.0).coef == 0.1
    for bad in ({"kind": "sampled_token", "k": 8}, {"kind": "topk_forward", "beta": 0.1},
                {"kind": "topk_jsd", "send": "hidden_states"}, {"kind": "topk_jsd", "beta": 2.0}, {"kind": "kl"}):
        with pytest.raises(ValueError):
            TeacherLossSpec(**bad)
