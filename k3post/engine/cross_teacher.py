"""A teacher whose tokenizer is not the student's: it reads the student's text, not its ids.

For every row the teacher gets (k3post/algo/cross_tokenizer.py has the maths):
1. **its own prompt**: the messages rendered through the teacher's chat template, with its own
   system prompt (else the student's): a template the teacher was not trained on biases its
   logprobs;
2. **the completion's exact text**: the bytes of the student's sampled pieces, concatenated (no
   `decode` clean-up, no normalisation; a special token written mid-answer is its content, which
   the teacher parses into its own special token where it has one). Bytes that end inside a
   character are cut off there: what follows carries no signal;
3. **its tokenization of that text**, encoded on its own (with byte offsets) and appended to the
   prompt's ids as ids, never as strings, so nothing merges across the seam. A student end token
   becomes the teacher's end-of-turn token, paired with it as a chunk of its own;
4. one forward of the inner engine (HF or vLLM: ids in, logprobs of the given tokens out), then
   the chunk alignment and the projection onto the student's tokens by the teacher's `split`.

What goes back is what a same-tokenizer teacher sends: [B, T] teacher logprobs on the student's
tokens (the projected τ_t), so the advantages, the loss and the payloads are unchanged, O(B·T).
Held-out evaluation gets the sequence-level log-ratio per byte of text (`exact_kl`): the
token-level exact KL needs one vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from k3post.algo.cross_tokenizer import (Alignment, align_chunks, alignment_counts, chunk_tensors, closable,
                                         mapped_topk, one_to_one_positions, project_teacher_logprobs, vocabulary_map)
from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, TeacherSpec
from k3post.engine.teacher import TeacherScorer, token_logprobs_from
from k3post.model.load import generation_config, load_tokenizer
from k3post.model.sampling import eos_ids, render_prompts
from k3post.model.token_text import TokenText, encode_with_offsets, valid_utf8_prefix
from k3post.types import Prompt, Rollouts, SamplingParams, TeacherTopK, pad_right

END_PROBE = "k3post end-of-turn probe"


def end_of_turn_id(tokenizer, stop_ids: list[int]) -> int:
    """The token a model ends its turns with: the one its chat template writes right after an
    assistant message (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>), else its EOS."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": END_PROBE}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    after = rendered.rfind(END_PROBE) + len(END_PROBE)
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    for token_id, (start, _) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        if start >= after and rendered[after:start].strip() == "":
            if token_id in stop_ids or token_id in tokenizer.all_special_ids:
                return int(token_id)
            break
    if tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer {type(tokenizer).__name__} has no end-of-turn token in its chat template "
                        f"and no eos_token: a teacher with another tokenizer needs one to pair with the student's")
    return int(tokenizer.eos_token_id)


@dataclass
class TextSide:
    """One model's reading of text: its tokenizer, its tokens' bytes, the ids that end a turn."""

    tokenizer: object
    text: TokenText
    stop_ids: frozenset[int]
    end_id: int

    @classmethod
    def of(cls, tokenizer, spec: ModelSpec) -> "TextSide":
        stops = eos_ids(tokenizer, generation_config(spec))
        return cls(tokenizer, TokenText(tokenizer), frozenset(stops), end_of_turn_id(tokenizer, stops))

    def completion_text(self, ids: list[int]) -> tuple[list[int], bool, str, bool]:
        """(the ids without a final stop id, whether there was one, their exact text, whether the
        text holds all their bytes)."""
        ended = bool(ids) and ids[-1] in self.stop_ids
        body = ids[:-1] if ended else ids
        data = b"".join(self.text.pieces(body))
        text = valid_utf8_prefix(data)
        return body, ended, text, len(text.encode()) == len(data)


@dataclass
class RowView:
    """One row as the teacher reads it: its ids of the completion, the chunks, the bytes aligned."""

    teacher_ids: list[int]
    alignment: Alignment
    aligned_bytes: int


def teacher_ends(side: TextSide, ids: list[int], starts: list[int], ends: list[int], text: str) -> tuple[list[int], list[bool]]:
    """Byte ends of the teacher's tokens and where a chunk may close after them. Exact from the
    tokens' own bytes when they spell the text (no normaliser, no added prefix space); from the
    tokenizer's character offsets otherwise (a boundary inside a character then cannot close)."""
    pieces = side.text.pieces(ids)
    if b"".join(pieces) == text.encode():
        return list(accumulate(len(p) for p in pieces)), [True] * len(ids)
    return ends, closable(starts, ends)


