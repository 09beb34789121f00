"""The ranks of a sharded learner as Ray actors: one placement group, one torch.distributed group.

Each rank is a bundle of the learner's resources (`resources.learner`: CPUs and at most one GPU)
in a placement group laid out by `learner.placement` (pack: as few nodes as fit; spread: as many
as possible; strict_pack: one node or nothing). Rank 0's node hosts the group's rendezvous store
on a port its OS says is free; every rank is told that address and port, its rank and the world
size (engine/rank.py: RankSpec), and joins NCCL (GPUs) or gloo (CPUs) in its constructor.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3post.config.learner_schema import LearnerSpec
from k3post.config.schema import ResourceSpec
from k3post.engine.learner import LearnerConfig
from k3post.engine.learner_rank import group_backend
from k3post.engine.rank import RankSpec, free_port

PLACEMENT_TIMEOUT_S = 600  # a group that cannot be placed (too few GPUs) fails with a message, not a hang


def _address_and_port() -> tuple[str, int]:
    """Runs in rank 0's bundle: this node's address and a free port on it."""
    address = ray.util.get_node_ip_address()
    return address, free_port(address)


def _bundle(group: Any, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=True)


def learner_ranks(cls: type, config: LearnerConfig, spec: LearnerSpec, res: ResourceSpec) -> list[Any]:
    """`res.replicas` actors of `cls`, rank i in bundle i; returns them in rank order."""
    bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {})}
    group = placement_group([bundle] * res.replicas, strategy=spec.placement.upper())
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the learner's {res.replicas} ranks ({bundle} each, placement {spec.placement}) could "
                           f"not be placed within {PLACEMENT_TIMEOUT_S}s: the cluster lacks the resources") from None
    locate = ray.remote(num_cpus=0)(_address_and_port).options(scheduling_strategy=_bundle(group, 0))
    address, port = ray.get(locate.remote())
    actor_cls = ray.remote(num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_restarts=0)(cls)
    backend = group_backend(config.device)
    return [actor_cls.options(scheduling_strategy=_bundle(group, rank)).remote(
                config, RankSpec(rank, res.replicas, backend, address, port), spec)
            for rank in range(res.replicas)]
