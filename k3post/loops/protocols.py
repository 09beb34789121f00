"""What a loop needs from the engines, and nothing about where they run.

The same loop runs with in-process engines (tests, debugging: `ray.in_process: true`) or with
Ray actor groups (dist/ray_groups.py). Values that only pass from one engine to another
(weights, full distributions) are opaque handles: a tensor in-process, an ObjectRef on Ray, so
they never travel through the driver.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import torch

from k3post.types import Prompt, Rollouts, SamplingParams, TrainBatch

T = TypeVar("T")


class Pending(Protocol[T]):
    def result(self) -> T: ...


class Done(Generic[T]):
    """An already-computed result (in-process engines)."""

    def __init__(self, value: T):
        self.value = value

    def result(self) -> T:
        return self.value


class SamplerGroup(Protocol):
    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts: ...
    def load_weights(self, weights: Any, version: int) -> None: ...
    def full_logprobs(self, rollouts: Rollouts, temperature: float) -> Any: ...


class TeacherGroup(Protocol):
    def score(self, rollouts: Rollouts) -> Pending[torch.Tensor]: ...
    def score_full(self, rollouts: Rollouts) -> Pending[torch.Tensor]: ...
    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts: ...
    def exact_kl(self, rollouts: Rollouts, student_logprobs: Any, direction: str) -> Pending[dict[str, float]]: ...


class LearnerHandle(Protocol):
    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...
    def weights(self) -> Any: ...
    def save_checkpoint(self, directory: str, run_state: dict) -> str: ...
    def load_checkpoint(self, directory: str) -> dict: ...
