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
from k3post.engine.samplers.sampler import HFSampler
from k3post.engine.teachers.teacher import TeacherScorer
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


def brute_force_bin_losses(student_BTV, teacher_BTV, k: int, kind: str, beta: float):
    """Per position, by enumeration in plain probabilities (no topk.py): the teacher's own top-k ids
    from its full distribution, both distributions on those k bins plus one tail, then the loss."""
    B, T, _ = student_BTV.shape
    out = torch.zeros(B, T, dtype=student_BTV.dtype)
    for b in range(B):
        for t in range(T):
            p_t, p_s = teacher_BTV[b, t].double().exp(), student_BTV[b, t].exp()
            ids = p_t.topk(k).indices
            bins_t = torch.cat([p_t[ids], (1 - p_t[ids].sum()).reshape(1)])
            bins_s = torch.cat([p_s[ids], (1 - p_s[ids].sum()).reshape(1)])
            if kind == "topk_forward":
                out[b, t] = (bins_t * (bins_t / bins_s).log()).sum()
            elif kind == "topk_reverse":
                out[b, t] = (bins_s * (bins_s / bins_t).log()).sum()
            else:  # JSD(β), TRL's convention: M = β p_T + (1 − β) p_S
                m = beta * bins_t + (1 - beta) * bins_s
                out[b, t] = beta * (bins_t * (bins_t / m).log()).sum() + (1 - beta) * (bins_s * (bins_s / m).log()).sum()
    return out


def test_per_teacher_top_k_losses_and_gradients_equal_brute_force_on_their_own_rows(teacher, rollouts):
    """The loop's path for top-k rows (rows interleaved between two teachers, each payload scored on
    its own rows only, split into micro-batches of one row): the summed loss and its gradient w.r.t.
    the student's logits equal, row by row, the brute-force bin losses computed from each row's own
    teacher's full distribution: which ids, which teacher, the tail, the sign, β and the division by N."""
    other = TeacherScorer("u", TEACHER.model_copy(update={"model": ModelSpec(tiny=TinyModelSpec(
        hidden_size=32, num_layers=2, seed=12, init_std=0.2))}))
    g = torch.Generator().manual_seed(5)
    z = (2 * torch.randn(*rollouts.loss_mask_BT.shape, 101, generator=g, dtype=torch.float64)).requires_grad_(True)
    s_BTV = z.log_softmax(-1)
    s_BT = s_BTV.gather(-1, rollouts.completion_ids_BT[..., None]).squeeze(-1)
    mask, N = rollouts.loss_mask_BT, 11.0
    for kind_a, kind_u in (("topk_jsd", "topk_reverse"), ("topk_forward", "topk_jsd")):
        a_rows, u_rows = [0, 2], [1]
        _, topk_a = teacher.score_topk(rollouts.select(a_rows), 4)
        _, topk_u = other.score_topk(rollouts.select(u_rows), 6)
        objective = PerTeacherOPD((("a", TeacherTerm(kind_a, coef=0.7, k=4, beta=0.3)),
                                   ("u", TeacherTerm(kind_u, coef=1.3, k=6, beta=0.8))))
        batch = batch_for(rollouts, [TeacherPart("a", tuple(a_rows), topk_a), TeacherPart("u", tuple(u_rows), topk_u)])
        got = sum(objective.loss(mb, s_BT[i:i + 1, :mb.loss_mask_BT.shape[1]], s_BTV[i:i + 1, :mb.loss_mask_BT.shape[1]],
                                 N) for i, mb in enumerate(batch.micro_batches(1)))
        (g_got,) = torch.autograd.grad(got, z, retain_graph=True)
        want = 0.0
        for rows, scorer, k, kind, coef, beta in ((a_rows, teacher, 4, kind_a, 0.7, 0.3),
                                                  (u_rows, other, 6, kind_u, 1.3, 0.8)):
            full = scorer.score_full(rollouts.select(rows))
            width = full.shape[1]
            div = brute_force_bin_losses(s_BTV[rows, :width], full, k, kind, beta)
            want = want + coef * (div * mask[rows, :width]).sum() / N
        (g_want,) = torch.autograd.grad(want, z, retain_graph=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-7)
        assert float(g_got.abs().sum()) > 0


@pytest.mark.parametrize("kind", ["sampled_token", "full_vocab", "topk_forward", "topk_reverse", "topk_jsd"])
def test_a_teacher_loss_saved_loads_again_and_keys_of_another_kind_are_refused(kind):
    """The saved form (recipe.resolved.yaml) holds only the keys of its kind, so it loads again;
    a key of another kind given by hand is still an error."""
    spec = TeacherLossSpec(kind=kind)
    saved = spec.model_dump(mode="json")
    assert TeacherLossSpec.model_validate(saved) == spec
    assert ("beta" in saved) == (kind == "topk_jsd") and ("k" in saved) == kind.startswith("topk")
    if kind != "topk_jsd":
        with pytest.raises(ValueError, match="`beta` does not apply"):
            TeacherLossSpec(kind=kind, beta=0.5)
