"""Where engines run: a `Backend` turns engine classes into the groups the loops talk to.

Builders (launch/distill.py, rl.py, sft.py) say *what* to run - each engine class, its
constructor arguments and its group's resources, as an `EngineSpec` - and a backend decides
*where*: `InProcessBackend` (launch/in_process.py) makes the engines here, in this process (tests,
debugging); `RayBackend` (ray/backend.py) makes each replica a Ray actor with the group's
resources. Either way the builder gets back objects that satisfy the loops' protocols
(loops/protocols.py), so one builder per algorithm serves both.

The learner is a group like the others: `backend.learner(config, spec, resources)` makes
`resources.replicas` learner ranks acting as one (engine/sharded/learner_rank.py picks each rank's
class: today's one-process `Learner`, or an FSDP2 `ShardedLearner` rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from k3post.config.learner_schema import LearnerSpec
from k3post.config.schema import ResourceSpec, ResourcesSpec, SamplingSpec, TeacherSpec, VllmSpec

if TYPE_CHECKING:
    from k3post.engine.learner.learner import LearnerConfig
    from k3post.loops.protocols import SamplerGroup, TeacherGroup, WeightSync
    from k3post.loops.rewarding import RewardModelGroup


@dataclass(frozen=True)
class EngineSpec:
    """An engine class, its constructor arguments (`num_threads` aside: the backend passes it
    from the resources), and the resources of its group of `resources.replicas` copies.

    restarts: how often a dead replica is restarted and its call retried (Ray only): for engines
    whose answers depend only on their inputs (teachers, reward models) and for samplers whose
    weights can be re-sent to a new process (launch/engines.py, sampler_restarts)."""

    cls: type
    args: tuple
    resources: ResourceSpec
    restarts: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, **extra: Any) -> Any:
        """One engine, made in this process."""
        return self.cls(*self.args, **self.kwargs, **extra)

    @property
    def sleeps(self) -> bool:
        """A vLLM engine in sleep mode (`vllm.sleep`: its VllmSpec, or its teacher's, among the
        arguments). Backends build such engines one at a time: each measures the GPU memory it may
        take when it starts and goes to sleep once built, so the next finds that memory free."""
        return any((isinstance(a, VllmSpec) and a.sleep) or (isinstance(a, TeacherSpec) and a.vllm.sleep)
                   for a in self.args)


class Backend(Protocol):
    def learner(self, config: LearnerConfig, spec: LearnerSpec, resources: ResourceSpec) -> Any:
        """The learner group of `resources.replicas` ranks (a LearnerHandle for OPD and RL, an
        SftLearner for SFT); `spec`: how each rank holds the student (precision, sharding)."""

    def samplers(self, engine: EngineSpec, pad_id: int) -> SamplerGroup: ...

    def teacher(self, engine: EngineSpec) -> TeacherGroup: ...

    def reward_model(self, engine: EngineSpec) -> RewardModelGroup: ...

    def start(self, description: str) -> None:
        """Return once every engine made so far has loaded its model (`description`: for the log)."""

    def weight_sync(self, sampling: SamplingSpec, resources: ResourcesSpec, learner: Any,
                    samplers: SamplerGroup) -> WeightSync:
        """The strategy that moves the learner's weights to the samplers (`sampling.weight_transport`)."""
