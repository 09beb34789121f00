"""One learner rank: which process of the group this is, and the group's bring-up.

A sharded learner is N processes (Ray actors in production, `torch.multiprocessing` in the
tests) that join one `torch.distributed` default group: NCCL on GPUs, gloo on CPUs, so CI
runs the same code path as a cluster. Rank 0 hosts the rendezvous store at `address:port`;
every rank is told the same address and port, its own rank and the world size.

The default group is the learner's: a process that also hosts a vLLM engine must not be a
learner rank (vLLM owns the default group there), and the learner-to-sampler weight broadcast
uses its own stateless group (engine/transport/weight_broadcast.py), never this one.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from k3post.engine.transport.gloo_interface import bind_gloo_towards

GROUP_TIMEOUT = datetime.timedelta(minutes=10)  # a rank that never joins fails the others' calls


@dataclass(frozen=True)
class RankSpec:
    """Where this process sits in the learner group.

    `local_rank` picks the GPU when a process sees several (under Ray each actor sees exactly
    one, so it is 0)."""

    rank: int = 0
    world_size: int = 1
    backend: Literal["gloo", "nccl"] = "gloo"
    address: str = "127.0.0.1"
    port: int = 29500
    local_rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"learner group backend must be gloo or nccl, not {self.backend!r}")

    @property
    def device(self) -> torch.device:
        """This rank's device: its GPU under NCCL, the CPU under gloo."""
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")


def init_group(spec: RankSpec) -> None:
    """Join the default process group (idempotent for the same world size); on NCCL, select the
    rank's GPU first so collectives and allocations land on it."""
    if dist.is_initialized():
        if dist.get_world_size() != spec.world_size or dist.get_rank() != spec.rank:
            raise RuntimeError(f"this process is already rank {dist.get_rank()} of {dist.get_world_size()}")
        return
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.device)
    else:
        bind_gloo_towards(spec.address)  # ranks on other machines must reach this one (engine/transport/gloo_interface.py)
    os.environ.setdefault("MASTER_ADDR", spec.address)
    os.environ.setdefault("MASTER_PORT", str(spec.port))
    dist.init_process_group(spec.backend, init_method=f"tcp://{spec.address}:{spec.port}", rank=spec.rank,
                            world_size=spec.world_size, timeout=GROUP_TIMEOUT,
                            device_id=spec.device if spec.backend == "nccl" else None)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free on `host` now (for a group's rendezvous store; the store binds
    it moments later)."""
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def all_reduce_floats(values: list[float], op: str = "sum", device: torch.device | str = "cpu") -> list[float]:
    """Sum (or max) a few Python floats over the group in one collective (float64, so token
    counts and loss sums add exactly as they would in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def peak_host_rss_gib() -> float:
    """This process's peak resident host memory so far (ru_maxrss is KiB on Linux)."""
    import resource  # noqa: PLC0415

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
