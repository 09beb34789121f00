"""`sampling.weight_transport: collective` on Ray: form the learner → samplers broadcast group.

The learner actor hosts the group's store (rank 0) on a free port of its node; every sampler
replica joins with the learner's manifest (engine/weight_broadcast.py). From then on the
learner group hands out `LearnerBroadcast` instead of an ObjectRef of weights, and the sampler
group answers it by calling the learner's send and every replica's receive together.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import ray

from k3post.config.schema import ResourcesSpec, SamplingSpec


@dataclass(frozen=True)
class LearnerBroadcast:
    """The learner's newest weights, still in its actor: they go out over the weight group."""

    learner: Any  # the learner's actor handle


def _node_address(_engine: Any) -> tuple[str, int]:
    """Runs in the learner actor: its node's IP and a port free there now."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _gpu_ids(_engine: Any) -> list[str]:
    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def sampler_restarts(sampling: SamplingSpec, default: int) -> int:
    """A restarted sampler could not rejoin the broadcast group: with it, none is restarted."""
    return 0 if sampling.weight_transport == "collective" else default


def connect_weights(sampling: SamplingSpec, resources: ResourcesSpec, learner: Any, samplers: list[Any]) -> bool:
    """Form the broadcast group if the recipe asks for one; True if it did."""
    if sampling.weight_transport != "collective":
        return False
    both_on_gpus = resources.learner.num_gpus > 0 and resources.samplers.num_gpus > 0
    form_weight_group(learner, samplers, "nccl" if both_on_gpus else "gloo")
    return True


def form_weight_group(learner: Any, samplers: list[Any], backend: str) -> None:
    """Join the learner (rank 0) and the sampler replicas (1..N) in one broadcast group."""
    if backend == "nccl":
        # NCCL cannot hold two ranks on one GPU: a sampler sharing the learner's GPU (fractional
        # num_gpus) would fail deep inside the first broadcast.
        ids = ray.get([a.__ray_call__.remote(_gpu_ids) for a in (learner, *samplers)])
        if any(set(a) & set(b) for i, a in enumerate(ids) for b in ids[i + 1:]):
            raise ValueError(f"sampling.weight_transport: collective broadcasts over NCCL, which needs the learner "
                             f"and every sampler replica on a GPU of its own; Ray placed them on GPUs {ids}. "
                             f"Give each a whole GPU (resources.*.num_gpus: 1) or use weight_transport: "
                             f"object_store.")
    host, port = ray.get(learner.__ray_call__.remote(_node_address))
    manifest = ray.get(learner.weight_manifest.remote())
    world = 1 + len(samplers)
    ray.get([learner.join_weight_group.remote(host, port, world, backend)]
            + [s.join_weight_group.remote(host, port, world, rank, backend, manifest)
               for rank, s in enumerate(samplers, start=1)])
