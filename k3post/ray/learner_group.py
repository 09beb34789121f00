"""Placement groups: the learner's ranks in one, or a whole run in one (`resources.placement`).

Each learner rank is a bundle of the learner's resources (`resources.learner`: CPUs and at most
one GPU). Without `resources.placement` the ranks get a placement group of their own laid out by
`learner.placement` (pack: as few nodes as fit; spread: as many as possible; strict_pack: one
node or nothing). With it, the run's one group (config/placement_schema.py: plan_bundles; made by
`placement_group_for`) already holds a bundle per rank, and the ranks go there. Either way rank
0's bundle hosts the group's rendezvous store on a port its OS says is free; every rank is told
that address and port, its rank and the world size (engine/sharded/rank.py: RankSpec), and joins NCCL
(GPUs) or gloo (CPUs) in its constructor.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3post.config.learner_schema import LearnerSpec
from k3post.config.schema import ResourceSpec
from k3post.engine.learner.learner import LearnerConfig
from k3post.engine.sharded.learner_rank import group_backend
from k3post.engine.sharded.rank import RankSpec, free_port

PLACEMENT_TIMEOUT_S = 600  # a group that cannot be placed (too few GPUs) fails with a message, not a hang


def _address_and_port() -> tuple[str, int]:
    """Runs in rank 0's bundle: this node's address and a free port on it."""
    address = ray.util.get_node_ip_address()
    return address, free_port(address)


def in_bundle(group: Any, index: int) -> PlacementGroupSchedulingStrategy:
    """Schedule an actor in bundle `index` of `group`; what it starts (a vLLM engine's workers) too."""
    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=True)


def placement_group_for(bundles: list[dict[str, float]], strategy: str, what: str) -> Any:
    """A placement group of `bundles` laid out by `strategy` (PACK, SPREAD, STRICT_PACK,
    STRICT_SPREAD), once Ray has reserved it; a RuntimeError naming `what` if it cannot."""
    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"{what} ({len(bundles)} bundles {bundles}, strategy {strategy}) could not be placed "
                           f"within {PLACEMENT_TIMEOUT_S}s: the cluster lacks the resources") from None
    return group


def learner_ranks(cls: type, config: LearnerConfig, spec: LearnerSpec, res: ResourceSpec,
                  placed: tuple[Any, list[int]] | None = None) -> list[Any]:
    """`res.replicas` actors of `cls`, rank i in bundle i of their own group, or in bundle
    `placed[1][i]` of the run's group `placed[0]`; returns them in rank order."""
    if placed is None:
        bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {})}
        group = placement_group_for([bundle] * res.replicas, spec.placement.upper(),
                                    f"the learner's {res.replicas} ranks (placement {spec.placement})")
        bundles = list(range(res.replicas))
    else:
        group, bundles = placed
    locate = ray.remote(num_cpus=0)(_address_and_port).options(scheduling_strategy=in_bundle(group, bundles[0]))
    address, port = ray.get(locate.remote())
    actor_cls = ray.remote(num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_restarts=0)(cls)
    backend = group_backend(config.device)
    return [actor_cls.options(scheduling_strategy=in_bundle(group, bundles[rank])).remote(
                config, RankSpec(rank, res.replicas, backend, address, port), spec)
            for rank in range(res.replicas)]
