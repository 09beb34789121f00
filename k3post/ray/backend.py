"""The Ray backend: every engine group becomes Ray actors with the group's resources.

Engines are plain classes; they become actors only here (`ray.remote(**options)(cls)`), so no
engine code knows about Ray. `ray_backend(recipe)` joins or starts the cluster (ray/cluster.py)
for the length of a run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from k3post.config.schema import ResourceSpec, ResourcesSpec, SamplingSpec
from k3post.config.learner_schema import LearnerSpec
from k3post.engine.learner import Learner, LearnerConfig
from k3post.engine.learner_rank import learner_class
from k3post.launch.backend import EngineSpec
from k3post.launch.engines import cpus_needed
from k3post.ray.cluster import connect, disconnect
from k3post.ray.groups import RayLearner, RaySamplers, RayTeacher
from k3post.ray.learner_group import learner_ranks
from k3post.ray.reward_models import RayRewardModel
from k3post.ray.weight_sync import connect_weights


def remote(cls: type, res: ResourceSpec, restarts: int):
    """`cls` as a Ray actor class with the group's resources. `restarts`: how often Ray restarts a
    dead actor and retries its call."""
    return ray.remote(num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_restarts=restarts,
                      max_task_retries=restarts)(cls)


class RayBackend:
    def __init__(self):
        self.actors: list[Any] = []  # every actor made, for `start`

    def _group(self, engine: EngineSpec) -> list[Any]:
        actor_cls = remote(engine.cls, engine.resources, engine.restarts)
        made = [actor_cls.remote(*engine.args, **engine.kwargs, num_threads=engine.resources.threads)
                for _ in range(engine.resources.replicas)]
        self.actors += made
        return made

    def learner(self, config: LearnerConfig, spec: LearnerSpec, resources: ResourceSpec) -> RayLearner:
        """The learner's ranks as actors in one placement group (`learner.placement`), joined in one
        torch.distributed group whose store rank 0's node hosts. The learner's weights and
        optimizer live only in its ranks: a restarted rank would silently go on from the initial
        weights, so none is restarted; a rank's death ends the run, and re-running resumes from
        the last checkpoint."""
        cls = learner_class(config, spec, resources.replicas)
        if cls is Learner:
            ranks = [remote(Learner, resources, 0).remote(config)]
        else:
            ranks = learner_ranks(cls, config, spec, resources)
        self.actors += ranks
        return RayLearner(ranks, sharded=cls is not Learner)

    def samplers(self, engine: EngineSpec, pad_id: int) -> RaySamplers:
        return RaySamplers(self._group(engine), pad_id)

    def teacher(self, engine: EngineSpec) -> RayTeacher:
        return RayTeacher(self._group(engine))

    def reward_model(self, engine: EngineSpec) -> RayRewardModel:
        return RayRewardModel(self._group(engine))

    def start(self, description: str) -> None:
        started = time.perf_counter()
        ray.get([actor.__ray_ready__.remote() for actor in self.actors])  # constructors done: models loaded
        print(f"k3post: {len(self.actors)} actors ready in {time.perf_counter() - started:.0f}s ({description})")

    def weight_sync(self, sampling: SamplingSpec, resources: ResourcesSpec, learner: RayLearner,
                    samplers: RaySamplers):
        return connect_weights(sampling, resources, learner, samplers)


@contextmanager
def ray_backend(recipe) -> Iterator[RayBackend]:
    """A Ray backend for one run: the cluster joined (or a local one started) first, and left
    (broadcast groups shut down, then Ray) however the run ends."""
    print("k3post: " + connect(recipe.ray, cpus_needed(recipe)))
    try:
        yield RayBackend()
    finally:
        disconnect()
