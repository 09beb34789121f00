"""Reward-model groups over Ray actors: the rows of a batch split across the replicas, scores
merged back in order. Like a teacher group, each reward model has its own actors and resources."""

from __future__ import annotations

from typing import Any

from k3post.ray.groups import RefsResult, split_evenly
from k3post.types import Prompt


def _concat(values: list[list[float]]) -> list[float]:
    return [x for part in values for x in part]


class RayRewardModel:
    def __init__(self, actors: list[Any]):
        self.actors = actors

    def score(self, prompts: list[Prompt], completions: list[str]) -> RefsResult:
        refs = [self.actors[replica].score.remote(prompts[rows], completions[rows])
                for replica, rows in enumerate(split_evenly(len(prompts), len(self.actors)))]
        return RefsResult(refs, _concat)
