"""In-process engine groups: the loop's protocols over engines living in this process.

Used by tests and for debugging (`ray.in_process: true` in a recipe, or `k3post run
--in-process`): no Ray, no serialisation, breakpoints work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from k3post.engine.sampler import HFSampler
from k3post.engine.teacher import TeacherScorer
from k3post.loops.protocols import Done
from k3post.types import Prompt, Rollouts, SamplingParams

if TYPE_CHECKING:  # vLLM is optional
    from k3post.engine.vllm_sampler import VLLMSampler
    from k3post.engine.vllm_teacher import VLLMTeacher


class LocalSamplers:
    def __init__(self, engine: HFSampler | VLLMSampler):
        self.engine = engine

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        return self.engine.sample(prompts, params)

    def load_weights(self, weights: dict, version: int) -> None:
        self.engine.load_weights(weights, version)

    def full_logprobs(self, rollouts: Rollouts, temperature: float) -> torch.Tensor:
        return self.engine.full_logprobs(rollouts, temperature)


class LocalTeacher:
    def __init__(self, engine: TeacherScorer | VLLMTeacher):
        self.engine = engine

    def score(self, rollouts: Rollouts) -> Done[torch.Tensor]:
        return Done(self.engine.score(rollouts))

    def score_full(self, rollouts: Rollouts) -> Done[torch.Tensor]:
        return Done(self.engine.score_full(rollouts))

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        return self.engine.sample(prompts, params)

    def exact_kl(self, rollouts: Rollouts, student_logprobs: Any, direction: str) -> Done[dict[str, float]]:
        return Done(self.engine.exact_kl(rollouts, student_logprobs, direction))
