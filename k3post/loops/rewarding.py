"""Scoring rollouts with the rewards of their data sources, off the driver's critical path.

Each row is scored with the rewards *its* source names (like a prompt is routed to its
teacher): rule functions run in that source's `RewardPool` (threads beside the driver, failures
scored 0 and logged, never raised), reward models in their own engine groups (actors on Ray).
Every pool and every reward-model group is asked before any answer is awaited, so they all work
at the same time.

A row's reward is R = Σ_i w_i r_i over its source's rule rewards and reward models; each r_i is
kept unweighted for the metrics `rl/reward/<name>`.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from k3post.data.mixture import PromptMixture
from k3post.data.sources import HELDOUT_MARK
from k3post.loops.protocols import Pending
from k3post.rewards import RewardBatch, RewardPool, ScoredSample
from k3post.rewards.protocol import METRIC_PREFIX
from k3post.types import Prompt, Rollouts


class RewardModelGroup(Protocol):
    def score(self, prompts: list[Prompt], completions: list[str]) -> Pending[list[float]]: ...


@dataclass(frozen=True)
class ModelReward:
    """One use of a reward model by a source: metric name, model name, weight."""

    name: str
    model: str
    weight: float


@dataclass
class SourceRewards:
    pool: RewardPool  # the source's rule rewards (possibly none)
    models: list[ModelReward] = field(default_factory=list)


@dataclass
class ScoredRollouts:
    """Rewards of a batch: R per row (0 where the source has no rewards) and the per-sample detail."""

    rewards_B: torch.Tensor
    samples: list[ScoredSample | None]  # None: the row's source names no rewards
    sources: list[str]

    def metrics(self, pass_threshold: float, prefix: str = "rl/") -> dict[str, float]:
        """`rl/reward/<name>` (unweighted means), `rl/reward/total`, `rl/reward/failures`,
        `rl/reward/<name>/error` (failure rate), `rl/pass_rate` (R ≥ threshold) and the mean R of
        each source (`rl/source/<name>/reward`), over the rows that have rewards."""
        rows = [i for i, s in enumerate(self.samples) if s is not None]
        if not rows:
            return {}
        samples = [self.samples[i] for i in rows]
        rewards = [float(self.rewards_B[i]) for i in rows]
        metrics = RewardBatch(rewards, samples, sum(len(s.errors) for s in samples)).metrics()
        metrics["rl/pass_rate"] = sum(r >= pass_threshold for r in rewards) / len(rewards)
        for source in dict.fromkeys(self.sources[i] for i in rows):
            mine = [r for i, r in zip(rows, rewards) if self.sources[i] == source]
            metrics[f"rl/source/{source}/reward"] = sum(mine) / len(mine)
        return {prefix + k.removeprefix("rl/"): v for k, v in metrics.items()}


def metas_by_uid(data: PromptMixture) -> dict[str, dict]:
    """Each prompt's data row without id/messages: what a reward function receives as `meta`
    (the answer to check, the tests to run). Keyed like `Prompt.uid` (data/mixture.py)."""
    return {f"{source.name}/{row['id']}": {k: v for k, v in row.items() if k not in ("id", "messages", HELDOUT_MARK)}
            for source in data.sources for row in source.rows}


def repeat_prompts(prompts: list[Prompt], n: int) -> list[Prompt]:
    """Each prompt n times in a row: the group layout `algo.advantages.group_advantages` expects."""
    return [prompt for prompt in prompts for _ in range(n)]


def prompt_text(prompt: Prompt) -> str:
    """The prompt as a reward function sees it: the last user turn."""
    users = [content for role, content in prompt.messages if role == "user"]
    return users[-1] if users else prompt.messages[-1][1]


class RewardScorer:
    def __init__(self, by_source: dict[str, SourceRewards], models: dict[str, RewardModelGroup],
                 metas: dict[str, dict]):
        self.by_source, self.models, self.metas = by_source, models, metas

    def submit(self, rollouts: Rollouts) -> "PendingRewards":
        """Start every pool and reward-model group on its rows; returns at once."""
        rows: dict[str, list[int]] = {}
        for i, prompt in enumerate(rollouts.prompts):
            if prompt.source in self.by_source:
                rows.setdefault(prompt.source, []).append(i)
        lengths = rollouts.loss_mask_BT.sum(dim=1).tolist()
        jobs = []
        for source, idx in rows.items():
            prompts = [rollouts.prompts[i] for i in idx]
            texts = [rollouts.texts[i] for i in idx]
            metas = [{**self.metas.get(rollouts.prompts[i].uid, {}), "completion_tokens": int(lengths[i])}
                     for i in idx]
            rules = self.by_source[source].pool.submit([prompt_text(p) for p in prompts], texts, metas)
            models = [(use, self.models[use.model].score(prompts, texts)) for use in self.by_source[source].models]
            jobs.append((idx, rules, models))
        return PendingRewards(len(rollouts), [p.source for p in rollouts.prompts], jobs)


class PendingRewards:
    def __init__(self, size: int, sources: list[str], jobs: list[tuple[list[int], Future, list]]):
        self.size, self.sources, self.jobs = size, sources, jobs

    def result(self) -> ScoredRollouts:
        rewards_B = torch.zeros(self.size, dtype=torch.float32)
        samples: list[ScoredSample | None] = [None] * self.size
        for idx, rules, models in self.jobs:
            batch = rules.result()
            scores = [(use, pending.result()) for use, pending in models]
            for j, i in enumerate(idx):
                samples[i] = _with_model_scores(batch.samples[j], [(use, values[j]) for use, values in scores])
                rewards_B[i] = samples[i].reward
        return ScoredRollouts(rewards_B, samples, self.sources)


def _with_model_scores(sample: ScoredSample, scores: list[tuple[ModelReward, float]]) -> ScoredSample:
    """Add reward-model scores to a sample's rule rewards: R += w·s, component rl/reward/<name> = s."""
    if not scores:
        return sample
    components = dict(sample.components)
    reward = sample.reward
    for use, value in scores:
        components[METRIC_PREFIX + use.name] = float(value)
        reward += use.weight * float(value)
    return ScoredSample(reward=reward, components=components, errors=sample.errors)
