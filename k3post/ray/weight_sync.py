"""How the learner's weights reach sampler actors on Ray: one strategy per transport
(`sampling.weight_transport`), each with the one method the loops call, `push(version)`.

`resolve_transport` (plain function, unit-tested) turns the recipe's choice and where Ray put
the actors into the transport to use, or a clear error; `connect_weights` builds its strategy.

- object_store: the learner exports its weights into Ray's object store and every sampler loads
  them from there; the reference is kept, so a restarted sampler re-syncs from it.
- collective: the learner actor hosts a broadcast group's store (rank 0) on a port its OS picks
  and every sampler replica joins with the learner's manifest (engine/transport/weight_broadcast.py);
  NCCL between GPUs, gloo on CPUs.
- cuda_ipc: the learner and the samplers share one GPU; syncs pass CUDA IPC handles of the
  learner's live weights.

Every push ends with `verify_sync`: the learner and each sampler replica checksum the same few
tensors (a rotating window chosen by the version, engine/transport/weight_check.py) and a difference stops
the run with one line naming the tensor, the version and the replica.
"""

from __future__ import annotations

from typing import Any

import ray

from k3post.config.errors import UserError
from k3post.config.placement_schema import one_gpu_guaranteed
from k3post.config.schema import ResourcesSpec, SamplingSpec, learner_and_samplers_on_gpus
from k3post.engine.transport.weight_check import check_replicas
from k3post.launch.engines import sampler_restarts
from k3post.ray.groups import RayLearner, RaySamplers

# Broadcast groups this driver formed, as (learner, samplers): left in order when it disconnects.
_GROUPS: list[tuple[Any, list[Any]]] = []
LEAVE_TIMEOUT_S = 60

Placement = list[tuple[str, str]]  # (node, GPU UUID) of the learner, then of each sampler


def verify_sync(learner: RayLearner, samplers: RaySamplers, version: int) -> None:
    """Every sampler replica holds what the learner sent for the tensors checked at `version`
    (every learner rank takes part: a sharded one gathers those tensors), or WeightSyncMismatch."""
    refs = [rank.weight_checksums.remote(version) for rank in learner.actors]
    learner.wait(refs, "weight_checksums")
    expected = ray.get(refs[0])
    check_replicas(expected, samplers.weight_checksums(list(expected)), version)


class ObjectStoreSync:
    def __init__(self, learner: RayLearner, samplers: RaySamplers):
        self.learner, self.samplers = learner, samplers

    def push(self, version: int) -> None:
        self.samplers.forget_weights()
        self.samplers.load_from_store(self.learner.export_weights(), version)
        verify_sync(self.learner, self.samplers, version)


class CollectiveSync:
    """The learner broadcasts every tensor; each sampler receives into fresh tensors and loads them."""

    def __init__(self, learner: RayLearner, samplers: RaySamplers):
        self.learner, self.samplers = learner, samplers

    def push(self, version: int) -> None:
        # Every learner rank takes part (a sharded learner gathers each bucket before rank 0 sends it).
        received = [s.receive_weights.remote(version) for s in self.samplers.actors]
        self.learner.wait([rank.broadcast_weights.remote() for rank in self.learner.actors], "broadcast_weights")
        ray.get(received)
        self.samplers.loaded(version)
        verify_sync(self.learner, self.samplers, version)


class CudaIpcSync:
    """Each sampler maps the learner's weight memory on their shared GPU and copies from it."""

    def __init__(self, learner: RayLearner, samplers: RaySamplers):
        self.learner, self.samplers = learner, samplers

    def push(self, version: int) -> None:
        handles = self.learner.rank0.weight_ipc_handles.remote()
        ray.get([s.load_ipc_weights.remote(handles, version) for s in self.samplers.actors])
        self.samplers.loaded(version)
        verify_sync(self.learner, self.samplers, version)


STRATEGIES = {"object_store": ObjectStoreSync, "collective": CollectiveSync, "cuda_ipc": CudaIpcSync}


