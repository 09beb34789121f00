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

import torch

from k3post.algo.cross_tokenizer import (MappedTopK, aligned_logratios, alignment_counts, mapped_topk,
                                         mapped_topk_of_topk, one_to_one_positions, prefix_pieces,
                                         project_teacher_logprobs, projected_topk, projected_topk_of_topk,
                                         student_of_teacher, vocabulary_map)
from k3post.config.loss_schema import TOPK_KINDS
from k3post.config.schema import ModelSpec, TeacherSpec
from k3post.engine.teachers.teacher import TeacherScorer, token_logprobs_from
from k3post.engine.teachers.text_reading import RowView, TextReader, TextSide
from k3post.model.loading.load import load_tokenizer
from k3post.types import Prompt, Rollouts, SamplingParams, TeacherTopK

# A vLLM teacher returns its top-(factor·k) per position: the k most likely of them that the
# student's vocabulary holds are the dense loss's support (vLLM cannot rank its whole vocabulary).
VLLM_TOPK_FACTOR = 4

class CrossTokenizerTeacher:
    """A teacher engine (HF or vLLM, `spec.engine`) behind the cross-tokenizer reading."""

    def __init__(self, name: str, spec: TeacherSpec, student: ModelSpec, student_system_prompt: str | None = None,
                 num_threads: int | None = None):
        self.name, self.spec = name, spec
        self.inner = inner_engine(name, spec, num_threads, student_system_prompt)
        self.reader = TextReader(TextSide.of(load_tokenizer(student), student),
                                 TextSide.of(self.inner.tokenizer, spec.model),
                                 spec.system_prompt if spec.system_prompt is not None else student_system_prompt,
                                 student_system_prompt, spec.vllm.max_model_len if spec.engine == "vllm" else None)
        self.counts: dict[str, float] = {}
        self.vocab_map: tuple[torch.Tensor, torch.Tensor] | None = None  # (teacher ids, student ids), on first use
        self.pieces: torch.Tensor | None = None  # dense_support prefix: π(u) of every teacher id, on first use

    def _scored(self, rollouts: Rollouts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[RowView]]:
        theirs, views = self.reader.teacher_view(rollouts)
        teacher_BU = self.inner.score(theirs).float()
        return teacher_BU, *self.reader.chunks(views, rollouts.completion_ids_BT.shape[1], teacher_BU.shape[1]), views

    def score(self, rollouts: Rollouts) -> torch.Tensor:
        """τ_t for every student token, [B, T] (0 at pads): log μ_t − τ_t is the chunk's share of
        the reverse-KL estimate by the teacher's `cross_tokenizer.split`."""
        return self._project(rollouts, *self._scored(rollouts))

    def score_topk(self, rollouts: Rollouts, k: int) -> tuple[torch.Tensor, TeacherTopK]:
        """τ_t [B, T] as `score`, and the teacher's top-k at the 1:1 chunks on the student's ids, for a
        topk_* loss, on its `cross_tokenizer.dense_support` (the exact map or the prefix projection):
        from its whole distribution (HF: algo/cross_tokenizer.py mapped_topk / projected_topk) or from
        its top VLLM_TOPK_FACTOR·k (vLLM: mapped_topk_of_topk / projected_topk_of_topk)."""
        theirs, views = self.reader.teacher_view(rollouts)
        full_BUV = top = None
        if self.spec.engine == "vllm":
            teacher_BU, top = self.inner.score_topk(theirs, VLLM_TOPK_FACTOR * k)
        else:
            full_BUV = self.inner.score_full(theirs).float()
            teacher_BU = token_logprobs_from(full_BUV, theirs)
        s_BT, t_BU = self.reader.chunks(views, rollouts.completion_ids_BT.shape[1], teacher_BU.shape[1])
        tau_BT = self._project(rollouts, teacher_BU.float(), s_BT, t_BU, views)
        dense = self._dense(full_BUV, top, one_to_one_positions(s_BT, t_BU), k)
        signal_BT = dense.signal_BT & (rollouts.loss_mask_BT != 0)
        self._add({"dense_positions": float(signal_BT.sum()),
                   "mapped_mass": float(dense.mapped_mass_BT[signal_BT].sum())})
        return tau_BT, TeacherTopK(dense.student_ids_BTK.int(), dense.logprobs_BTK, dense.tail_logprobs_BT,
                                   signal_BT.float())

    def _dense(self, full_BUV: torch.Tensor | None, top, u_of_t_BT: torch.Tensor, k: int) -> MappedTopK:
        """The teacher's top-k at the 1:1 positions on its `dense_support` (algo/cross_tokenizer.py):
        from the whole distribution (`full_BUV`) or from an engine's top-K (`top`)."""
        student_bytes, teacher_bytes = self.reader.student.text.bytes_of, self.reader.teacher.text.bytes_of
        if self.spec.cross_tokenizer.dense_support == "prefix":
            if self.pieces is None:  # built once: each teacher token's longest student prefix
                self.pieces = self._prefix_pieces()
            if top is None:
                return projected_topk(full_BUV, u_of_t_BT, self.pieces, len(student_bytes), k)
            return projected_topk_of_topk(top.ids_BTK, top.logprobs_BTK, u_of_t_BT, self.pieces, k)
        if self.vocab_map is None:  # built once: the tokens whose bytes both vocabularies hold
            self.vocab_map = vocabulary_map(student_bytes, teacher_bytes)
        if top is None:
            return mapped_topk(full_BUV, u_of_t_BT, *self.vocab_map, k)
        table_V = student_of_teacher(*self.vocab_map, len(teacher_bytes))
        return mapped_topk_of_topk(top.ids_BTK, top.logprobs_BTK, u_of_t_BT, table_V, k)

    def _prefix_pieces(self) -> torch.Tensor:
        """π of algo/cross_tokenizer.py (`prefix_pieces`), the teacher's stop tokens onto the student's end."""
        student, teacher = self.reader.student, self.reader.teacher
        pieces = prefix_pieces(student.text.bytes_of, teacher.text.bytes_of, student.text.added, teacher.text.added)
        pieces[sorted(teacher.stop_ids)] = student.end_id
        return pieces

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
        teacher_BU, s_BT, t_BU, views = self._scored(rollouts)
        ids_BT1 = rollouts.completion_ids_BT[..., None].to(student_logprobs_BTV.device)
        student_BT = student_logprobs_BTV.gather(-1, ids_BT1).squeeze(-1).float().cpu()
        ratio_B = aligned_logratios(student_BT, teacher_BU, s_BT, t_BU, direction)
        return {"seq_logratio_sum": float(ratio_B.sum()), "bytes": float(sum(v.aligned_bytes for v in views))}

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        """The teacher's own answers in the student's tokens (TextReader.student_view)."""
        return self.reader.student_view(self.inner.sample(prompts, params))

    def check_scores(self, rollouts: Rollouts) -> dict[str, float] | None:
        """The drift gate's spot check of the inner engine, on the teacher's reading of the batch."""
        return self.inner.check_scores(self.reader.teacher_view(rollouts)[0])

    def vocab_fingerprint(self) -> tuple[int, str]:
        return self.inner.vocab_fingerprint()

    def prefix_counts(self) -> dict[str, float]:
        """The inner engine's prompt-prefix counts (engine/teachers/teacher_prefix.py)."""
        return self.inner.prefix_counts()


def inner_engine(name: str, spec: TeacherSpec, num_threads: int | None, student_system_prompt: str | None = None):
    """The engine that scores the teacher's ids: HF (TeacherScorer) or vLLM (VLLMTeacher)."""
    if spec.engine == "vllm":
        from k3post.engine.teachers.vllm_teacher import VLLMTeacher  # noqa: PLC0415  (vLLM is optional)

        topk = spec.loss is not None and spec.loss.kind in TOPK_KINDS
        return VLLMTeacher(name, spec, num_threads, max_logprobs=VLLM_TOPK_FACTOR * spec.loss.k if topk else None)
    # The reader renders its prompts with the teacher's system prompt, else the student's: the
    # rows' common head, for the prefix cache (the ids themselves pass through).
    return TeacherScorer(name, spec, num_threads, student_system_prompt=student_system_prompt)
