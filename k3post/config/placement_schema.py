"""`resources.placement:` - where a run's actors go, as one Ray placement group.

Without it (the default) Ray places each actor wherever it fits (the learner's ranks only are
kept together, by `learner.placement`). With it, the run asks Ray for one placement group with
one bundle per actor - the learner's ranks, the sampler replicas, every teacher's and reward
model's replicas, each bundle the actor's `num_cpus`/`num_gpus` - laid out by `strategy`:

- pack: as few nodes as fit (the default); spread: as many as possible;
- strict_pack: one node or nothing; strict_spread: one node per bundle or nothing.

`colocate: true` puts the learner (rank 0) and every sampler replica in one bundle. A bundle
always lies on one node, so they share a node whatever the strategy; and when their GPUs add up
to at most one (fractions such as 0.5 + 0.5, or 0.4 + 0.3 × 2) the bundle is one GPU, which they
share. That is the only layout where `sampling.weight_transport: cuda_ipc` is guaranteed to work:
`auto` picks cuda_ipc only then, and a recipe asking for cuda_ipc without it fails at load.

The layout is a pure function of the recipe (`plan_bundles`), unit-tested; ray/placement.py asks
Ray for it and the Ray backend puts each actor in its bundle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from k3post.config.base import Strict

LEARNER, SAMPLERS = "learner", "samplers"
MIN_BUNDLE_CPU = 0.01  # Ray refuses a bundle of zeros; an actor asking for 0 CPUs still gets a bundle


class PlacementSpec(Strict):
    strategy: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field("pack", description=(
        "pack: as few nodes as fit; spread: as many as possible; strict_pack: one node or nothing; strict_spread: "
        "one node per bundle or nothing"))
    colocate: bool = Field(False, description=(
        "one bundle for the learner (rank 0) and every sampler: one node, and one shared GPU when their num_gpus "
        "add up to at most 1 (what sampling.weight_transport: cuda_ipc needs)"))


@dataclass(frozen=True)
class BundlePlan:
    """What a run asks of Ray: `bundles` (resources of each), the Ray `strategy`, and for each
    group (`learner`, `samplers`, `teacher/<name>`, `reward_model/<name>`) the bundle of each of
    its actors, in rank/replica order."""

    bundles: list[dict[str, float]]
    strategy: str
    actors: dict[str, list[int]]


def group_keys(recipe: Any) -> list[tuple[str, Any]]:
    """(group key, ResourceSpec) of every actor group of a recipe, in the order they are made."""
    res = recipe.resources
    groups = [(LEARNER, res.learner)]
    if hasattr(res, "samplers"):
        groups.append((SAMPLERS, res.samplers))
    groups += [(f"teacher/{name}", t.resources) for name, t in getattr(recipe, "teachers", {}).items()]
    groups += [(f"reward_model/{name}", m.resources) for name, m in getattr(recipe, "reward_models", {}).items()]
    return groups


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    """A bundle's resources; more than one GPU must be whole GPUs for Ray (rounded up)."""
    bundle = {"CPU": max(cpus, MIN_BUNDLE_CPU)}
    if gpus > 0:
        bundle["GPU"] = gpus if gpus <= 1 else float(math.ceil(gpus - 1e-9))
    return bundle


def plan_bundles(groups: list[tuple[str, Any]], spec: PlacementSpec) -> BundlePlan:
    """One bundle per actor; with `colocate`, one shared bundle for learner rank 0 and the samplers."""
    bundles: list[dict[str, float]] = []
    actors: dict[str, list[int]] = {}
    resources = dict(groups)
    shared = spec.colocate and SAMPLERS in resources
    for key, res in groups:
        if shared and key == SAMPLERS:
            continue  # in the learner's first bundle
        actors[key] = []
        for index in range(res.replicas):
            cpus, gpus = res.num_cpus, res.num_gpus
            if shared and key == LEARNER and index == 0:
                samplers = resources[SAMPLERS]
                cpus += samplers.num_cpus * samplers.replicas
                gpus += samplers.num_gpus * samplers.replicas
                actors[SAMPLERS] = [len(bundles)] * samplers.replicas
            actors[key].append(len(bundles))
            bundles.append(_bundle(cpus, gpus))
    return BundlePlan(bundles, spec.strategy.upper(), actors)


def one_gpu_guaranteed(resources: Any) -> bool:
    """The placement puts the learner (one rank) and every sampler on one shared GPU."""
    placement = getattr(resources, "placement", None)
    if placement is None or not placement.colocate:
        return False
    learner, samplers = resources.learner, resources.samplers
    gpus = learner.num_gpus + samplers.num_gpus * samplers.replicas
    return learner.replicas == 1 and learner.num_gpus > 0 and samplers.num_gpus > 0 and gpus <= 1 + 1e-9


def check_cuda_ipc_placement(transport: str, resources: Any) -> None:
    """At load: cuda_ipc only where the placement guarantees one shared GPU (ValueError otherwise)."""
    if transport == "cuda_ipc" and not one_gpu_guaranteed(resources):
        raise ValueError(
            "sampling.weight_transport: cuda_ipc needs the learner (one rank) and every sampler on one GPU, "
            "which only resources.placement.colocate: true guarantees, with resources.learner.num_gpus + "
            "samplers.num_gpus × samplers.replicas ≤ 1 (e.g. 0.5 and 0.5); set that, or use weight_transport: "
            "auto / collective / object_store")
