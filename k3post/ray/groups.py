"""Engine groups over Ray actors: fan out, merge, and keep big values in the object store.

Actors are the engine classes themselves, made remote at launch (`ray.remote(**opts)(cls)`),
so no engine code knows about Ray. Weights and full distributions move actor-to-actor as
ObjectRefs: the driver never holds them.

Fault tolerance: sampler and teacher actors are restarted by Ray when their process dies, and
their calls retried (launch/engines.py, ACTOR_RESTARTS). A teacher reloads the same model, so a
retried score is the same score. A restarted sampler is back at the constructor's weights
(weight version 0), so every sampler call carries the version it must sample with and the
ObjectRef of the last weights sent: a replica whose version differs reloads them before it
samples. (With `sampling.weight_transport: collective` or `cuda_ipc` there is no ObjectRef to
reload from and a new process cannot join a broadcast group, so samplers are not restarted:
launch/engines.py, sampler_restarts; ray/weight_sync.py.)
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from k3post.config.errors import RunStopped

from k3post.types import Prompt, Rollouts, SamplingParams, concat_rollouts


def _cause(err: Exception) -> str:
    """The first line of Ray's account of a death, without its traceback."""
    text = str(err).strip().splitlines()
    return next((line.strip() for line in text if line.strip()), type(err).__name__)[:200]


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


