"""The in-process backend: every engine in this process, the loops' protocols over them.

Used by tests and for debugging (`ray.in_process: true` in a recipe, or `k3post run
--in-process`): no Ray, no serialisation, breakpoints work. The engines share this process's
cores (each group's `threads` is for actors of their own; here the process keeps torch's setting).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from k3post.config.errors import UserError
from k3post.config.learner_schema import LearnerSpec
from k3post.config.schema import ResourceSpec, ResourcesSpec, SamplingSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.sharded.learner_rank import group_backend, make_learner
from k3post.engine.sharded.rank import RankSpec, free_port
from k3post.engine.transport.weight_check import check_replicas
from k3post.launch.backend import EngineSpec
from k3post.loops.protocols import Done
from k3post.types import Prompt, Rollouts, SamplingParams

if TYPE_CHECKING:  # vLLM is optional
    from k3post.engine.samplers.sampler import HFSampler
    from k3post.engine.teachers.teacher import TeacherScorer
    from k3post.engine.samplers.vllm_sampler import VLLMSampler
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher


class LocalSamplers:
    def __init__(self, engine: HFSampler | VLLMSampler):
        self.engine = engine

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        return self.engine.sample(prompts, params)

    def full_logprobs(self, rollouts: Rollouts, temperature: float) -> torch.Tensor:
        return self.engine.full_logprobs(rollouts, temperature)


class LocalTeacher:
    def __init__(self, engine: TeacherScorer | VLLMTeacher):
        self.engine = engine

    def score(self, rollouts: Rollouts) -> Done[torch.Tensor]:
        return Done(self.engine.score(rollouts))

    def score_full(self, rollouts: Rollouts) -> Done[torch.Tensor]:
        return Done(self.engine.score_full(rollouts))

    def score_parts(self, rollouts: Rollouts, method: str, *args: Any) -> tuple[Done[torch.Tensor], list[Any]]:
        token_logprobs_BT, payload = getattr(self.engine, method)(rollouts, *args)
        return Done(token_logprobs_BT), [payload]

    def output_head(self) -> torch.Tensor:
        return self.engine.output_head()

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        return self.engine.sample(prompts, params)

    def answer(self, prompts: list[Prompt], params: SamplingParams) -> Done[Rollouts]:
        return Done(self.engine.sample(prompts, params))

    def exact_kl(self, rollouts: Rollouts, student_logprobs: Any, direction: str) -> Done[dict[str, float]]:
        return Done(self.engine.exact_kl(rollouts, student_logprobs, direction))

    def check_scores(self, rollouts: Rollouts) -> Done[dict[str, float] | None]:
        return Done(self.engine.check_scores(rollouts))

    def alignment_counts(self) -> Done[dict[str, float]]:
        return Done(self.engine.alignment_counts())

    def prefix_counts(self) -> Done[dict[str, float]]:
        return Done(self.engine.prefix_counts())


class LocalRewardModel:
    def __init__(self, engine: Any):
        self.engine = engine

    def score(self, prompts: list[Prompt], completions: list[str]) -> Done[list[float]]:
        return Done(self.engine.score(prompts, completions))


class DirectWeightSync:
    """In one process the samplers copy the learner's tensors directly (device to device), then
    a few tensors are checksummed on both sides (engine/transport/weight_check.py)."""

    def __init__(self, learner: Learner, samplers: LocalSamplers):
        self.learner, self.samplers = learner, samplers

    def push(self, version: int) -> None:
        self.samplers.engine.load_weights(self.learner.weights(), version)
        expected = self.learner.weight_checksums(version)
        check_replicas(expected, [self.samplers.engine.weight_checksums(list(expected))], version)


class InProcessBackend:
    def learner(self, config: LearnerConfig, spec: LearnerSpec, resources: ResourceSpec) -> Learner:
        if resources.replicas != 1:
            raise UserError(f"resources.learner.replicas: {resources.replicas} learner ranks are Ray actors; the "
                            f"in-process backend (--in-process, ray.in_process) runs one rank")
        rank = RankSpec(backend=group_backend(config.device), port=free_port())
        return make_learner(dataclasses.replace(config, num_threads=None), spec, rank)

    def samplers(self, engine: EngineSpec, pad_id: int) -> LocalSamplers:
        return LocalSamplers(engine.build())

    def teacher(self, engine: EngineSpec) -> LocalTeacher:
        return LocalTeacher(engine.build())

    def reward_model(self, engine: EngineSpec) -> LocalRewardModel:
        return LocalRewardModel(engine.build())

    def start(self, description: str) -> None:
        """Engines made in this process are ready when made."""

    def weight_sync(self, sampling: SamplingSpec, resources: ResourcesSpec, learner: Learner,
                    samplers: LocalSamplers) -> DirectWeightSync:
        return DirectWeightSync(learner, samplers)
