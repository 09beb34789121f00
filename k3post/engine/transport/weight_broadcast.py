"""Weights from the learner to its sampler actors without Ray's object store.

`sampling.weight_transport: collective` — a broadcast group. Rank 0 is the learner, ranks 1..N
its sampler replicas; after each step the learner broadcasts every tensor of `weights()` (each
tied storage once) and every sampler receives them and loads them through its own
`load_weights`, so an HF and a vLLM sampler apply them exactly as they apply weights from the
object store. On GPUs the group is NCCL: the tensors go GPU to GPU (over NVLink within a node)
and never touch host memory or Ray's object store; on CPUs it is gloo, so the same path runs in
CI.

The group is a stateless pair of (TCPStore, ProcessGroup) built directly, not torch's default
process group: a vLLM engine in the same process already owns that one. The learner opens the
store on a port the OS picks (no race for a "free" port) and the samplers connect to it.

The tensors' names, shapes and dtypes (the manifest) are fixed when the group forms: the
learner states them, each sampler allocates its receive buffers from them, and a send whose
tensors differ from the manifest raises before its first broadcast. Under FP8 rollouts
(`sampling.weights: fp8`) the learner sends one of two forms, the full weights or, once its fake
quantisation is on, the FP8 payload (model/quant/fp8_sync.py); the group then knows both manifests and
each send starts with a one-byte broadcast that says which follows.

`sampling.weight_transport: cuda_ipc` — colocated actors on one GPU, where NCCL cannot go (it
allows one rank per GPU). The learner hands out CUDA IPC handles of its live weight tensors
(`torch.multiprocessing.reductions.reduce_tensor`: an allocation handle, offset, shape, dtype —
a few hundred bytes per tensor); each sampler opens them, which maps the learner's memory into
its own address space, and copies device to device into its model. Handles are made once and
the mapping is kept: the parameters live at the same addresses for the whole run (optimizer
steps write in place), so each later sync is only the learner's `synchronize` and the
samplers' copies (torch wraps a tensor's memory anew every time it is shared, so sharing on
every step would pile up its bookkeeping). If the learner's tensors ever move, new handles are
made and the samplers map those.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from k3post.engine.transport.gloo_interface import bind_gloo_towards
from k3post.engine.transport.weight_check import Checksum, checked_names, checksums_of
from k3post.model.quant.fp8_sync import fp8_payload

# The store's and gloo's timeout: a replica that never joins or answers fails the call instead of
# hanging. NCCL keeps torch's own default (10 minutes).
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
STORE_PREFIX = "k3post-weights"


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


def fp8_manifest(manifest: list[TensorInfo], layers: list[str]) -> list[TensorInfo]:
    """The manifest of the FP8 payload of weights that `manifest` describes (`fp8_payload` run on
    meta tensors: the same function decides both, with no data)."""
    meta = {i.name: torch.empty(i.shape, dtype=getattr(torch, i.dtype), device="meta") for i in manifest}
    return manifest_of(fp8_payload(meta, layers))


def open_store(host: str, port: int, world_size: int, rank: int) -> dist.TCPStore:
    """Rank 0 hosts the store (port 0: the OS picks one, read back as `.port`); the others join."""
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=GROUP_TIMEOUT,
                         wait_for_workers=False)


class WeightGroup:
    """One process's end of the broadcast group (rank 0 sends, the others receive); with an
    `fp8_manifest`, each send is of either manifest and starts with the form's index."""

    def __init__(self, store: dist.TCPStore, world_size: int, rank: int, backend: str, manifest: list[TensorInfo],
                 fp8_manifest: list[TensorInfo] | None = None):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weight broadcast backend must be nccl or gloo, not {backend!r}")
        self.backend = backend
        self.manifests = [manifest] if fp8_manifest is None else [manifest, fp8_manifest]
        # NCCL: this process's current GPU (under Ray, the one GPU the actor sees).
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        if backend == "nccl":
            torch.cuda.set_device(self.device)
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            bind_gloo_towards(store.host)  # not loopback where the host name says so (engine/transport/gloo_interface.py)
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, GROUP_TIMEOUT)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def announce(self, form: int = 0) -> int:
        """With two manifests, broadcast which one the send follows (rank 0's `form`); returns it."""
        if len(self.manifests) == 1:
            return 0
        header = torch.tensor([form], dtype=torch.uint8, device=self.device)
        self._broadcast(header)
        return int(header.item())

    def _settle(self) -> None:
        """On NCCL `wait()` only orders the streams: block until the bytes have arrived (or
        left), so a sync that returns is complete and its time is the transfer's."""
        if self.backend == "nccl":
            torch.cuda.current_stream(self.device).synchronize()

    def send(self, weights: dict[str, torch.Tensor | np.ndarray]) -> int:
        """Broadcast `weights` (rank 0); returns the bytes sent to each receiver."""
        manifest = manifest_of(weights)
        if manifest not in self.manifests:
            raise ValueError("the learner's weights no longer match the manifest the weight group was formed with")
        self.announce(self.manifests.index(manifest))
        sent = 0
        with torch.no_grad():
            for value in weights.values():
                tensor = as_tensor(value).to(self.device).contiguous()
                self._broadcast(tensor)
                sent += tensor.numel() * tensor.element_size()
        self._settle()
        return sent

    def receive(self) -> dict[str, torch.Tensor]:
        """The next broadcast (ranks ≥ 1), in fresh tensors on this group's device."""
        out = {}
        for info in self.manifests[self.announce()]:
            tensor = torch.empty(info.shape, dtype=getattr(torch, info.dtype), device=self.device)
            self._broadcast(tensor)
            out[info.name] = tensor
        self._settle()
        return out

    def close(self) -> None:
        """Leave the group (the caller orders the ranks: ray/weight_sync.py)."""
        self.group.shutdown()


