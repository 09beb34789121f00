"""The data that travels along the arrows of one OPD step (docs/architecture.md).

Shapes use suffixes: `_B` batch, `_T` completion position. Every per-token tensor is aligned
with `completion_ids_BT`: entry [b, t] is about completion token t of row b (the token itself,
predicted from the prompt and the completion tokens before it). Padding positions have
`loss_mask_BT == 0` and hold `pad` ids / zero logprobs.

One spelling everywhere: `logprobs` with a role prefix (`sampler_`, `teacher_`, `ref_`,
`student_`) and one mask, `loss_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Prompt:
    """One chat prompt, tagged with the data source it came from and the teacher it is routed to."""

    uid: str
    source: str
    teacher: str
    messages: tuple[tuple[str, str], ...]  # ((role, content), ...), usually one user turn

    def as_chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Rollouts:
    """Completions of a batch of prompts, as the sampler produced them.

    `sampler_logprobs_BT` is log μ(y_t | s_t) under the distribution the learner also models:
    softmax(logits / temperature) over the full vocabulary (top-p only truncates what is drawn).
    """

    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    completion_ids_BT: torch.Tensor  # long
    loss_mask_BT: torch.Tensor  # float, 1 on generated tokens (the EOS included)
    sampler_logprobs_BT: torch.Tensor  # float32
    texts: list[str] = field(default_factory=list)
    weight_version: int = 0
    # The engine's own figures of the call (speculative rollouts: acceptance length, drafts
    # proposed and accepted: engine/samplers/speculative_sampler.py); replicas' values are averaged.
    sampler_stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    def num_tokens(self) -> int:
        return int(self.loss_mask_BT.sum().item())

    def select(self, rows: list[int]) -> "Rollouts":
        """The sub-batch of the given rows (used to route rows to their teachers)."""
        index = torch.tensor(rows, dtype=torch.long)
        return Rollouts(
            prompts=[self.prompts[i] for i in rows],
            prompt_ids=[self.prompt_ids[i] for i in rows],
            completion_ids_BT=self.completion_ids_BT[index],
            loss_mask_BT=self.loss_mask_BT[index],
            sampler_logprobs_BT=self.sampler_logprobs_BT[index],
            texts=[self.texts[i] for i in rows] if self.texts else [],
            weight_version=self.weight_version,
        )


@dataclass
class TrainBatch:
    """What the learner needs for one optimizer step (all micro-batches of it)."""

    prompt_ids: list[list[int]]
    completion_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    sampler_logprobs_BT: torch.Tensor
    advantages_BT: torch.Tensor

    teacher_full_logprobs_BTV: torch.Tensor | None = None  # only for the full-vocabulary loss (one objective)
    # Per-teacher OPD (algo/objectives.py: PerTeacherOPD): each teacher's rows and what it sent.
    teacher_parts: tuple["TeacherPart", ...] = ()
    # The drift gate's IS correction, (tis | mis, cap), once switched on (algo/drift.py; None: off).
    is_correction: tuple[str, float] | None = None
    # The teachers' own answers, learned by likelihood beside the OPD rows (loss.teacher_answers):
    # their advantages_BT hold each token's weight (the recipe's coef), their sampler logprobs the teacher's.
    answers: "TrainBatch | None" = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def to(self, device: torch.device | str) -> "TrainBatch":
        full = self.teacher_full_logprobs_BTV
        return TrainBatch(self.prompt_ids, self.completion_ids_BT.to(device), self.loss_mask_BT.to(device),
                          self.sampler_logprobs_BT.to(device), self.advantages_BT.to(device),
                          None if full is None else full.to(device),
                          tuple(part.to(device) for part in self.teacher_parts), self.is_correction,
                          None if self.answers is None else self.answers.to(device))

    def with_payloads(self, payloads: Sequence[Any], heads: dict[str, torch.Tensor] | None = None) -> "TrainBatch":
        """The batch with each teacher part's payload put together from the replicas' pieces in
        `payloads` (the extra arguments of `train_step`: on Ray, ObjectRefs Ray resolved in the
        learner's process), and a hidden-state payload given its teacher's output head."""
        parts = tuple(part.attach(payloads, (heads or {}).get(part.teacher)) for part in self.teacher_parts)
        return replace(self, teacher_parts=parts)

    def micro_batches(self, size: int) -> list["TrainBatch"]:
        """Consecutive slices of `size` rows, each trimmed to its longest completion."""
        out = []
        for start in range(0, len(self), size):
            rows = slice(start, start + size)
            width = max(1, int(self.loss_mask_BT[rows].sum(dim=1).max().item()))
            full = self.teacher_full_logprobs_BTV
            out.append(TrainBatch(
                prompt_ids=self.prompt_ids[rows],
                completion_ids_BT=self.completion_ids_BT[rows, :width],
                loss_mask_BT=self.loss_mask_BT[rows, :width],
                sampler_logprobs_BT=self.sampler_logprobs_BT[rows, :width],
                advantages_BT=self.advantages_BT[rows, :width],
                teacher_full_logprobs_BTV=None if full is None else full[rows, :width],
                teacher_parts=tuple(p.restrict(rows.start, rows.stop, width) for p in self.teacher_parts),
                is_correction=self.is_correction,
            ))
        return out


# -- What a teacher sends for its rows besides the [B, T] logprobs of the sampled tokens. Each
# payload travels from the teacher's actor to the learner by reference (never through the driver).

@dataclass
class TeacherTopK:
    """The teacher's k most likely ids at every completion position, their logprobs, and the
    logprob of everything else (the tail bucket, algo/topk.py)."""

    ids_BTK: torch.Tensor  # int32 on the way (half the bytes of int64), .long() where used
    logprobs_BTK: torch.Tensor  # float32
    tail_logprobs_BT: torch.Tensor  # float32, log(1 − Σ_k p)
    # Positions with a signal (a teacher of another tokenizer: its 1:1 chunks; None: every position).
    signal_BT: torch.Tensor | None = None

    FIELDS = ("ids_BTK", "logprobs_BTK", "tail_logprobs_BT", "signal_BT")

    def _map(self, fn) -> "TeacherTopK":
        return TeacherTopK(*(None if getattr(self, f) is None else fn(getattr(self, f)) for f in self.FIELDS))

    def select(self, index: list[int], width: int) -> "TeacherTopK":
        return self._map(lambda t: t[index, :width])

    def to(self, device) -> "TeacherTopK":
        return self._map(lambda t: t.to(device))

    @staticmethod
    def cat(parts: list["TeacherTopK"]) -> "TeacherTopK":
        return TeacherTopK(*(None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts])
                             for f in TeacherTopK.FIELDS))


@dataclass
class TeacherFull:
    """The teacher's whole next-token distribution at every completion position, [B, T, V] logprobs."""

    logprobs_BTV: torch.Tensor

    def select(self, index: list[int], width: int) -> "TeacherFull":
        return TeacherFull(self.logprobs_BTV[index, :width])

    def to(self, device) -> "TeacherFull":
        return TeacherFull(self.logprobs_BTV.to(device))

    @staticmethod
    def cat(parts: list["TeacherFull"]) -> "TeacherFull":
        return TeacherFull(torch.cat([p.logprobs_BTV for p in parts]))


@dataclass
class TeacherHidden:
    """The teacher's final hidden states (after its final norm) at every completion position,
    [B, T, H]: with its output head W [V, H] the learner recovers log π_T = log_softmax(h Wᵀ / τ)
    exactly, chunk by chunk over the vocabulary (algo/chunked_kl.py). `head_VH` is attached on the
    learner (shipped once per run, not per step)."""

    hidden_BTH: torch.Tensor
    temperature: float = 1.0
    head_VH: torch.Tensor | None = None

    def select(self, index: list[int], width: int) -> "TeacherHidden":
        return replace(self, hidden_BTH=self.hidden_BTH[index, :width])

    def to(self, device) -> "TeacherHidden":
        head = None if self.head_VH is None else self.head_VH.to(device)
        return replace(self, hidden_BTH=self.hidden_BTH.to(device), head_VH=head)

    @staticmethod
    def cat(parts: list["TeacherHidden"]) -> "TeacherHidden":
        return replace(parts[0], hidden_BTH=torch.cat([p.hidden_BTH for p in parts]))


@dataclass
class TeacherPart:
    """The rows of a batch that one teacher scored (ascending batch indices) and its payload for
    them, rows in the same order. On the way to the learner `payload` is None and `slots` says which
    of `train_step`'s extra arguments hold its pieces (one per teacher replica, in row order)."""

    teacher: str
    rows: tuple[int, ...]
    payload: Any = None  # TeacherTopK | TeacherFull | TeacherHidden | None (sampled-token terms)
    slots: tuple[int, ...] = ()

    def attach(self, payloads: Sequence[Any], head: torch.Tensor | None) -> "TeacherPart":
        if not self.slots:
            return self
        pieces = [payloads[i] for i in self.slots]
        payload = type(pieces[0]).cat(pieces)
        if isinstance(payload, TeacherHidden):
            if head is None:
                raise ValueError(f"teacher {self.teacher!r} sent hidden states but the learner has no output head "
                                 f"of it (set_teacher_head)")
            payload = replace(payload, head_VH=head)
        return TeacherPart(self.teacher, self.rows, payload)

    def restrict(self, start: int, stop: int, width: int) -> "TeacherPart":
        """The part inside batch rows [start, stop), re-indexed from `start`, trimmed to `width`."""
        keep = [i for i, row in enumerate(self.rows) if start <= row < stop]
        payload = None if self.payload is None else self.payload.select(keep, width)
        return TeacherPart(self.teacher, tuple(self.rows[i] - start for i in keep), payload, self.slots)

    def to(self, device) -> "TeacherPart":
        return TeacherPart(self.teacher, self.rows, None if self.payload is None else self.payload.to(device),
                           self.slots)


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor inside `value` (tensors, dataclasses, lists, tuples, dicts): what
    receiving it moved, give or take the pickling's framing."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(value, f)) for f in value.__dataclass_fields__)
    return 0


def pad_right(tensors: list[torch.Tensor], width: int, value: float = 0) -> torch.Tensor:
    """Stack [B_i, T_i] tensors into [ΣB_i, width], padding each on the right."""
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors]
    return torch.cat(padded, dim=0)


def concat_rollouts(parts: list[Rollouts], pad_id: int) -> Rollouts:
    """One Rollouts from several (e.g. one per sampler replica), in order."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.completion_ids_BT.shape[1] for p in parts)
    return Rollouts(
        prompts=[x for p in parts for x in p.prompts],
        prompt_ids=[x for p in parts for x in p.prompt_ids],
        completion_ids_BT=pad_right([p.completion_ids_BT for p in parts], width, pad_id),
        loss_mask_BT=pad_right([p.loss_mask_BT for p in parts], width),
        sampler_logprobs_BT=pad_right([p.sampler_logprobs_BT for p in parts], width),
        texts=[x for p in parts for x in p.texts],
        weight_version=min(p.weight_version for p in parts),
        sampler_stats={k: sum(p.sampler_stats.get(k, 0.0) for p in parts) / len(parts)
                       for k in sorted({k for p in parts for k in p.sampler_stats})},
    )
