"""Where the run's actors land on a described cluster (nodes × GPUs), and what each GPU holds.

The bundles are the run's own: with `resources.placement`, config/placement_schema.py's
`plan_bundles` (one bundle per actor, the colocated learner + samplers in one) laid out by its
strategy; without it, the learner's ranks are one placement group laid out by
`learner.placement` and every other actor is placed on its own. What the planner adds is the
part Ray decides at run time, done the way Ray does it for these strategies:

- PACK / STRICT_PACK: bundles fill the first node that has room, in order (STRICT_PACK: one
  node or nothing); an actor outside any group goes to the first node with room;
- SPREAD / STRICT_SPREAD: each bundle to the node holding the fewest bundles so far that has
  room (STRICT_SPREAD: a node of its own, or nothing);
- on a node, a whole-GPU request takes whole free GPUs; a fraction takes the first GPU whose
  remaining share fits (Ray's fractional GPUs share one device).

Ray's default scheduler may pick another node where several fit; the memory per device does not
depend on which identical node it picks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3post.config.placement_schema import LEARNER, PlacementSpec, plan_bundles

EPS = 1e-9


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_bytes: float


@dataclass
class Device:
    """One GPU: what share of it is taken and by which actors (label, bytes)."""

    node: int
    index: int
    share: float = 0.0
    tenants: list[tuple[str, float]] = field(default_factory=list)

    @property
    def used(self) -> float:
        return sum(b for _, b in self.tenants)


@dataclass
class Layout:
    devices: list[Device]
    unplaced: list[str]  # actors that found no room (a Ray run would wait for resources forever)
    nodes_of: dict[str, list[int]]  # group key → node of each actor
    host: dict[int, list[tuple[str, float]]] = field(default_factory=dict)  # CPU actors, per node


class _Nodes:
    def __init__(self, cluster: Cluster):
        self.devices = [[Device(n, g) for g in range(cluster.gpus_per_node)] for n in range(cluster.nodes)]
        self.count = [0] * cluster.nodes

    def fits(self, node: int, gpus: float) -> bool:
        return self._pick(node, gpus) is not None

    def _pick(self, node: int, gpus: float) -> list[Device] | None:
        devices = self.devices[node]
        if gpus <= 0:
            return []
        if gpus >= 1 - EPS:
            free = [d for d in devices if d.share <= EPS]
            return free[:int(round(gpus))] if len(free) >= round(gpus) else None
        for d in devices:
            if d.share + gpus <= 1 + EPS:
                return [d]
        return None

    def take(self, node: int, gpus: float) -> list[Device]:
        picked = self._pick(node, gpus)
        assert picked is not None
        for d in picked:
            d.share += min(gpus, 1.0)
        self.count[node] += 1
        return picked


def _choose(nodes: _Nodes, gpus: float, strategy: str, used: set[int]) -> int | None:
    order = range(len(nodes.count))
    if strategy.endswith("SPREAD"):
        order = sorted(order, key=lambda n: (n in used, nodes.count[n], n))
        if strategy == "STRICT_SPREAD":
            order = [n for n in order if n not in used]
    for n in order:
        if nodes.fits(n, gpus):
            return n
    return None


def _place_group(nodes: _Nodes, bundles: list[float], strategy: str) -> list[tuple[int, list[Device]] | None]:
    """Bundles (GPUs each) laid out as one placement group."""
    if strategy == "STRICT_PACK":
        for n in range(len(nodes.count)):
            if _fits_all(nodes, n, bundles):
                return [(n, nodes.take(n, g)) for g in bundles]
        return [None] * len(bundles)
    used: set[int] = set()
    out = []
    for g in bundles:
        n = _choose(nodes, g, strategy, used)
        out.append(None if n is None else (n, nodes.take(n, g)))
        if n is not None:
            used.add(n)
    return out


def _fits_all(nodes: _Nodes, node: int, bundles: list[float]) -> bool:
    saved = [d.share for d in nodes.devices[node]]
    ok = True
    for g in bundles:
        picked = nodes._pick(node, g)
        if picked is None:
            ok = False
            break
        for d in picked:
            d.share += min(g, 1.0)
    for d, s in zip(nodes.devices[node], saved):
        d.share = s
    return ok


def place(groups: list[tuple[str, Any, float]], cluster: Cluster, spec: PlacementSpec | None,
          learner_strategy: str) -> Layout:
    """Lay out `groups` — (key, ResourceSpec, bytes each actor needs per GPU it holds) — on
    `cluster`; returns every GPU's tenants."""
    nodes = _Nodes(cluster)
    need = {key: each for key, _, each in groups}
    placed: dict[str, list[tuple[int, list[Device]] | None]] = {}
    if spec is not None:
        plan = plan_bundles([(k, r) for k, r, _ in groups], spec)
        spots = _place_group(nodes, [b.get("GPU", 0.0) for b in plan.bundles], plan.strategy)
        for key, indices in plan.actors.items():
            placed[key] = [spots[i] for i in indices]
    else:
        for key, res, _ in groups:
            if key == LEARNER:
                placed[key] = _place_group(nodes, [res.num_gpus] * res.replicas, learner_strategy.upper())
            else:
                placed[key] = [_place_group(nodes, [res.num_gpus], "PACK")[0] for _ in range(res.replicas)]
    return _tenants(nodes, placed, need)


def _tenants(nodes: _Nodes, placed: dict, need: dict[str, float]) -> Layout:
    unplaced, nodes_of, host = [], {}, {}
    for key, spots in placed.items():
        nodes_of[key] = []
        for i, spot in enumerate(spots):
            label = f"{key}[{i}]"
            if spot is None:
                unplaced.append(label)
                nodes_of[key].append(-1)
                continue
            node, devices = spot
            nodes_of[key].append(node)
            if not devices:
                host.setdefault(node, []).append((label, need[key]))
            for d in devices:
                d.tenants.append((label, need[key]))
    return Layout([d for row in nodes.devices for d in row], unplaced, nodes_of, host)