def read_row(student: TextSide, teacher: TextSide, ids: list[int], room: int | None) -> RowView:
    """Align one student completion with the teacher's tokenization of its text (module docstring)."""
    body, ended, text, complete = student.completion_text(ids)
    t_ids, t_starts, t_ends = encode_with_offsets(teacher.tokenizer, text)
    truncated = room is not None and len(t_ids) + int(ended) > room
    if truncated:  # the teacher's context is full: what does not fit carries no signal
        t_ids, t_starts, t_ends = t_ids[:room], t_starts[:room], t_ends[:room]
    t_byte_ends, t_closable = teacher_ends(teacher, t_ids, t_starts, t_ends, text)
    s_byte_ends = list(accumulate(len(student.text.bytes_of[token]) for token in body))
    inner = align_chunks(s_byte_ends, t_byte_ends, t_closable)
    s_chunks = list(inner.student_chunks) + [-1] * int(ended)
    t_chunks, chunks = list(inner.teacher_chunks), inner.num_chunks
    closed = [c for c in inner.teacher_chunks if c >= 0]
    aligned = max((t_byte_ends[j] for j, c in enumerate(inner.teacher_chunks) if c >= 0), default=0)
    if ended and complete and not truncated and len(closed) == len(t_ids):  # the end tokens pair
        t_ids, t_chunks, s_chunks[-1], chunks = t_ids + [teacher.end_id], t_chunks + [chunks], chunks, chunks + 1
    return RowView(t_ids, Alignment(tuple(s_chunks), tuple(t_chunks), chunks), aligned)


