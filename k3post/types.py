"""The data that travels along the arrows of one OPD step (docs/architecture.md).

Shapes use suffixes: `_B` batch, `_T` completion position. Every per-token tensor is aligned
with `completion_ids_BT`: entry [b, t] is about completion token t of row b (the token itself,
predicted from the prompt and the completion tokens before it). Padding positions have
`loss_mask_BT == 0` and hold `pad` ids / zero logprobs.

One spelling everywhere: `logprobs` with a role prefix (`sampler_`, `teacher_`, `ref_`,
`student_`) and one mask, `loss_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    teacher_full_logprobs_BTV: torch.Tensor | None = None  # only for the full-vocabulary loss

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def to(self, device: torch.device | str) -> "TrainBatch":
        full = self.teacher_full_logprobs_BTV
        return TrainBatch(self.prompt_ids, self.completion_ids_BT.to(device), self.loss_mask_BT.to(device),
                          self.sampler_logprobs_BT.to(device), self.advantages_BT.to(device),
                          None if full is None else full.to(device))

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
            ))
        return out


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
    )
