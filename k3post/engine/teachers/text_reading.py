"""How a model reads text another model's tokenizer wrote (docs/losses.md, "Teachers with another
tokenizer"; the maths in k3post/algo/cross_tokenizer.py).

A `TextSide` is one model's tokenizer, its tokens' exact bytes (model/tokenizers/token_text.py) and its
end-of-turn token. A `TextReader` holds the student's side and the teacher's and turns a batch
from one tokenization into the other:

- `teacher_view`: the student's completions as the teacher reads them (its own prompt, its own
  tokenization of the exact text, the end tokens paired) and each row's chunk alignment;
- `student_view`: the teacher's own answers as text the student's tokenizer splits.

Used by the cross-tokenizer teacher engine (engine/teachers/cross_teacher.py) and the evaluation
harness's per-byte KL (loops/eval_tasks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from k3post.algo.cross_tokenizer import Alignment, align_chunks, chunk_tensors, closable
from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec
from k3post.model.scoring.chat_render import ChatRenderer
from k3post.model.loading.load import generation_config
from k3post.model.generation.sampling import eos_ids
from k3post.model.tokenizers.token_text import TokenText, encode_with_offsets, valid_utf8_prefix
from k3post.types import Rollouts, pad_right

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
    render: ChatRenderer = field(init=False)  # its chat template, the shared head tokenized once

    def __post_init__(self) -> None:
        self.render = ChatRenderer(self.tokenizer)

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


def teacher_ends(side: TextSide, ids: list[int], starts: list[int], ends: list[int], text: str
                 ) -> tuple[list[int], list[bool]]:
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


@dataclass
class TextReader:
    """The student's side and the teacher's, and the prompts each renders (`system_prompt`: the
    teacher's, else the student's; `context`: the teacher's token limit, None for none)."""

    student: TextSide
    teacher: TextSide
    system_prompt: str | None = None
    student_system_prompt: str | None = None
    context: int | None = None

    def teacher_view(self, rollouts: Rollouts) -> tuple[Rollouts, list[RowView]]:
        """The batch in the teacher's ids (its prompts, its tokenization of each completion) and
        each row's alignment."""
        prompt_ids = self.teacher.render(rollouts.prompts, self.system_prompt)
        views = []
        for prompt, ids_T, mask_T in zip(prompt_ids, rollouts.completion_ids_BT, rollouts.loss_mask_BT):
            room = None if self.context is None else max(self.context - len(prompt) - 1, 0)
            views.append(read_row(self.student, self.teacher, ids_T[: int(mask_T.sum())].tolist(), room))
        ids_BU = pad_rows([v.teacher_ids for v in views], pad_id(self.teacher.tokenizer))
        mask_BU = pad_rows([[1] * len(v.teacher_ids) for v in views], 0).float()
        ours = Rollouts(rollouts.prompts, prompt_ids, ids_BU, mask_BU, torch.zeros_like(mask_BU),
                        weight_version=rollouts.weight_version)
        return ours, views

    def chunks(self, views: list[RowView], student_width: int, teacher_width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' chunk indices, [B, T] and [B, U] (−1: in no chunk)."""
        return chunk_tensors([v.alignment for v in views], student_width, teacher_width)

    def student_view(self, theirs: Rollouts) -> Rollouts:
        """The teacher's own answers (its ids) as text the student's tokenizer splits, its end token
        the student's, with the student's view of the prompts, so the student can score them."""
        rows, texts = [], []
        for ids_T, mask_T in zip(theirs.completion_ids_BT, theirs.loss_mask_BT):
            _, ended, text, _ = self.teacher.completion_text(ids_T[: int(mask_T.sum())].tolist())
            ids = self.student.tokenizer(text, add_special_tokens=False)["input_ids"]
            rows.append(list(ids) + ([self.student.end_id] if ended else []))
            texts.append(text)
        mask_BT = pad_rows([[1] * len(r) for r in rows], 0).float()
        prompts = self.student.render(theirs.prompts, self.student_system_prompt)
        return Rollouts(theirs.prompts, prompts, pad_rows(rows, pad_id(self.student.tokenizer)), mask_BT,
                        torch.zeros_like(mask_BT), texts)


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def pad_rows(rows: list[list[int]], pad: int) -> torch.Tensor:
    """Ragged id lists as one [B, max(1, longest)] long tensor, padded on the right."""
    width = max([1, *(len(r) for r in rows)])
    return pad_right([torch.tensor([r], dtype=torch.long).view(1, -1) for r in rows], width, pad)
