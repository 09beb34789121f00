"""What a loop needs from the engines, and nothing about where they run.

The same loop runs with in-process engines (tests, debugging: `ray.in_process: true`;
launch/in_process.py) or with Ray actor groups (ray/groups.py). Values that only pass from one
engine to another (full distributions) are opaque handles: a tensor in-process, an ObjectRef on
Ray, so they never travel through the driver; the student's weights move by a `WeightSync`
strategy chosen at launch, which the loop only asks to push.
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
    def full_logprobs(self, rollouts: Rollouts, temperature: float) -> Any: ...


class TeacherGroup(Protocol):
    def score(self, rollouts: Rollouts) -> Pending[torch.Tensor]: ...
    def score_full(self, rollouts: Rollouts) -> Pending[torch.Tensor]: ...
    def score_parts(self, rollouts: Rollouts, method: str, *args: Any) -> tuple[Pending[torch.Tensor], list[Any]]:
        """The engine's `method` (score_topk, score_with_full, score_with_hidden): the [B, T] logprobs
        of the sampled tokens for the driver, and the payload's handles for the learner (one per
        replica, in row order; an ObjectRef on Ray, which the driver never fetches)."""
        ...
    def output_head(self) -> Any: ...
    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts: ...
    def answer(self, prompts: list[Prompt], params: SamplingParams) -> Pending[Rollouts]:
        """`sample`, started now and awaited later (loss.teacher_answers overlaps it with the student's sampling)."""
        ...
    def exact_kl(self, rollouts: Rollouts, student_logprobs: Any, direction: str) -> Pending[dict[str, float]]: ...
    def alignment_counts(self) -> Pending[dict[str, float]]:
        """A cross-tokenizer teacher's alignment counts (algo/cross_tokenizer.py: alignment_counts)
        summed over the batches it scored since the last call, then reset; asked only of those."""
        ...
    def prefix_counts(self) -> Pending[dict[str, float]]:
        """Prompt tokens scored and encoded, rows that fell back to the uncached forward, scoring
        seconds (engine/teachers/teacher_prefix.py), summed since the last call, then reset; {} for vLLM."""
        ...
    def check_scores(self, rollouts: Rollouts) -> Pending[dict[str, float] | None]:
        """The drift gate's spot check (loops/drift_gate.py): {"max_abs_diff", "mean_abs_diff"} between
        the engine's scores of `rollouts` and an HF recomputation; None when the engine is HF itself."""
        ...


class Checkpointing(Protocol):
    """What the shared train loop needs of any learner: its state saved and restored."""

    def save_checkpoint(self, directory: str, run_state: dict) -> str: ...
    def load_checkpoint(self, directory: str) -> dict: ...


class LearnerHandle(Checkpointing, Protocol):
    """The learner group of OPD and RL (one process, or the ranks of a sharded learner acting as one)."""

    def train_step(self, batch: TrainBatch, *payloads: Any) -> dict[str, float]: ...
    def set_teacher_head(self, teacher: str, head: Any) -> None: ...


class SftLearner(Checkpointing, Protocol):
    """The learner group of SFT: a step on chat examples, and the held-out NLL."""

    def sft_step(self, examples: list[Prompt]) -> dict[str, float]: ...
    def sft_eval(self, examples: list[Prompt]) -> dict[str, float]: ...


class WeightSync(Protocol):
    """How the learner's weights reach the samplers: one strategy per transport (in process: a
    direct copy; on Ray: the object store, a broadcast group or CUDA IPC - ray/weight_sync.py)."""

    def push(self, version: int) -> None:
        """Every sampler holds the learner's current weights, tagged `version`, when this returns."""
