"""The Ray backend: every engine group becomes Ray actors with the group's resources.

Engines are plain classes; they become actors only here (`ray.remote(**options)(cls)`), so no
engine code knows about Ray. `ray_backend(recipe)` joins or starts the cluster (ray/cluster.py)
for the length of a run.

With `resources.placement` the run first reserves one placement group, a bundle per actor
(config/placement_schema.py: plan_bundles), and each actor is made in its bundle: the learner's
ranks, the samplers (with `colocate`, in the learner's bundle), each teacher's and reward
model's replicas. Without it Ray places each actor where it fits.
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
from k3post.engine.learner import Learner, LearnerConfig
from k3post.engine.learner_rank import learner_class
from k3post.launch.backend import EngineSpec
from k3post.launch.describe import learner_group_line
from k3post.launch.engines import cpus_needed
from k3post.ray.cluster import connect, disconnect
from k3post.ray.groups import RayLearner, RaySamplers, RayTeacher
from k3post.ray.learner_group import in_bundle, learner_ranks, placement_group_for
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
        self.actors += made
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
        return RayLearner(ranks, sharded=cls is not Learner)

    def samplers(self, engine: EngineSpec, pad_id: int) -> RaySamplers:
        return RaySamplers(self._group(engine, SAMPLERS), pad_id)

    def teacher(self, engine: EngineSpec) -> RayTeacher:
        return RayTeacher(self._group(engine, f"teacher/{engine.args[0]}"))

    def reward_model(self, engine: EngineSpec) -> RayRewardModel:
        return RayRewardModel(self._group(engine, f"reward_model/{engine.args[0]}"))

    def start(self, description: str) -> None:
        started = time.perf_counter()
        ray.get([actor.__ray_ready__.remote() for actor in self.actors])  # constructors done: models loaded
        print(f"k3post: {len(self.actors)} actors ready in {time.perf_counter() - started:.0f}s ({description})")

    def weight_sync(self, sampling: SamplingSpec, resources: ResourcesSpec, learner: RayLearner,
                    samplers: RaySamplers):
        return connect_weights(sampling, resources, learner, samplers, self.lora)


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
    (broadcast groups shut down, then Ray) however the run ends."""
    placement = getattr(recipe.resources, "placement", None) is not None
    print("k3post: " + connect(recipe.ray, cpus_needed(recipe), placement), flush=True)
    try:
        yield RayBackend(run_placement(recipe))
    finally:
        disconnect()
