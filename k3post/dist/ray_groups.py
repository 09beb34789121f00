"""Engine groups over Ray actors: fan out, merge, and keep big values in the object store.

Actors are the engine classes themselves, made remote at launch (`ray.remote(**opts)(cls)`),
so no engine code knows about Ray. Weights and full distributions move actor-to-actor as
ObjectRefs: the driver never holds them.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from k3post.types import Prompt, Rollouts, SamplingParams, concat_rollouts


class RefsResult:
    """Pending results of several actor calls, merged by `merge` when awaited."""

    def __init__(self, refs: list[ray.ObjectRef], merge=None):
        self.refs, self.merge = refs, merge

    def result(self) -> Any:
        values = ray.get(self.refs)
        return self.merge(values) if self.merge else values[0]


def split_evenly(n: int, parts: int) -> list[slice]:
    """Contiguous slices of range(n) whose sizes differ by at most one (empty ones dropped)."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _cat_rows(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(values, dim=0)


class RaySamplers:
    def __init__(self, actors: list[Any], pad_id: int):
        self.actors, self.pad_id = actors, pad_id

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        refs = []
        for replica, rows in enumerate(split_evenly(len(prompts), len(self.actors))):
            # Replicas draw with different seeds: identical seeds would correlate their samples.
            seeded = SamplingParams(params.max_new_tokens, params.temperature, params.top_p, params.seed + replica)
            refs.append(self.actors[replica].sample.remote(prompts[rows], seeded))
        return concat_rollouts(ray.get(refs), self.pad_id)

    def load_weights(self, weights: Any, version: int) -> None:
        ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        ray.get([actor.load_weights.remote(ref, version) for actor in self.actors])

    def full_logprobs(self, rollouts: Rollouts, temperature: float) -> ray.ObjectRef:
        return self.actors[0].full_logprobs.remote(rollouts, temperature)


class RayTeacher:
    def __init__(self, actors: list[Any]):
        self.actors = actors

    def _fan_out(self, method: str, rollouts: Rollouts) -> RefsResult:
        refs = []
        for replica, rows in enumerate(split_evenly(len(rollouts), len(self.actors))):
            part = rollouts.select(list(range(rows.start, rows.stop)))
            refs.append(getattr(self.actors[replica], method).remote(part))
        return RefsResult(refs, _cat_rows)

    def score(self, rollouts: Rollouts) -> RefsResult:
        return self._fan_out("score", rollouts)

    def score_full(self, rollouts: Rollouts) -> RefsResult:
        return self._fan_out("score_full", rollouts)

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        return ray.get(self.actors[0].sample.remote(prompts, params))

    def exact_kl(self, rollouts: Rollouts, student_logprobs: Any, direction: str) -> RefsResult:
        return RefsResult([self.actors[0].exact_kl.remote(rollouts, student_logprobs, direction)])


class RayLearner:
    def __init__(self, actor: Any):
        self.actor = actor

    def train_step(self, batch) -> dict[str, float]:
        return ray.get(self.actor.train_step.remote(batch))

    def weights(self) -> ray.ObjectRef:
        return self.actor.weights.remote()

    def save_checkpoint(self, directory: str, run_state: dict) -> str:
        return ray.get(self.actor.save_checkpoint.remote(directory, run_state))

    def load_checkpoint(self, directory: str) -> dict:
        return ray.get(self.actor.load_checkpoint.remote(directory))
