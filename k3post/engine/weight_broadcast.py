"""Weights from the learner to its sampler actors without Ray's object store.

`sampling.weight_transport: collective` — a broadcast group. Rank 0 is the learner, ranks 1..N its sampler
replicas; after each step the learner broadcasts every tensor of `weights()` (each tied storage
once) and every sampler receives them and loads them through its own `load_weights`, so an HF
and a vLLM sampler apply them exactly as they apply weights from the object store. On GPUs the
group is NCCL: the tensors go GPU to GPU (over NVLink within a node) and never touch host
memory or Ray's object store; on CPUs it is gloo, so the same path runs in CI.

The group is a stateless pair of (TCPStore, ProcessGroup) built directly, not torch's default
process group: a vLLM engine in the same process already owns that one.

The tensors' names, shapes and dtypes (the manifest) are fixed when the group forms: the
learner states them, each sampler allocates its receive buffers from them, and a broadcast
whose tensors differ from the manifest is refused before anything is sent.

`sampling.weight_transport: cuda_ipc` — colocated actors on one GPU, where NCCL cannot go (it
allows one rank per GPU). The learner hands out CUDA IPC handles of its live weight tensors
(`torch.multiprocessing.reductions.reduce_tensor`: an allocation handle, offset, shape, dtype —
a few hundred bytes per tensor); each sampler opens them, which maps the learner's memory into
its own address space, and copies device to device into its model. Nothing is copied through
the host, and the learner's tensors are not touched (sync happens between steps, while the
learner is idle).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

GROUP_TIMEOUT = datetime.timedelta(minutes=10)  # a replica that never joins or answers fails the call


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"


def as_tensor(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))


def manifest_of(weights: dict[str, torch.Tensor | np.ndarray]) -> list[TensorInfo]:
    """What a broadcast of `weights` sends, in order."""
    out = []
    for name, value in weights.items():
        t = as_tensor(value)
        out.append(TensorInfo(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
    return out


class WeightGroup:
    """One process's end of the broadcast group (rank 0 sends, the others receive)."""

    def __init__(self, host: str, port: int, world_size: int, rank: int, backend: str,
                 manifest: list[TensorInfo]):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weight broadcast backend must be nccl or gloo, not {backend!r}")
        self.rank, self.backend, self.manifest = rank, backend, manifest
        # NCCL: this process's current GPU (under Ray, the one GPU the actor sees).
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        store = dist.PrefixStore("k3post-weights", dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=GROUP_TIMEOUT))
        if backend == "nccl":
            torch.cuda.set_device(self.device)
            self.group = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def send(self, weights: dict[str, torch.Tensor | np.ndarray]) -> int:
        """Broadcast `weights` (rank 0); returns the bytes sent to each receiver."""
        if manifest_of(weights) != self.manifest:
            raise ValueError("the learner's weights no longer match the manifest the weight group was formed with")
        sent = 0
        with torch.no_grad():
            for value in weights.values():
                tensor = as_tensor(value).to(self.device).contiguous()
                self._broadcast(tensor)
                sent += tensor.numel() * tensor.element_size()
        return sent

    def close(self) -> None:
        """Leave the group (receivers first, then the sender, whose process hosts the store)."""
        self.group.shutdown()

    def receive(self) -> dict[str, torch.Tensor]:
        """The next broadcast (ranks ≥ 1), in fresh tensors on this group's device."""
        out = {}
        for info in self.manifest:
            tensor = torch.empty(info.shape, dtype=getattr(torch, info.dtype), device=self.device)
            self._broadcast(tensor)
            out[info.name] = tensor
        return out


def ipc_handles(weights: dict[str, torch.Tensor | np.ndarray]) -> dict[str, tuple]:
    """CUDA IPC handles of `weights`, which must be CUDA tensors that stay alive (live parameters)."""
    from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

    on_host = [name for name, t in weights.items() if not (isinstance(t, torch.Tensor) and t.is_cuda)]
    if on_host:
        raise ValueError(f"sampling.weight_transport: cuda_ipc needs the learner's weights on its GPU; {on_host[:3]} "
                         f"are host arrays (LoRA merges its adapters on the host): use collective or object_store")
    return {name: reduce_tensor(t) for name, t in weights.items()}


def open_ipc_handles(handles: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Tensors over the memory the handles name (another process's, on this same GPU)."""
    return {name: rebuild(*args) for name, (rebuild, args) in handles.items()}


class WeightGroupMember:
    """What both ends share: leaving the group at the end of a run."""

    def leave_weight_group(self) -> None:
        group = getattr(self, "_weight_group", None)
        if group is not None:
            group.close()
            self._weight_group = None


class BroadcastSender(WeightGroupMember):
    """Mixin for the learner: form the group as rank 0 and send `weights()` after each step;
    or hand out CUDA IPC handles of them."""

    def weight_manifest(self) -> list[TensorInfo]:
        return manifest_of(self.weights())

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        self._weight_group = WeightGroup(host, port, world_size, 0, backend, self.weight_manifest())

    def broadcast_weights(self) -> int:
        return self._weight_group.send(self.weights())

    def weight_ipc_handles(self) -> dict[str, tuple]:
        torch.cuda.synchronize()  # the optimizer step's writes land before another process reads
        return ipc_handles(self.weights())


class BroadcastReceiver(WeightGroupMember):
    """Mixin for samplers: join the group as rank ≥ 1 and load each broadcast as weights `version`."""

    def join_weight_group(self, host: str, port: int, world_size: int, rank: int, backend: str,
                          manifest: list[TensorInfo]) -> None:
        self._weight_group = WeightGroup(host, port, world_size, rank, backend, manifest)

    def receive_weights(self, version: int) -> int:
        return self.load_weights(self._weight_group.receive(), version)

    def load_ipc_weights(self, handles: dict[str, tuple], version: int) -> int:
        shared = open_ipc_handles(handles)
        try:
            return self.load_weights(shared, version)
        finally:
            torch.cuda.synchronize()  # copies done before the mapping goes (and the learner moves on)
            del shared