class CrossTokenizerTeacher:
    """A teacher engine (HF or vLLM, `spec.engine`) behind the cross-tokenizer reading."""

    def __init__(self, name: str, spec: TeacherSpec, student: ModelSpec, student_system_prompt: str | None = None,
                 num_threads: int | None = None):
        self.name, self.spec = name, spec
        self.inner = inner_engine(name, spec, num_threads)
        self.teacher = TextSide.of(self.inner.tokenizer, spec.model)
        self.student = TextSide.of(load_tokenizer(student), student)
        self.system_prompt = spec.system_prompt if spec.system_prompt is not None else student_system_prompt
        self.student_system_prompt = student_system_prompt
        self.context = spec.vllm.max_model_len if spec.engine == "vllm" else None
        self.counts: dict[str, float] = {}
        self.vocab_map: tuple[torch.Tensor, torch.Tensor] | None = None  # (teacher ids, student ids), on first use

    # -- the teacher's reading of a batch

    def teacher_rollouts(self, rollouts: Rollouts) -> tuple[Rollouts, list[RowView]]:
        """The batch in the teacher's ids (its prompts, its tokenization of each completion) and
        each row's alignment."""
        prompt_ids = render_prompts(self.teacher.tokenizer, rollouts.prompts, self.system_prompt)
        views = []
        for prompt, ids_T, mask_T in zip(prompt_ids, rollouts.completion_ids_BT, rollouts.loss_mask_BT):
            room = None if self.context is None else max(self.context - len(prompt) - 1, 0)
            views.append(read_row(self.student, self.teacher, ids_T[: int(mask_T.sum())].tolist(), room))
        pad = self.teacher.tokenizer.pad_token_id if self.teacher.tokenizer.pad_token_id is not None else 0
        ids_BU = pad_rows([v.teacher_ids for v in views], pad)
        mask_BU = pad_rows([[1] * len(v.teacher_ids) for v in views], 0).float()
        ours = Rollouts(rollouts.prompts, prompt_ids, ids_BU, mask_BU, torch.zeros_like(mask_BU),
                        weight_version=rollouts.weight_version)
        return ours, views

    def _scored(self, rollouts: Rollouts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[RowView]]:
        theirs, views = self.teacher_rollouts(rollouts)
        teacher_BU = self.inner.score(theirs).float()
        s_BT, t_BU = chunk_tensors([v.alignment for v in views], rollouts.completion_ids_BT.shape[1],
                                   theirs.completion_ids_BT.shape[1])
        return teacher_BU, s_BT, t_BU, views

    def score(self, rollouts: Rollouts) -> torch.Tensor:
        """τ_t for every student token, [B, T] (0 at pads): log μ_t − τ_t is the chunk's share of
        the reverse-KL estimate by the teacher's `cross_tokenizer.split`."""
        return self._project(rollouts, *self._scored(rollouts))

    def score_topk(self, rollouts: Rollouts, k: int) -> tuple[torch.Tensor, TeacherTopK]:
        """τ_t [B, T] as `score`, and the teacher's top-k on the mapped support at the 1:1 chunks
        (algo/cross_tokenizer.py: mapped_topk), on the student's ids, for a topk_* loss."""
        theirs, views = self.teacher_rollouts(rollouts)
        full_BUV = self.inner.score_full(theirs).float()
        teacher_BU = token_logprobs_from(full_BUV, theirs)
        s_BT, t_BU = chunk_tensors([v.alignment for v in views], rollouts.completion_ids_BT.shape[1],
                                   theirs.completion_ids_BT.shape[1])
        tau_BT = self._project(rollouts, teacher_BU, s_BT, t_BU, views)
        if self.vocab_map is None:  # built once: the tokens whose bytes both vocabularies hold
            self.vocab_map = vocabulary_map(self.student.text.bytes_of, self.teacher.text.bytes_of)
        dense = mapped_topk(full_BUV, one_to_one_positions(s_BT, t_BU), *self.vocab_map, k)
        signal_BT = dense.signal_BT & (rollouts.loss_mask_BT != 0)
        self._add({"dense_positions": float(signal_BT.sum()), "mapped_mass": float(dense.mapped_mass_BT[signal_BT].sum())})
        return tau_BT, TeacherTopK(dense.student_ids_BTK.int(), dense.logprobs_BTK, dense.tail_logprobs_BT,
                                   signal_BT.float())

    def _project(self, rollouts: Rollouts, teacher_BU: torch.Tensor, s_BT: torch.Tensor, t_BU: torch.Tensor,
                 views: list[RowView]) -> torch.Tensor:
        """τ_t by the teacher's split (0 at pads); the batch's alignment counts added up."""
        settings = self.spec.cross_tokenizer
        projection = project_teacher_logprobs(rollouts.sampler_logprobs_BT, teacher_BU, s_BT, t_BU, settings.split,
                                              settings.max_chunk_tokens)
        self._add(alignment_counts([v.alignment for v in views], projection.signal_BT, rollouts.loss_mask_BT))
        return projection.teacher_logprobs_BT * rollouts.loss_mask_BT

    def _add(self, counts: dict[str, float]) -> None:
        self.counts = {**self.counts, **{k: self.counts.get(k, 0.0) + v for k, v in counts.items()}}

    def alignment_counts(self) -> dict[str, float]:
        """The alignment counts of the batches scored since the last call (then reset)."""
        counts, self.counts = self.counts, {}
        return counts

    def exact_kl(self, rollouts: Rollouts, student_logprobs_BTV: torch.Tensor, direction: str) -> dict[str, float]:
        """The sequence-level log-ratio summed over the rows, and the bytes of text it covers:
        Σ_rows (log π_S(y) − log π_T(y)) for direction "reverse" (the student's samples), the
        negation for "forward" (the teacher's, in the student's tokens); each side the log-probability
        of the aligned text under its own tokenization. No per-token KL: the vocabularies differ."""
        if direction not in ("reverse", "forward"):
            raise ValueError(f"direction must be 'reverse' or 'forward', got {direction!r}")
        teacher_BU, s_BT, t_BU, views = self._scored(rollouts)
        ids_BT1 = rollouts.completion_ids_BT[..., None].to(student_logprobs_BTV.device)
        student_BT = student_logprobs_BTV.gather(-1, ids_BT1).squeeze(-1).float().cpu()
        student_B = torch.where(s_BT >= 0, student_BT, 0.0).double().sum(1)
        teacher_B = torch.where(t_BU >= 0, teacher_BU, 0.0).double().sum(1)
        ratio_B = student_B - teacher_B if direction == "reverse" else teacher_B - student_B
        return {"seq_logratio_sum": float(ratio_B.sum()), "bytes": float(sum(v.aligned_bytes for v in views))}

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        """The teacher's own answers, as text the student's tokenizer splits (its end token the
        student's), with the student's view of the prompts, so the student can score them."""
        theirs = self.inner.sample(prompts, params)
        rows, texts = [], []
        for ids_T, mask_T in zip(theirs.completion_ids_BT, theirs.loss_mask_BT):
            _, ended, text, _ = self.teacher.completion_text(ids_T[: int(mask_T.sum())].tolist())
            ids = self.student.tokenizer(text, add_special_tokens=False)["input_ids"]
            rows.append(list(ids) + ([self.student.end_id] if ended else []))
            texts.append(text)
        pad = self.student.tokenizer.pad_token_id if self.student.tokenizer.pad_token_id is not None else 0
        mask_BT = pad_rows([[1] * len(r) for r in rows], 0).float()
        student_prompts = render_prompts(self.student.tokenizer, prompts, self.student_system_prompt)
        return Rollouts(prompts, student_prompts, pad_rows(rows, pad), mask_BT, torch.zeros_like(mask_BT), texts)

    def check_scores(self, rollouts: Rollouts) -> dict[str, float] | None:
        """The drift gate's spot check of the inner engine, on the teacher's reading of the batch."""
        return self.inner.check_scores(self.teacher_rollouts(rollouts)[0])

    def vocab_fingerprint(self) -> tuple[int, str]:
        return self.inner.vocab_fingerprint()


def pad_rows(rows: list[list[int]], pad: int) -> torch.Tensor:
    """Ragged id lists as one [B, max(1, longest)] long tensor, padded on the right."""
    width = max([1, *(len(r) for r in rows)])
    return pad_right([torch.tensor([r], dtype=torch.long).view(1, -1) for r in rows], width, pad)


def inner_engine(name: str, spec: TeacherSpec, num_threads: int | None):
    """The engine that scores the teacher's ids: HF (TeacherScorer) or vLLM (VLLMTeacher)."""
    if spec.engine == "vllm":
        from k3post.engine.vllm_teacher import VLLMTeacher  # noqa: PLC0415  (vLLM is optional)

        return VLLMTeacher(name, spec, num_threads)
    return TeacherScorer(name, spec, num_threads)
