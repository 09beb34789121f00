"""The Ray backend: every engine group becomes Ray actors with the group's resources.

Engines are plain classes; they become actors only here (`ray.remote(**options)(cls)`), so no
engine code knows about Ray. `ray_backend(recipe)` joins or starts the cluster (ray/cluster.py)
for the length of a run.

With `resources.placement` the run first reserves one placement group, a bundle per actor
(config/placement_schema.py: plan_bundles), and each actor is made in its bundle: the learner's
ranks, the samplers (with `colocate`, in the learner's bundle), each teacher's and reward
model's replicas. Without it Ray places each actor where it fits.

Every actor gets a label ("learner rank 1 of 2", "sampler replica 0", "teacher alpha") and, once
all are ready, the node it started on is recorded: a run that fails because a node left the
cluster ends with one line naming the node and the actors it held (ray/node_loss.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from k3post.config.errors import UserError
from k3post.config.learner_schema import LearnerSpec
from k3post.config.placement_schema import LEARNER, SAMPLERS, BundlePlan, group_keys, plan_bundles
from k3post.config.schema import ResourceSpec, ResourcesSpec, SamplingSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.sharded.learner_rank import learner_class
from k3post.launch.backend import EngineSpec
from k3post.launch.describe import learner_group_line
from k3post.launch.engines import cpus_needed
from k3post.ray.cluster import connect, disconnect
from k3post.ray.groups import LearnerRankDied, RayLearner, RaySamplers, RayTeacher
from k3post.ray.learner_group import in_bundle, learner_ranks, placement_group_for
from k3post.ray.node_loss import Place, explain_node_loss, record_places
from k3post.ray.reward_models import RayRewardModel
from k3post.ray.weight_sync import connect_weights


def remote(cls: type, res: ResourceSpec, restarts: int):
    """`cls` as a Ray actor class with the group's resources. `restarts`: how often Ray restarts a
    dead actor and retries its call."""
    return ray.remote(num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_restarts=restarts,
                      max_task_retries=restarts)(cls)


class RayBackend:
    def __init__(self, placed: tuple[Any, BundlePlan] | None = None):
        self.actors: list[Any] = []  # every actor made, for `start`
        self.labels: list[str] = []  # what each actor is, in the words of an error ("teacher alpha")
        self.places: list[Place] = []  # where each actor started (`start`), to name a lost node
        self.placed = placed  # the run's placement group and its plan (resources.placement), or None
        self.lora = False  # the learner is LoRA: it exports host copies (ray/weight_sync.py)

    def _bundles(self, key: str) -> tuple[Any, list[int]] | None:
        return None if self.placed is None else (self.placed[0], self.placed[1].actors[key])

    def _group(self, engine: EngineSpec, key: str) -> list[Any]:
        actor_cls = remote(engine.cls, engine.resources, engine.restarts)
        placed = self._bundles(key)
        made = []
        for replica in range(engine.resources.replicas):
            options = {} if placed is None else {"scheduling_strategy": in_bundle(placed[0], placed[1][replica])}
            made.append(actor_cls.options(**options).remote(*engine.args, **engine.kwargs,
                                                            num_threads=engine.resources.threads))
            if engine.sleeps:  # built and asleep before the next engine starts (launch/backend.py: sleeps)
                ray.get(made[-1].__ray_ready__.remote())
        self.actors += made
        self.labels += [actor_label(key, replica, len(made)) for replica in range(len(made))]
        return made

    def learner(self, config: LearnerConfig, spec: LearnerSpec, resources: ResourceSpec) -> RayLearner:
        """The learner's ranks as actors in one placement group (the run's, or their own by
        `learner.placement`), joined in one torch.distributed group whose store rank 0's node
        hosts. The learner's weights and optimizer live only in its ranks: a restarted rank would
        silently go on from the initial weights, so none is restarted; a rank's death ends the
        run, and re-running resumes from the last checkpoint."""
        cls = learner_class(config, spec, resources.replicas)
        self.lora = config.lora.rank > 0
        placed = self._bundles(LEARNER)
        if cls is Learner:
            options = {} if placed is None else {"scheduling_strategy": in_bundle(placed[0], placed[1][0])}
            ranks = [remote(Learner, resources, 0).options(**options).remote(config)]
        else:
            if resources.replicas > 1:
                print("k3post: " + learner_group_line(resources.replicas, spec, resources.num_gpus, placed is not None),
                      flush=True)
            ranks = learner_ranks(cls, config, spec, resources, placed)
        self.actors += ranks
        self.labels += [actor_label(LEARNER, rank, len(ranks)) for rank in range(len(ranks))]
        return RayLearner(ranks)

    def samplers(self, engine: EngineSpec, pad_id: int) -> RaySamplers:
        return RaySamplers(self._group(engine, SAMPLERS), pad_id)

    def teacher(self, engine: EngineSpec) -> RayTeacher:
        return RayTeacher(self._group(engine, f"teacher/{engine.args[0]}"))

    def reward_model(self, engine: EngineSpec) -> RayRewardModel:
        return RayRewardModel(self._group(engine, f"reward_model/{engine.args[0]}"))

    def start(self, description: str) -> None:
        started = time.perf_counter()
        ray.get([actor.__ray_ready__.remote() for actor in self.actors])  # constructors done: models loaded
        self.places = record_places(self.actors, self.labels)
        nodes = len({place.node_id for place in self.places})
        print(f"k3post: {len(self.actors)} actors ready in {time.perf_counter() - started:.0f}s ({description})"
              + (f" on {nodes} Ray nodes" if nodes > 1 else ""))

    def weight_sync(self, sampling: SamplingSpec, resources: ResourcesSpec, learner: RayLearner,
                    samplers: RaySamplers):
        return connect_weights(sampling, resources, learner, samplers, self.lora)


def actor_label(key: str, index: int, of: int) -> str:
    """An actor's name in messages, from its group key (config/placement_schema.py: group_keys)."""
    if key == LEARNER:
        return f"learner rank {index} of {of}" if of > 1 else "learner"
    if key == SAMPLERS:
        return f"sampler replica {index}"
    kind, _, name = key.partition("/")
    what = f"{kind.replace('_', ' ')} {name}"
    return f"{what} replica {index}" if of > 1 else what