def check_on_gpu(weights: dict[str, torch.Tensor | np.ndarray]) -> None:
    on_host = [name for name, t in weights.items() if not (isinstance(t, torch.Tensor) and t.is_cuda)]
    if on_host:
        raise ValueError(f"sampling.weight_transport: cuda_ipc needs the learner's weights on its GPU; {on_host[:3]} "
                         f"are host copies (a LoRA learner merges its adapters into host copies): use "
                         f"collective or object_store")


def ipc_handles(weights: dict[str, torch.Tensor | np.ndarray]) -> dict[str, tuple]:
    """CUDA IPC handles of `weights`, which must be CUDA tensors that stay alive (live parameters)."""
    from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

    check_on_gpu(weights)
    return {name: reduce_tensor(t) for name, t in weights.items()}


def host_copy(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A host copy: numpy where it can hold the dtype (Ray's object store then shares it without
    a copy), else a torch tensor."""
    t = t.detach().to("cpu", copy=True)
    return t if t.dtype == torch.bfloat16 else t.numpy()


def _on_host(value: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """A GPU tensor's host copy; a host value as it is."""
    return host_copy(value) if isinstance(value, torch.Tensor) and value.is_cuda else value


class IpcHandles(dict):
    """name -> the CUDA IPC handle of a learner's tensor (`ipc_handles`), handed on unopened. A
    process that mapped a tensor under CUDA IPC cannot share it again (torch refuses), so an
    engine core in a third process maps the learner's own handles (engine/samplers/vllm_sampler.py)."""


def open_ipc_handles(handles: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Tensors over the memory the handles name (another process's, on this same GPU)."""
    return {name: rebuild(*args) for name, (rebuild, args) in handles.items()}


class WeightGroupMember:
    """What both ends share: leaving the broadcast group at the end of a run."""

    def leave_weight_group(self) -> None:
        group = getattr(self, "_weight_group", None)
        if group is not None:
            group.close()
            self._weight_group = None


class BroadcastSender(WeightGroupMember):
    """Mixin for the learner: the sending end of both transports (uses `self.weights()`, and
    `self.full_weights()` and `self.fp8_layers()` for the manifests: engine/learner/learner_base.py)."""

    def weight_manifest(self) -> list[TensorInfo]:
        """Names, shapes and dtypes of what `broadcast_weights` sends, in order (full weights)."""
        return manifest_of(self.full_weights())

    def fp8_weight_manifest(self) -> list[TensorInfo] | None:
        """The same once the quantised Linears go as FP8 (None without FP8 rollouts)."""
        layers = self.fp8_layers()
        return fp8_manifest(self.weight_manifest(), layers) if layers else None

    def open_weight_store(self, host: str, world_size: int) -> int:
        """Host the group's store (rank 0) at this node's address `host`, on a port the OS picks;
        returns the port."""
        self._weight_store = open_store(host, 0, world_size, 0)
        return self._weight_store.port

    def join_weight_group(self, world_size: int, backend: str) -> None:
        """Form the group as rank 0 over the store opened above (returns once every rank joined)."""
        self._weight_group = WeightGroup(self._weight_store, world_size, 0, backend, self.weight_manifest(),
                                         self.fp8_weight_manifest())

    def broadcast_weights(self) -> int:
        """Send the current weights to every sampler; returns the bytes each one received."""
        return self._weight_group.send(self.weights())

    def weight_checksums(self, version: int) -> dict[str, Checksum]:
        """Checksums of the tensors checked after sync `version` (engine/transport/weight_check.py), on
        what `weights()` exports: the tensors every transport sends."""
        weights = self.weights()
        return checksums_of(weights, checked_names(list(weights), version))

    def host_weights(self) -> dict[str, np.ndarray | torch.Tensor]:
        """`weights()` in host memory, for the object store: a sampler on any device (or none)
        can load them, and no receiver holds a copy on its GPU outside its engine's memory."""
        return {name: _on_host(value) for name, value in self.weights().items()}

    def weight_ipc_handles(self) -> dict[str, tuple]:
        """CUDA IPC handles of the current weights, made once (again only if the tensors moved)."""
        weights = self.weights()
        # The optimizer step's writes, and the copies `weights()` queued into export buffers
        # (a one-rank sharded learner's, FP8 payloads), land before another process reads: the
        # handles are cached, so no IPC event orders the later syncs.
        torch.cuda.synchronize()
        check_on_gpu(weights)
        where = tuple((t.data_ptr(), tuple(t.shape)) for t in weights.values())
        cached = getattr(self, "_ipc", None)
        if cached is None or cached[0] != where:
            self._ipc = (where, ipc_handles(weights))
        return self._ipc[1]


class BroadcastReceiver(WeightGroupMember):
    """Mixin for samplers: the receiving end of both transports (uses `self.load_weights`)."""

    def join_weight_group(self, host: str, port: int, world_size: int, rank: int, backend: str,
                          manifest: list[TensorInfo], fp8_manifest: list[TensorInfo] | None = None) -> None:
        """Join the learner's group as `rank` (≥ 1), receiving tensors as `manifest` (or, when the
        learner announces it, `fp8_manifest`) lists them."""
        self._weight_group = WeightGroup(open_store(host, port, world_size, rank), world_size, rank, backend, manifest,
                                         fp8_manifest)

    def receive_weights(self, version: int) -> int:
        """Receive the learner's next broadcast and load it as weights `version`."""
        return self.load_weights(self._weight_group.receive(), version)

    def load_ipc_weights(self, handles: dict[str, tuple], version: int) -> int:
        """Copy the learner's current weights into this engine through its mapped memory (mapped
        on the first call, and again only when the learner's handles change)."""
        cached = getattr(self, "_ipc", None)
        if cached is None or cached[0] != handles:
            self._ipc = (handles, open_ipc_handles(handles))
        out = self.load_weights(self._ipc[1], version)
        torch.cuda.synchronize()  # the copies are done before the learner's next step writes
        return out
