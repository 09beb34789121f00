"""The reference model held in the gradient buffers, instead of a second copy of the weights.

Between `optimizer.step()` and the next backward, every `p.grad` is idle memory of exactly the
shape and dtype of `p`. A step therefore goes:

1. copy the reference weights (a host copy, pinned when CUDA is there) into the `.grad` buffers;
2. compute the reference logprobs of *every* micro-batch of the step with
   `torch.func.functional_call(model, {name: p.grad}, ...)` — the same module, other tensors;
3. zero the buffers and run the step's backward passes into them as usual.

The reference costs one host→device copy per step and no device memory. What breaks it:
freeing the buffers (`zero_grad(set_to_none=True)`, torch's default), optimizer-in-backward
hooks, or anything that reads `.grad` between the optimizer step and the backward (it would
see reference weights). Frozen parameters have no buffer: they never change, so their current
value *is* the reference value. Tied parameters appear once in `named_parameters()` and share
one buffer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


class GradBufferReference:
    """Reference weights for `model`, kept on the host and swapped through the .grad buffers."""

    def __init__(self, model: nn.Module, reference: dict[str, torch.Tensor] | None = None):
        self.model = model
        self.trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        source = reference if reference is not None else {n: p.detach() for n, p in self.trainable.items()}
        pin = torch.cuda.is_available()
        self.host = {n: source[n].detach().to("cpu", copy=True) for n in self.trainable}
        if pin:
            self.host = {n: t.pin_memory() for n, t in self.host.items()}
        for p in self.trainable.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _check_buffers(self) -> None:
        missing = [n for n, p in self.trainable.items() if p.grad is None]
        if missing:
            raise RuntimeError(f"gradient buffers were freed ({missing[:3]}...): use zero_grad(set_to_none=False)")

    @contextmanager
    def reference_weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """Inside the block, a name → tensor map of the reference weights (the .grad buffers,
        frozen parameters as they are) for `functional_call`. On exit the buffers are zeroed,
        ready for backward — also when the block raises, so a failed reference pass never
        leaves reference weights where gradients are expected."""
        self._check_buffers()
        try:
            with torch.no_grad():
                for name, p in self.trainable.items():
                    p.grad.copy_(self.host[name], non_blocking=True)
            mapping = {n: p.grad for n, p in self.trainable.items()}
            mapping.update({n: p for n, p in self.model.named_parameters() if not p.requires_grad})
            yield mapping
        finally:
            with torch.no_grad():
                for p in self.trainable.values():
                    p.grad.zero_()

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())
