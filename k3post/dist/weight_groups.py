"""Weight transports other than the object store, on Ray (`sampling.weight_transport`).

`resolve_transport` (plain function, unit-tested) turns the recipe's choice and where Ray put
the actors into the transport to use, or a clear error. collective: the learner actor hosts a
broadcast group's store (rank 0) on a port its OS picks and every sampler replica joins with
the learner's manifest (engine/weight_broadcast.py). cuda_ipc: the learner and the samplers
share one GPU; syncs pass CUDA IPC handles. Either way the learner group hands out
`LearnerWeights` instead of an ObjectRef of weights, and the sampler group answers it with the
transport's calls on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from k3post.config.errors import UserError
from k3post.config.schema import ResourcesSpec, SamplingSpec, learner_and_samplers_on_gpus

# Broadcast groups this driver formed, as (learner, samplers): left in order when it disconnects.
_GROUPS: list[tuple[Any, list[Any]]] = []
LEAVE_TIMEOUT_S = 60

Placement = list[tuple[str, str]]  # (node, GPU UUID) of the learner, then of each sampler


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


def resolve_transport(transport: str, resources: ResourcesSpec, gpus: Placement) -> str:
    """The transport to use, given the recipe's `transport` and the actors' GPUs (empty on CPUs).

    auto: object_store without GPUs; cuda_ipc when every actor is on one GPU; collective when
    each has its own; object_store for anything in between. A transport the placement cannot
    carry is a UserError naming the placement."""
    same_gpu, own_gpus = len(set(gpus)) == 1, len(set(gpus)) == len(gpus)
    if transport == "auto":
        if not learner_and_samplers_on_gpus(resources):
            return "object_store"
        return "cuda_ipc" if same_gpu else "collective" if own_gpus else "object_store"
    if transport == "cuda_ipc" and not same_gpu:
        raise UserError(f"sampling.weight_transport: cuda_ipc needs the learner and every sampler on one GPU; "
                        f"Ray placed them on {sorted(set(gpus))} (node, GPU). Give them fractions of one GPU "
                        f"(e.g. num_gpus 0.5 each on a one-GPU node) or use weight_transport: collective.")
    if transport == "collective" and gpus and not own_gpus:
        # NCCL cannot hold two ranks on one GPU: it would fail deep inside the first broadcast.
        raise UserError(f"sampling.weight_transport: collective broadcasts over NCCL, which needs the learner "
                        f"and every sampler replica on a GPU of its own; Ray placed them on {gpus} (node, GPU). "
                        f"Give each a whole GPU (resources.*.num_gpus: 1) or, on one shared GPU, use "
                        f"weight_transport: cuda_ipc.")
    return transport


def sampler_restarts(sampling: SamplingSpec, resources: ResourcesSpec, default: int) -> int:
    """A restarted sampler could not be re-synced by the other transports: with them (or with
    auto on GPUs, which picks one of them unless the placement fits neither) no sampler is
    restarted. Decided before the actors exist, so before auto is resolved."""
    store = sampling.weight_transport == "object_store" or (sampling.weight_transport == "auto"
                                                            and not learner_and_samplers_on_gpus(resources))
    return default if store else 0


def _gpu(_engine: Any) -> tuple[str, str]:
    """Runs in an actor: its node and the UUID of the GPU it computes on."""
    import torch  # noqa: PLC0415

    return ray.util.get_node_ip_address(), str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def _node_ip(_engine: Any) -> str:
    return ray.util.get_node_ip_address()


def connect_weights(sampling: SamplingSpec, resources: ResourcesSpec, learner: Any, samplers: list[Any]) -> str:
    """Set up the recipe's transport (resolving auto); returns the transport used."""
    on_gpus = learner_and_samplers_on_gpus(resources)
    gpus = ray.get([a.__ray_call__.remote(_gpu) for a in (learner, *samplers)]) if on_gpus else []
    transport = resolve_transport(sampling.weight_transport, resources, gpus)
    note = " (samplers are not restarted)" if sampler_restarts(sampling, resources, 1) == 0 else ""
    print(f"k3post: the learner's weights reach the samplers via {transport}{note}", flush=True)
    if transport == "collective":
        form_weight_group(learner, samplers, "nccl" if on_gpus else "gloo")
    return transport


def form_weight_group(learner: Any, samplers: list[Any], backend: str) -> None:
    """Join the learner (rank 0) and the sampler replicas (1..N) in one broadcast group."""
    world = 1 + len(samplers)
    host = ray.get(learner.__ray_call__.remote(_node_ip))
    port = ray.get(learner.open_weight_store.remote(host, world))
    manifest = ray.get(learner.weight_manifest.remote())
    ray.get([learner.join_weight_group.remote(world, backend)]
            + [s.join_weight_group.remote(host, port, world, rank, backend, manifest)
               for rank, s in enumerate(samplers, start=1)])
    _GROUPS.append((learner, samplers))


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
