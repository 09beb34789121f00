"""Asynchronous OPD (`train.mode: async`): the samplers draw step k+1 while the learner trains
on step k.

    step k:  wait for rollouts(k) → sync weights v(k−1) → start sampling(k+1) ─┐ (background)
             score(k) → train(k)                     ... sampling(k+1) runs ... │
    step k+1: wait for rollouts(k+1) ◄──────────────────────────────────────────┘

On a GPU generation is the long phase (a small model decodes one token per launch and leaves
most of the chip idle), so hiding scoring and training behind it shortens each step to about
max(sample, score + train) instead of their sum.

Staleness. Rollouts for step k+1 are drawn with the weights after k−1 updates and trained on
by a learner that has made k: they are exactly one update old (0 for the first step after a
start or resume). Nothing else changes in the maths: the loss's importance ratio
exp(log π_θ − log μ) uses the sampler's *recorded* log μ (algo/policy_loss.py), so its
expected gradient is the on-policy one for the current θ even though μ lags by a step; the
advantages −c·(log μ − log π_T) are estimates of KL(μ‖π_T), one step behind. Each step logs
`async/staleness` and `train/ratio_mean`; a staleness above 1 is a bug and stops the run.

Evaluation and checkpoints wait for the sample in flight, so they see a quiet sampler and
the learner's newest weights; a checkpoint records the data position from before the prompts
drawn ahead, so a resumed run trains on the batch the interrupted one had drawn but not used
(with fresh weights: after a resume the first step is not stale).

One loop function per mode: `run_distill` (loops/distill.py) is the synchronous one; both
share its pieces (`step_prompts`, `learn_from`, `with_timing`, `prepare`) and the driver
`train_loop` (loops/common.py). The background sample is a driver thread: in process it runs
the engine (GPU kernels and CPU torch ops release the GIL); on Ray it only waits for actors.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor

from k3post.loops.common import LoopParts, step_sampling, timed, train_loop
from k3post.loops.distill import (DistillRun, eval_line, evaluate_run, learn_from, prepare, print_before_after,
                                  step_prompts, with_timing)
from k3post.types import Rollouts

MAX_STALENESS = 1


class _DataAhead:
    """The prompt mixture as a checkpoint must record it: its state from before the batch that
    was drawn ahead and not trained on yet (if any)."""

    def __init__(self, data):
        self.data, self.before_ahead = data, None

    def state_dict(self) -> dict:
        return self.before_ahead if self.before_ahead is not None else self.data.state_dict()

    def input_metrics(self) -> dict[str, int]:
        return self.data.input_metrics()


class SamplePipeline:
    """At most one sample in flight, started for the next step while this one trains."""

    def __init__(self, run: DistillRun, synced_version: int):
        self.run = run
        self.data = _DataAhead(run.data)
        self.synced = synced_version  # the weight version the samplers hold
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3post-async-sample")
        self._pending: tuple[int, Future] | None = None

    def start(self, step: int) -> None:
        assert self._pending is None, "one sample in flight at most"
        self.data.before_ahead = copy.deepcopy(self.run.data.state_dict())
        prompts = step_prompts(self.run)
        params = step_sampling(self.run.recipe.sampling, self.run.recipe.train.seed, step)
        self._pending = (step, self._executor.submit(_timed_sample, self.run.samplers, prompts, params))

    def take(self, step: int) -> tuple[Rollouts, float]:
        """The rollouts of `step` (sampling them now if none are in flight) and the sampling time."""
        if self._pending is None:
            self.start(step)
        pending_step, future = self._pending
        assert pending_step == step, f"rollouts in flight are for step {pending_step}, not {step}"
        rollouts, seconds = future.result()
        self._pending, self.data.before_ahead = None, None
        return rollouts, seconds

    def settle(self) -> None:
        """Wait for the sample in flight (its result stays for `take`)."""
        if self._pending is not None:
            self._pending[1].result()

    def sync(self, version: int) -> None:
        """Give the samplers the learner's weights after `version` updates (never mid-sample)."""
        if self.synced != version:
            self.settle()
            self.run.weight_sync.push(version)
            self.synced = version

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _timed_sample(samplers, prompts, params) -> tuple[Rollouts, float]:
    start = time.perf_counter()
    rollouts = samplers.sample(prompts, params)
    return rollouts, time.perf_counter() - start


def async_step(run: DistillRun, pipeline: SamplePipeline, step: int) -> dict[str, float]:
    """One asynchronous step: take rollouts(step), sync, start rollouts(step + 1), score, train."""
    times: dict[str, float] = {}
    step_start = time.perf_counter()
    with timed(times, "sample_wait"):  # the part of sampling the learner could not hide
        rollouts, times["time/sample_s"] = pipeline.take(step)
    with timed(times, "sync"):
        pipeline.sync(step - 1)
    if step < run.recipe.train.steps:
        pipeline.start(step + 1)
    staleness = (step - 1) - rollouts.weight_version  # updates the learner made since these weights
    if not 0 <= staleness <= MAX_STALENESS:
        raise RuntimeError(f"step {step}: rollouts drawn with weights v{rollouts.weight_version}, the learner is at "
                           f"v{step - 1}: staleness {staleness} is outside [0, {MAX_STALENESS}]")
    metrics = learn_from(run, rollouts, times, step)
    metrics["async/staleness"] = float(staleness)
    return with_timing(metrics, times, rollouts, step_start)


def run_distill_async(run: DistillRun) -> list[dict]:
    """Train to `train.steps` with sampling one step ahead of training (resumes like run_distill)."""
    start, heldout = prepare(run)
    pipeline = SamplePipeline(run, synced_version=start)

    def evaluate(step: int) -> dict[str, float]:
        pipeline.sync(step)  # evaluate the learner's newest weights, with no sample in flight
        return evaluate_run(run, heldout, step)

    parts = LoopParts(run.run_dir, run.recipe.train, run.learner, pipeline.data,
                      step=lambda step: async_step(run, pipeline, step), evaluate=evaluate, describe_eval=eval_line)
    try:
        history = train_loop(parts, start)
    finally:
        pipeline.close()
    print_before_after(run, run.recipe.train.steps, run.recipe.eval.print_samples)
    return history