def _sum_counts(values: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for counts in values:
        for key, value in counts.items():
            out[key] = out.get(key, 0.0) + value
    return out


def _synced_call(engine: Any, version: int, weights: list, method: str, *args: Any) -> Any:
    """Runs inside a sampler actor (through `__ray_call__`): make sure the replica holds weights
    `version`, then call `method`. `weights` wraps the ObjectRef in a list so that Ray does not
    fetch the weights for every call, only here, for a replica that lost them."""
    if engine.weight_version != version and weights:
        print(f"k3post: sampler (pid {os.getpid()}) holds weights v{engine.weight_version}, the run is at "
              f"v{version} (restarted?): reloading them", flush=True)
        engine.load_weights(ray.get(weights[0]), version)
    return getattr(engine, method)(*args)


class RaySamplers:
    def __init__(self, actors: list[Any], pad_id: int):
        self.actors, self.pad_id = actors, pad_id
        # The last weights sent and their version: what a restarted replica is re-synced from.
        self.weights_ref: ray.ObjectRef | None = None
        self.version = 0

    def _call(self, replica: int, method: str, *args: Any) -> ray.ObjectRef:
        box = [self.weights_ref] if self.weights_ref is not None else []
        return self.actors[replica].__ray_call__.remote(_synced_call, self.version, box, method, *args)

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        refs = []
        for replica, rows in enumerate(split_evenly(len(prompts), len(self.actors))):
            # Replicas draw with different seeds: identical seeds would correlate their samples.
            seeded = SamplingParams(params.max_new_tokens, params.temperature, params.top_p, params.seed + replica)
            refs.append(self._call(replica, "sample", prompts[rows], seeded))
        parts = ray.get(refs)
        stale = [p.weight_version for p in parts if p.weight_version != self.version]
        if stale:  # _synced_call guarantees this; a silent mix of policies would bias the update
            raise RuntimeError(f"samplers answered with weights {stale}, expected version {self.version}")
        return concat_rollouts(parts, self.pad_id)

    def forget_weights(self) -> None:
        """Let go of the last weights sent (before the learner exports new ones, so that the
        object store never holds two copies of the student: the quickstart's nearly fills it)."""
        self.weights_ref = None

    def load_from_store(self, ref: ray.ObjectRef, version: int) -> None:
        """Every replica loads the weights behind `ref` as `version`; `ref` is kept for re-syncing
        a restarted replica (object-store transport)."""
        ray.get([actor.load_weights.remote(ref, version) for actor in self.actors])
        self.weights_ref, self.version = ref, version

    def loaded(self, version: int) -> None:
        """The replicas hold `version`, delivered by another transport (nothing to re-sync from)."""
        self.version = version

    def full_logprobs(self, rollouts: Rollouts, temperature: float) -> ray.ObjectRef:
        return self._call(0, "full_logprobs", rollouts, temperature)

    def weight_checksums(self, names: list[str]) -> list[dict]:
        """Each replica's checksums of the named tensors (engine/transport/weight_check.py), in replica order
        (through `_call`: a restarted replica re-syncs first, and what it then holds is checked)."""
        return ray.get([self._call(replica, "weight_checksums", names) for replica in range(len(self.actors))])


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

    def score_parts(self, rollouts: Rollouts, method: str, *args: Any) -> tuple[RefsResult, list[ray.ObjectRef]]:
        """Each replica's `method` with two return values: the [B, T] logprobs (merged here when
        the driver awaits them) and the payload's ObjectRef, left in the object store for the learner."""
        summaries, payloads = [], []
        for replica, rows in enumerate(split_evenly(len(rollouts), len(self.actors))):
            part = rollouts.select(list(range(rows.start, rows.stop)))
            summary, payload = getattr(self.actors[replica], method).options(num_returns=2).remote(part, *args)
            summaries.append(summary)
            payloads.append(payload)
        return RefsResult(summaries, _cat_rows), payloads

    def output_head(self) -> ray.ObjectRef:
        return self.actors[0].output_head.remote()

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        return self.answer(prompts, params).result()

    def answer(self, prompts: list[Prompt], params: SamplingParams) -> RefsResult:
        """The teacher's own answers, pending (the driver starts them before the student samples)."""
        return RefsResult([self.actors[0].sample.remote(prompts, params)])

    def exact_kl(self, rollouts: Rollouts, student_logprobs: Any, direction: str) -> RefsResult:
        return RefsResult([self.actors[0].exact_kl.remote(rollouts, student_logprobs, direction)])

    def alignment_counts(self) -> RefsResult:
        """Every replica's counts since the last call (one that scored nothing answers {}), summed."""
        return RefsResult([actor.alignment_counts.remote() for actor in self.actors], _sum_counts)

    def prefix_counts(self) -> RefsResult:
        """Every replica's prompt-prefix counts since the last call (engine/teachers/teacher_prefix.py), summed."""
        return RefsResult([actor.prefix_counts.remote() for actor in self.actors], _sum_counts)

    def check_scores(self, rollouts: Rollouts) -> RefsResult:
        """Every replica spot-checks its engine's scores on the first rows of its share of the batch
        (VLLMTeacher.check_scores); merged: the largest max |Δ| and the mean of the means."""
        from k3post.engine.teachers.vllm_teacher import merge_score_checks  # noqa: PLC0415  (vLLM itself stays unimported)

        pending = self._fan_out("check_scores", rollouts)
        return RefsResult(pending.refs, merge_score_checks)


# How long a rank whose collective failed waits for its peers' calls to show whether one of them died.
PEER_DEATH_S = 30.0


def _first_actor_death(refs: list[ray.ObjectRef], timeout_s: float) -> tuple[ray.ObjectRef, Exception] | None:
    """The first of these calls whose actor died (and Ray's error), among those done within `timeout_s`."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as err:
            return ref, err
        except ray.exceptions.RayError:
            continue
    return None


class LearnerRankDied(RunStopped):
    """A learner rank's process is gone: the run ends (re-running it resumes from the last checkpoint)."""


class RayLearner:
    """The learner group: its rank actors act as one (rank 0 answers for the group)."""

    def __init__(self, actors: list[Any]):
        self.actors = actors
        self.rank0 = actors[0]

    def _all(self, method: str, *args: Any) -> Any:
        """Call `method` on every rank (they take part in the same collectives); rank 0's answer."""
        refs = [getattr(actor, method).remote(*args) for actor in self.actors]
        self.wait(refs, method)
        return ray.get(refs[0])

    def wait(self, refs: list[ray.ObjectRef], method: str) -> None:
        """Wait for one call per rank (in rank order). A rank that dies ends the wait at once,
        naming it: the others would wait for it in a collective until the group's timeout."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as err:
                raise self._died(refs, done[0], method, err) from None
            except ray.exceptions.RayTaskError:
                # A surviving rank's collective fails when its peer dies, and its error can arrive
                # first: name the rank that died, if one did, rather than the survivor's symptom.
                dead = _first_actor_death(pending, PEER_DEATH_S)
                if dead is None:
                    raise
                raise self._died(refs, dead[0], method, dead[1]) from None

    @staticmethod
    def _died(refs: list[ray.ObjectRef], ref: ray.ObjectRef, method: str, err: Exception) -> LearnerRankDied:
        return LearnerRankDied(f"learner rank {refs.index(ref)} of {len(refs)} died during {method} ({_cause(err)}); "
                               f"re-run the same command to resume from the last checkpoint")

    def train_step(self, batch, *payloads) -> dict[str, float]:
        """`payloads`: the teachers' ObjectRefs, top-level arguments so that Ray resolves them in
        each rank's process (fetched there from the teachers' stores, not through the driver)."""
        return self._all("train_step", batch, *payloads)

    def set_teacher_head(self, teacher: str, head: ray.ObjectRef) -> None:
        self._all("set_teacher_head", teacher, head)

    def export_weights(self) -> ray.ObjectRef:
        """The newest weights, exported into the object store by rank 0 in host memory (every rank
        takes part: a sharded learner gathers the full tensors)."""
        refs = [actor.host_weights.remote() for actor in self.actors]
        self.wait(refs, "weights")
        return refs[0]

    def sft_step(self, examples) -> dict[str, float]:
        return self._all("sft_step", examples)

    def sft_eval(self, examples) -> dict[str, float]:
        return self._all("sft_eval", examples)

    def save_checkpoint(self, directory: str, run_state: dict) -> str:
        return self._all("save_checkpoint", directory, run_state)

    def load_checkpoint(self, directory: str) -> dict:
        return self._all("load_checkpoint", directory)
