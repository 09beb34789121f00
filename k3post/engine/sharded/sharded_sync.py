"""Weight sync from a sharded learner to its samplers (the sending end, on every rank).

The transports are engine/transport/weight_broadcast.py's; what changes is where the tensors come from.
Each bucket of full tensors is all-gathered by the whole learner group (model/training/sharded_weights.py),
and rank 0 — the only learner rank in the weight group — broadcasts it to the samplers before
the next bucket is gathered, so no device holds the whole model at once. The manifest comes
from the global shapes of the sharded parameters, with no gather. What is sent is
`_weight_sources()`: the student, then (with `draft.speculate`) the draft head under `mtp.`
names. The other learner ranks take part in the gathers only; every method here is called on
every rank (a no-op where not rank 0).

Under FP8 rollouts (`sampling.weights: fp8`, once fake quantisation is on) rank 0 turns each
quantised Linear's gathered weight into its e4m3 bytes and scales (model/quant/fp8_sync.py) before it
sends or checksums it, exactly as the one-process learner does with its own weights.

`cuda_ipc` needs the learner's full weights alive on its GPU. A group of several ranks never
has them (it is refused: use `collective`); a group of one keeps them in export buffers on its
GPU (engine/sharded/sharded_learner.py: `_device_weights`), whose handles are made once.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from k3post.engine.sharded.rank import is_rank0
from k3post.engine.transport.weight_broadcast import BroadcastSender, TensorInfo
from k3post.engine.transport.weight_check import Checksum, checked_names, checksum
from k3post.model.quant.fp8_sync import fp8_payload, scale_name
from k3post.model.training.sharded_weights import _unique_entries, iter_full_buckets


class ShardedBroadcastSender(BroadcastSender):
    """Overrides the learner's end of the weight transports for a sharded `self.model`."""

    def _weight_sources(self) -> list[tuple[str, torch.nn.Module]]:
        """(name prefix, sharded module) pairs, in the order they are sent."""
        return [("", self.model)]

    def _entries(self) -> list[tuple[str, torch.Tensor]]:
        return [(prefix + name, t) for prefix, module in self._weight_sources() for name, t in _unique_entries(module)]

    def weight_manifest(self) -> list[TensorInfo]:
        dtype = self.export_dtype()
        return [TensorInfo(name, tuple(t.shape), str(dtype).removeprefix("torch.")) for name, t in self._entries()]

    def open_weight_store(self, host: str, world_size: int) -> int | None:
        return super().open_weight_store(host, world_size) if is_rank0() else None

    def join_weight_group(self, world_size: int, backend: str) -> None:
        if is_rank0():
            super().join_weight_group(world_size, backend)

    def _as_sent(self, name: str, full: torch.Tensor) -> dict:
        """What the samplers get of one gathered tensor: itself, or its FP8 bytes and scale."""
        return fp8_payload({name: full}, self.fp8_layers()) if self.sends_fp8() else {name: full}

    def broadcast_weights(self) -> int:
        """Gather and send bucket by bucket; returns the bytes each sampler received (rank 0)."""
        group = getattr(self, "_weight_group", None) if is_rank0() else None
        sent = 0
        if group is not None:
            group.announce(int(self.sends_fp8()))  # which manifest follows (when the group has two)
        for prefix, module in self._weight_sources():
            for bucket in iter_full_buckets(module, self.spec.weight_bucket_mb * 2**20, self.export_dtype()):
                for name, full in bucket:
                    if group is None:
                        continue
                    for tensor in self._as_sent(prefix + name, full.to(group.device)).values():
                        tensor = torch.as_tensor(tensor).contiguous()
                        group._broadcast(tensor)
                        sent += tensor.numel() * tensor.element_size()
        if group is not None:
            group._settle()
        return sent

    def weight_checksums(self, version: int) -> dict[str, Checksum]:
        """The checked tensors only, gathered by every rank (in the same order: the gathers are
        collective) and checksummed on rank 0 in the export dtype (or as FP8 bytes and scales),
        as the samplers received them; {} on the other ranks."""
        entries = self._entries()
        manifest = self.weight_manifest() if not self.sends_fp8() else self.fp8_weight_manifest()
        chosen = set(checked_names([info.name for info in manifest], version))
        out = {}
        for name, t in entries:
            if not chosen.intersection((name, scale_name(name))):
                continue
            with torch.no_grad():
                full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            if is_rank0():
                for sent, value in self._as_sent(name, full.to(self.export_dtype())).items():
                    if sent in chosen:
                        out[sent] = checksum(value)
        return out

    def weight_ipc_handles(self) -> dict[str, tuple]:
        if self.rank.world_size > 1:
            raise ValueError("sampling.weight_transport: cuda_ipc needs a learner of one rank (a sharded group "
                             "never holds its full weights); use collective")
        return super().weight_ipc_handles()

    def leave_weight_group(self) -> None:
        if is_rank0():
            super().leave_weight_group()



