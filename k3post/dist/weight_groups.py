"""Weight transports other than the object store, on Ray (`sampling.weight_transport`).

collective: the learner actor hosts a broadcast group's store (rank 0) on a free port of its
node and every sampler replica joins with the learner's manifest (engine/weight_broadcast.py).
cuda_ipc: the learner and the samplers must share one GPU; each sync passes CUDA IPC handles.
Either way the learner group hands out `LearnerWeights` instead of an ObjectRef of weights,
and the sampler group answers it with the transport's calls on both sides.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import ray

from k3post.config.errors import UserError
from k3post.config.schema import ResourcesSpec, SamplingSpec


@dataclass(frozen=True)
class LearnerWeights:
    """The learner's newest weights, still in its actor: they leave it by `transport`."""

    learner: Any  # the learner's actor handle
    transport: str  # "collective" | "cuda_ipc"

    def load_into(self, samplers: list[Any], version: int) -> None:
        """Every sampler replica holds these weights as `version` when this returns."""
        if self.transport == "collective":
            ray.get([self.learner.broadcast_weights.remote(),
                     *(s.receive_weights.remote(version) for s in samplers)])
        else:
            handles = self.learner.weight_ipc_handles.remote()
            ray.get([s.load_ipc_weights.remote(handles, version) for s in samplers])


# Broadcast groups this driver formed, as (learner, samplers): left in order when it disconnects.
_GROUPS: list[tuple[Any, list[Any]]] = []
LEAVE_TIMEOUT_S = 60


def leave_weight_groups() -> None:
    """Shut the groups down, receivers first: left alone, the processes die with Ray and NCCL
    prints a warning per process (and the receivers a trace once the store's host is gone)."""
    while _GROUPS:
        learner, samplers = _GROUPS.pop()
        for actors in (samplers, [learner]):
            try:
                ray.get([a.leave_weight_group.remote() for a in actors], timeout=LEAVE_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError):  # an actor already gone: nothing to leave
                pass


def _node_address(_engine: Any) -> tuple[str, int]:
    """Runs in the learner actor: its node's IP and a port free there now."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _gpu(_engine: Any) -> tuple[str, str]:
    """Runs in an actor: its node and the UUID of the GPU it computes on."""
    import torch  # noqa: PLC0415

    return ray.util.get_node_ip_address(), str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def _on_gpus(resources: ResourcesSpec) -> bool:
    return resources.learner.num_gpus > 0 and resources.samplers.num_gpus > 0


def sampler_restarts(sampling: SamplingSpec, resources: ResourcesSpec, default: int) -> int:
    """A restarted sampler could not be re-synced by the other transports: with them (or with
    auto, which picks one of them on GPUs), no sampler is restarted."""
    store = sampling.weight_transport == "object_store" or (sampling.weight_transport == "auto"
                                                            and not _on_gpus(resources))
    return default if store else 0


def _auto(resources: ResourcesSpec, gpus: list[tuple[str, str]]) -> str:
    if not _on_gpus(resources):
        return "object_store"
    if len(set(gpus)) == 1:
        return "cuda_ipc"
    return "collective" if len(set(gpus)) == len(gpus) else "object_store"


def connect_weights(sampling: SamplingSpec, resources: ResourcesSpec, learner: Any, samplers: list[Any]) -> str:
    """Set up the recipe's transport (resolving auto); returns the transport used."""
    transport = sampling.weight_transport
    gpus = ray.get([a.__ray_call__.remote(_gpu) for a in (learner, *samplers)]) if _on_gpus(resources) else []
    if transport == "auto":
        transport = _auto(resources, gpus)
    print(f"k3post: the learner's weights reach the samplers via {transport}", flush=True)
    if transport == "object_store":
        return transport
    if transport == "cuda_ipc":
        if len(set(gpus)) != 1:
            raise UserError(f"sampling.weight_transport: cuda_ipc needs the learner and every sampler on one GPU; "
                            f"Ray placed them on {sorted(set(gpus))} (node, GPU). Give them fractions of one GPU "
                            f"(e.g. num_gpus 0.5 each on a one-GPU node) or use weight_transport: collective.")
        return transport
    form_weight_group(learner, samplers, "nccl" if gpus else "gloo", gpus)
    return transport


def form_weight_group(learner: Any, samplers: list[Any], backend: str, gpus: list[tuple[str, str]]) -> None:
    """Join the learner (rank 0) and the sampler replicas (1..N) in one broadcast group."""
    if backend == "nccl":
        # NCCL cannot hold two ranks on one GPU: a sampler sharing the learner's GPU (fractional
        # num_gpus) would fail deep inside the first broadcast.
        if len(set(gpus)) != len(gpus):
            raise UserError(f"sampling.weight_transport: collective broadcasts over NCCL, which needs the learner "
                            f"and every sampler replica on a GPU of its own; Ray placed them on {gpus} (node, GPU). "
                            f"Give each a whole GPU (resources.*.num_gpus: 1) or, on one shared GPU, use "
                            f"weight_transport: cuda_ipc.")
    host, port = ray.get(learner.__ray_call__.remote(_node_address))
    manifest = ray.get(learner.weight_manifest.remote())
    world = 1 + len(samplers)
    ray.get([learner.join_weight_group.remote(host, port, world, backend)]
            + [s.join_weight_group.remote(host, port, world, rank, backend, manifest)
               for rank, s in enumerate(samplers, start=1)])
    _GROUPS.append((learner, samplers))
