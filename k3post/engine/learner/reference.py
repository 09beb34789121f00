"""Where the learner's reference model comes from: one small class per strategy.

Each computes the reference logprobs of every micro-batch of a step, *before* the step's first
backward (the grad-buffer strategy needs the buffers free), in eval mode (model/training/modes.py: no
dropout, so the reference is a function of its weights; the policy's mode is restored after).
`ref_logprobs_BT` are aligned with the completion tokens like every other logprob.

The reference runs without gradients, so each distinct prompt of a micro-batch (the `sampling.n`
samples of one prompt) is encoded once and its completions scored as continuations of its keys
and values (model/scoring/prefix_scoring.py: `grouped_logprobs`, equal to `completion_logprobs`).
"""

from __future__ import annotations

import torch
from torch import nn

from k3post.config.schema import ModelSpec
from k3post.model.loading.load import load_model
from k3post.model.scoring.prefix_scoring import grouped_logprobs
from k3post.model.training.grad_buffer import GradBufferReference
from k3post.model.training.modes import eval_mode
from k3post.model.quant.qat import prepare_fp8_qat, set_fake_quant
from k3post.types import TrainBatch


class _LogprobsModule(nn.Module):
    """Wraps `grouped_logprobs` as a forward pass so `functional_call` can run it with other
    parameter tensors (its parameter names are the student's, prefixed with `model.`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, mb: TrainBatch, pad_id: int, temperature: float) -> torch.Tensor:
        return grouped_logprobs(self.model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                temperature)


class GradBufferRef:
    """Reference weights held on the host and swapped through the idle .grad buffers."""

    lives_in_grad_buffers = True  # the learner keeps .grad between steps (zero_grad(set_to_none=False))

    def __init__(self, model: nn.Module):
        self.buffers = GradBufferReference(model)
        self.scorer = _LogprobsModule(model)

    @torch.no_grad()
    def logprobs(self, micro_batches: list[TrainBatch], pad_id: int, temperature: float) -> list[torch.Tensor]:
        with self.buffers.reference_weights() as weights, eval_mode(self.scorer):
            params = {f"model.{name}": t for name, t in weights.items()}
            return [torch.func.functional_call(self.scorer, params, (mb, pad_id, temperature))
                    for mb in micro_batches]


class CopyRef:
    """A second, frozen copy of the initial model (the memory baseline the trick is measured against).

    Under FP8 QAT (`qat`) the copy is prepared as the learner prepares its model and follows the
    learner's fake-quant switch (`set_fake_quant`, called each step): the reference is the model
    the learner trains — the fake-quantised forward at the reference weights — as it is for the
    grad-buffer kind, which runs the learner's own fake-quantised modules."""

    def __init__(self, spec: ModelSpec, device: str = "cpu", qat: bool = False):
        self.model = load_model(spec)[0].requires_grad_(False).to(device)
        if qat:
            prepare_fp8_qat(self.model)

    def set_fake_quant(self, enabled: bool) -> None:
        set_fake_quant(self.model, enabled)

    @torch.no_grad()
    def logprobs(self, micro_batches: list[TrainBatch], pad_id: int, temperature: float) -> list[torch.Tensor]:
        with eval_mode(self.model):
            return [grouped_logprobs(self.model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                     temperature) for mb in micro_batches]


class AdapterDisabledRef:
    """With LoRA the reference is the base model: the same module with the adapters switched off."""

    def __init__(self, peft_model: nn.Module, model: nn.Module):
        self.peft_model, self.model = peft_model, model

    @torch.no_grad()
    def logprobs(self, micro_batches: list[TrainBatch], pad_id: int, temperature: float) -> list[torch.Tensor]:
        with self.peft_model.disable_adapter(), eval_mode(self.peft_model):
            return [grouped_logprobs(self.model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                     temperature) for mb in micro_batches]
