"""The reference model of a sharded learner (REFERENCE §4.3, DESIGN "Sharded learner").

`ShardedGradBufferRef` — the grad-buffer trick, per rank. Each rank keeps only *its shards* of
the reference weights on the host (pinned where CUDA exists). A step goes:

1. the reference shards are copied into this rank's sharded gradient buffers (`p.grad`, a
   DTensor of the same sharding and master dtype as `p`). On GPUs the copy is started on a
   side stream with `non_blocking=True` right after the previous optimizer step (`prefetch`),
   so it overlaps whatever runs between two learner steps (sampling, scoring, weight sync) and
   the step only waits on an event;
2. the local shards of parameters and buffers are swapped (device to device, through a 64 MiB
   scratch buffer, piece by piece): the parameters now hold the reference, the buffers the policy;
3. the reference forward runs for every micro-batch of this rank, in eval mode (model/training/modes.py:
   no dropout), through the normal FSDP forward (its all-gathers read the swapped shards);
   `torch.func.functional_call` cannot be used: FSDP's hooks gather FSDP's own storage, not the
   tensors passed in;
4. `model.reshard()` (the root keeps its parameters gathered after a forward, and a gathered
   parameter has no local shard to put back), the policy shards are copied back from the
   buffers (one copy, not a swap: the reference is not needed there any more) and the buffers
   zeroed: FSDP2 *accumulates* into an existing sharded grad, so they must be zero for the
   backward passes. The copy back runs whatever raised before it (a reference forward, the
   reshard, the swap part way through the parameters), and the zeroing only after it: the
   buffers then hold the policy's only copy.

Device memory: none beyond the 64 MiB scratch buffer (the reference lives in memory the gradients
need anyway). Host memory: one shard of the model per rank.
`ShardedCopyRef` is the baseline it is measured against: a second, frozen sharded model.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from k3post.model.training.fsdp import local
from k3post.model.training.modes import eval_mode
from k3post.model.quant.qat import set_fake_quant
from k3post.types import TrainBatch

Scorer = Callable[[nn.Module, TrainBatch], torch.Tensor]  # (model, micro-batch) -> ref_logprobs_BT


SCRATCH_ELEMENTS = 2**24  # 64 MiB in fp32: the swap's only device memory beyond the model's


def swap_through(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor) -> None:
    """Exchange the contents of the contiguous tensors `a` and `b` in place, one scratch-sized
    piece at a time. A scratch as large as the largest shard would hold that much device memory
    for the whole run (a 152k-vocabulary embedding is 2 GiB of fp32 at one rank: all of what the
    reference once added to the no-reference peak); pieces cost only more copy launches."""
    size = scratch.numel()
    for piece_a, piece_b in zip(a.view(-1).split(size), b.view(-1).split(size)):  # views: in place
        tmp = scratch[: piece_a.numel()]
        tmp.copy_(piece_a)
        piece_a.copy_(piece_b)
        piece_b.copy_(tmp)


class ShardedGradBufferRef:
    """Reference shards on the host, swapped through the sharded .grad buffers of `model`."""

    lives_in_grad_buffers = True  # the learner keeps .grad between steps (zero_grad(set_to_none=False))

    def __init__(self, model: nn.Module, score: Scorer):
        self.model, self.score = model, score
        self.params = [p for p in model.parameters() if p.requires_grad]
        device = local(self.params[0]).device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        pin = device.type == "cuda"
        self.host = [local(p).detach().to("cpu", copy=True) for p in self.params]
        if pin:
            self.host = [t.pin_memory() for t in self.host]
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        size = min(SCRATCH_ELEMENTS, max(local(p).numel() for p in self.params))
        self.scratch = {dt: torch.empty(size, dtype=dt, device=device) for dt in {p.dtype for p in self.params}}
        self.ready: torch.cuda.Event | None = None
        self.prefetched = False

    def _check_buffers(self) -> None:
        if any(p.grad is None for p in self.params):
            raise RuntimeError("gradient buffers were freed: use zero_grad(set_to_none=False)")

    @torch.no_grad()
    def prefetch(self) -> None:
        """Start copying the reference shards into the grad buffers (call when the buffers are
        idle: after the optimizer step). On GPUs the copy runs on a side stream."""
        self._check_buffers()
        if self.stream is None:
            for p, h in zip(self.params, self.host):
                local(p.grad).copy_(h)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())  # the optimizer step is done with .grad
            with torch.cuda.stream(self.stream):
                for p, h in zip(self.params, self.host):
                    local(p.grad).copy_(h, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record()
        self.prefetched = True

    @torch.no_grad()
    def logprobs(self, micro_batches: list[TrainBatch], pad_id: int, temperature: float) -> list[torch.Tensor]:
        """Reference logprobs of every micro-batch (this rank's); the buffers are zero after."""
        if not self.prefetched:
            self.prefetch()
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)
        with self._reference_in_parameters(), eval_mode(self.model):
            return [self.score(self.model, mb) for mb in micro_batches]

    @contextmanager
    def _reference_in_parameters(self) -> Iterator[None]:
        """Inside the block the parameters' local shards hold the reference (the buffers the
        policy). On exit, whatever raised (a reference forward, the root's reshard, the swap part
        way through the parameters), the policy goes back into every parameter that was swapped,
        and only then are the buffers zeroed: zeroing first would zero the policy's only copy.
        A parameter counts as swapped once its whole `swap_through` returned; a copy failing inside
        one parameter's pieces (a device fault, after which nothing on the device is trusted) is
        not undone."""
        swapped: list[nn.Parameter] = []
        try:
            try:
                for p in self.params:
                    swap_through(local(p), local(p.grad), self.scratch[p.dtype])
                    swapped.append(p)
                yield
            finally:
                try:
                    self.model.reshard()
                finally:
                    self._restore_policy(swapped)
        finally:
            for p in self.params:
                p.grad.zero_()
            self.prefetched, self.ready = False, None

    @staticmethod
    def _restore_policy(params: list[nn.Parameter]) -> None:
        """The policy back into the parameters: one copy from the buffers, not a swap (the
        buffers are zeroed next; the reference stays on the host for the next step)."""
        for p in params:
            local(p).copy_(local(p.grad))

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host)


class ShardedCopyRef:
    """A second, frozen sharded copy of the initial model (the memory baseline). Under FP8 QAT
    it is prepared like the learner's model (engine/sharded/sharded_learner.py) and follows the learner's
    fake-quant switch: the reference is the fake-quantised model, as for the grad-buffer kind."""

    def __init__(self, model: nn.Module, score: Scorer):
        self.model, self.score = model.requires_grad_(False), score

    def set_fake_quant(self, enabled: bool) -> None:
        set_fake_quant(self.model, enabled)

    def prefetch(self) -> None:
        pass

    @torch.no_grad()
    def logprobs(self, micro_batches: list[TrainBatch], pad_id: int, temperature: float) -> list[torch.Tensor]:
        with eval_mode(self.model):
            out = [self.score(self.model, mb) for mb in micro_batches]
        self.model.reshard()
        return out