def resolve_transport(transport: str, resources: ResourcesSpec, gpus: Placement, lora: bool = False) -> str:
    """The transport to use, given the recipe's `transport`, the actors' GPUs (empty on CPUs) and
    whether the learner is LoRA (it exports merged host copies, which CUDA IPC cannot map).

    auto: object_store without GPUs; cuda_ipc only when `resources.placement` guarantees one
    shared GPU (colocate: config/placement_schema.py) - where Ray happened to put the actors is
    not a guarantee - and the learner is not LoRA; collective when each actor has its own GPU;
    object_store for anything else (a colocated LoRA learner included: it works on one GPU). A
    transport the placement cannot carry is a UserError naming the placement."""
    same_gpu, own_gpus = len(set(gpus)) == 1, len(set(gpus)) == len(gpus)
    guaranteed = one_gpu_guaranteed(resources)
    if transport == "auto":
        if not learner_and_samplers_on_gpus(resources):
            return "object_store"
        if guaranteed and same_gpu and not lora:
            return "cuda_ipc"
        return "collective" if own_gpus else "object_store"
    if transport == "cuda_ipc":
        if lora:
            raise UserError("sampling.weight_transport: cuda_ipc maps the learner's live GPU weights, but a LoRA "
                            "learner exports its adapters merged into host copies; use weight_transport: auto "
                            "(object_store when colocated) or object_store")
        if not guaranteed or not same_gpu:
            raise UserError(f"sampling.weight_transport: cuda_ipc needs the learner and every sampler on one GPU, "
                            f"guaranteed by resources.placement.colocate with their num_gpus adding up to at most 1; "
                            f"Ray placed them on {sorted(set(gpus))} (node, GPU). Use weight_transport: collective "
                            f"for a GPU each.")
    if transport == "collective" and gpus and not own_gpus:
        # NCCL cannot hold two ranks on one GPU: it would fail deep inside the first broadcast.
        raise UserError(f"sampling.weight_transport: collective broadcasts over NCCL, which needs the learner "
                        f"and every sampler replica on a GPU of its own; Ray placed them on {gpus} (node, GPU). "
                        f"Give each a whole GPU (resources.*.num_gpus: 1) or, on one shared GPU, use "
                        f"weight_transport: cuda_ipc with resources.placement.colocate: true.")
    return transport


def _gpu(_engine: Any) -> tuple[str, str]:
    """Runs in an actor: its node and the UUID of the GPU it computes on."""
    import torch  # noqa: PLC0415

    return ray.util.get_node_ip_address(), str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def _node_ip(_engine: Any) -> str:
    return ray.util.get_node_ip_address()


def connect_weights(sampling: SamplingSpec, resources: ResourcesSpec, learner: RayLearner,
                    samplers: RaySamplers, lora: bool = False) -> ObjectStoreSync | CollectiveSync | CudaIpcSync:
    """The recipe's transport (auto resolved from the placement and where the actors are), set up."""
    on_gpus = learner_and_samplers_on_gpus(resources)
    actors = (learner.rank0, *samplers.actors)
    gpus = ray.get([a.__ray_call__.remote(_gpu) for a in actors]) if on_gpus else []
    transport = resolve_transport(sampling.weight_transport, resources, gpus, lora)
    note = " (samplers are not restarted)" if sampler_restarts(sampling, resources) == 0 else ""
    print(f"k3post: the learner's weights reach the samplers via {transport}{note}", flush=True)
    if transport == "collective":
        form_weight_group(learner.rank0, samplers.actors, "nccl" if on_gpus else "gloo")
    return STRATEGIES[transport](learner, samplers)


def form_weight_group(learner: Any, samplers: list[Any], backend: str) -> None:
    """Join the learner (rank 0) and the sampler replicas (1..N) in one broadcast group."""
    world = 1 + len(samplers)
    host = ray.get(learner.__ray_call__.remote(_node_ip))
    port = ray.get(learner.open_weight_store.remote(host, world))
    manifest, fp8_manifest = ray.get([learner.weight_manifest.remote(), learner.fp8_weight_manifest.remote()])
    ray.get([learner.join_weight_group.remote(world, backend)]
            + [s.join_weight_group.remote(host, port, world, rank, backend, manifest, fp8_manifest)
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
