"""A Ray node lost mid-run, named: which node left the cluster and which of the run's actors it held.

When a node dies (a machine powered off, a spot instance reclaimed, a raylet killed) every actor on
it dies with it, and the driver hears of it through whichever call fails first: a learner rank's
(`LearnerRankDied`), a sampler's, a surviving rank's collective whose peer is gone, an object that
lived on that node. Each of those alone names one actor, or none, and never the machine. So the
backend records where each actor started (`record_places`, once every actor is ready); when the run
fails with a Ray error, the driver asks Ray which of those nodes are dead (`dead_nodes`) and ends the
run with one line naming each lost node - its id and address - and the actors it held
(`node_loss_line`, pure). Re-running the same command resumes from the last checkpoint on the nodes
that are left: the placement group is reserved anew, so the run must still fit on them.

A death that took no node with it (one process killed, out of memory) is left as it was raised.
Teachers (and samplers on the object-store transport) that Ray restarted on another node are named
where they started: the record is of the run's start.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray

from k3post.config.errors import RunStopped

# Ray's account of an actor on a dead node: "The actor died because its node has died. Node Id: <hex>".
NAMED_NODE = re.compile(r"Node Id: ([0-9a-f]{16,})")
# A node that vanishes (SIGKILL, power off) first shows as actors that cannot be reached
# (ActorUnavailableError, a collective whose peer is gone); Ray's GCS declares the node dead only
# after its health checks fail (5 checks 3 s apart by default: 14 s measured on the mini-cluster).
# Wait that long for its verdict before saying what died; a process that died alone on a live
# node (ActorDiedError without a node) is reported at once.
NODE_VERDICT_S = 30.0
POLL_S = 0.5
# What a surviving rank's collective says when its peer vanished (gloo), besides Ray's own kinds.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Socket closed")


class NodeLost(RunStopped):
    """A Ray node of the run left the cluster: the run ends, and re-running it resumes on the nodes left."""


@dataclass(frozen=True)
class Place:
    """Where one actor of the run started: its label ("learner rank 1 of 2"), node id and address."""

    label: str
    node_id: str
    address: str


def _where(_engine: Any) -> tuple[str, str]:
    """Runs in an actor (through `__ray_call__`): its node's id and address."""
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def record_places(actors: list[Any], labels: list[str]) -> list[Place]:
    """Where each actor is now (one short call per actor, at start)."""
    found = ray.get([actor.__ray_call__.remote(_where) for actor in actors])
    return [Place(label, node, address) for label, (node, address) in zip(labels, found)]


def node_loss_line(places: list[Place], dead: set[str]) -> str | None:
    """The one line for the nodes in `dead` that held actors of the run (None if none did)."""
    lost: dict[str, list[Place]] = {}
    for place in places:
        if place.node_id in dead:
            lost.setdefault(place.node_id, []).append(place)
    if not lost:
        return None
    nodes = "; ".join(f"Ray node {node} ({held[0].address}) with {', '.join(p.label for p in held)}"
                      for node, held in lost.items())
    alive = len({p.node_id for p in places} - set(lost))
    return (f"lost {nodes}: the node left the Ray cluster and its actors died with it; re-run the same command to "
            f"resume from the last checkpoint on the nodes left (the run's actors were on {alive} other node"
            f"{'' if alive == 1 else 's'})")


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and what it wraps (RayTaskError's cause, __cause__, __context__)."""
    chain: list[BaseException] = []
    while err is not None and len(chain) < 10:
        chain.append(err)
        err = getattr(err, "cause", None) or err.__cause__ or err.__context__
    return chain


def dead_nodes(node_ids: set[str]) -> set[str]:
    """Which of `node_ids` Ray's GCS reports dead (or no longer knows)."""
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return {node for node in node_ids if node not in alive}


def _unreachable(chain: list[BaseException]) -> bool:
    """Whether `chain` says an actor or object cannot be reached (its node may be dying), rather
    than that a process died alone (ActorDiedError) or a call raised (a bug, a user's mistake)."""
    if any(isinstance(e, ray.exceptions.ActorDiedError) for e in chain):
        return False
    kinds = (ray.exceptions.ActorUnavailableError, ray.exceptions.ObjectLostError, ray.exceptions.RayActorError)
    return any(isinstance(e, kinds) for e in chain) or any(gone in str(e) for e in chain for gone in PEER_GONE)


def _await_dead_nodes(ours: set[str], wait_s: float, dead_of: Callable[[set[str]], set[str]]) -> set[str]:
    """The nodes of `ours` the GCS declares dead within `wait_s` (empty if none is)."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = dead_of(ours)
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(POLL_S)


def explain_node_loss(err: BaseException, places: list[Place], wait_s: float = NODE_VERDICT_S,
                      dead_of: Callable[[set[str]], set[str]] = dead_nodes) -> NodeLost | None:
    """A NodeLost naming the dead nodes that held actors of the run, if `err` came with one.

    `dead_of(node_ids)`: which of them Ray reports dead (`dead_nodes`; the unit tests pass a script)."""
    ours = {p.node_id for p in places}
    if not ours:
        return None
    chain = _chain(err)
    named = set(NAMED_NODE.findall("\n".join(str(e) for e in chain))) & ours
    unreachable = not named and _unreachable(chain)
    if unreachable:
        print(f"k3post: an actor of the run cannot be reached: waiting up to {wait_s:.0f}s for Ray to tell whether "
              f"its node is lost", flush=True)
    try:
        dead = named | _await_dead_nodes(ours, wait_s if unreachable else 0.0, dead_of)
    except Exception:  # noqa: BLE001  (the GCS itself unreachable: the head was lost; say what Ray said)
        dead = named
    line = node_loss_line(places, dead)
    return NodeLost(line) if line else None