def run_placement(recipe) -> tuple[Any, BundlePlan] | None:
    """The run's placement group (`resources.placement`) and its plan, reserved; None without."""
    spec = getattr(recipe.resources, "placement", None)
    if spec is None:
        return None
    if "placement" in recipe.learner.model_fields_set:
        raise UserError("learner.placement: with resources.placement the learner's ranks are bundles of the run's "
                        "one placement group (resources.placement.strategy lays it out); drop learner.placement")
    plan = plan_bundles(group_keys(recipe), spec)
    group = placement_group_for(plan.bundles, plan.strategy, "the run's placement group (resources.placement)")
    print(f"k3post: placement group of {len(plan.bundles)} bundles, {plan.strategy}"
          f"{', learner and samplers colocated' if spec.colocate else ''}", flush=True)
    return group, plan


@contextmanager
def ray_backend(recipe) -> Iterator[RayBackend]:
    """A Ray backend for one run: the cluster joined (or a local one started) first, and left
    (broadcast groups shut down, then Ray) however the run ends. A Ray failure that came with the
    loss of a node holding actors of the run ends it as one NodeLost line (ray/node_loss.py)."""
    placement = getattr(recipe.resources, "placement", None) is not None
    print("k3post: " + connect(recipe.ray, cpus_needed(recipe), placement), flush=True)
    backend = None
    try:
        backend = RayBackend(run_placement(recipe))
        yield backend
    except (ray.exceptions.RayError, LearnerRankDied) as err:
        lost = explain_node_loss(err, backend.places) if backend is not None else None
        if lost is None:
            raise
        raise lost from None
    finally:
        disconnect()
