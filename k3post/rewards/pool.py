"""Scoring a batch of completions with rule rewards, off the driver's critical path.

Why threads, not processes. The expensive and dangerous reward (running model-written code)
already runs in its own killable subprocess (sandbox.py), so its thread only waits. The rest
(regexes, math-verify) are milliseconds. Threads take any callable — closures, lambdas,
functions loaded from a file that another process could not import by name — and return
results without pickling. The cost: a thread cannot be killed. A call that outlives
`timeout_s` is *abandoned*: its sample gets reward 0 with an error, `abandoned` counts it, and
its daemon thread runs on, unseen, until the function returns (it never blocks interpreter
exit). Bound the work inside long-running rewards themselves (the sandbox's kill, math-verify's
input cap).

Failure policy: a reward that raises, returns a malformed value or times out costs that
sample's reward (r = 0 for that reward, `rl/reward/<name>/error` = 1, the message in
`ScoredSample.errors`, a logged warning, `failures` + 1) — never the run.

`submit` returns a Future at once, so the driver can overlap scoring with other work (teacher
scoring, the next rollout); `score` waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from k3post.config.errors import UserError
from k3post.rewards.protocol import METRIC_PREFIX, RewardSpec, ScoredSample, combine_rewards

LOG = logging.getLogger(__name__)
RESERVED_NAMES = ("total", "failures")  # batch metrics live next to the per-reward ones


@dataclass(frozen=True)
class RewardBatch:
    """Combined rewards of a batch, in input order, and how many (sample, reward) calls failed."""

    rewards: list[float]
    samples: list[ScoredSample]
    num_failures: int

    def metrics(self) -> dict[str, float]:
        """Batch means: every component over the samples that report it; error flags (and the
        total) over all samples, so `rl/reward/<name>/error` is that reward's failure rate."""
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for sample in self.samples:
            for key, value in sample.components.items():
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
        size = max(len(self.samples), 1)
        out = {key: sums[key] / (size if key.endswith("/error") else counts[key]) for key in sums}
        out[METRIC_PREFIX + "total"] = sum(self.rewards) / size
        out[METRIC_PREFIX + "failures"] = float(self.num_failures)
        return out


def _call(spec: RewardSpec, index: int, prompt: str, completion: str, meta: dict, done: queue.SimpleQueue) -> None:
    try:
        done.put((index, spec.name, True, spec(prompt, completion, meta)))
    except BaseException as error:  # noqa: BLE001 - a reward's failure is data, not a crash
        done.put((index, spec.name, False, f"{type(error).__name__}: {error}"[:500]))


class RewardPool:
    """Runs every (sample, reward) call in a bounded set of daemon threads with a per-call timeout."""

    def __init__(self, specs: Sequence[RewardSpec], max_workers: int = 4, timeout_s: float = 30.0):
        names = [spec.name for spec in specs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise UserError(f"rewards: two rewards share the name(s) {duplicates}; give each a distinct name")
        reserved = sorted(set(names) & set(RESERVED_NAMES))
        if reserved:
            raise UserError(f"rewards: the name(s) {reserved} are reserved for batch metrics; rename the reward")
        if max_workers < 1 or not timeout_s > 0:
            raise ValueError(f"max_workers must be >= 1 and timeout_s > 0, got {max_workers}, {timeout_s}")
        self.specs = list(specs)
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.failures = 0  # cumulative over the pool's life, for a run-level counter
        self.abandoned = 0  # calls that timed out and whose thread may still be running
        self._lock = threading.Lock()

    def submit(self, prompts: Sequence[str], completions: Sequence[str], metas: Sequence[dict]) -> Future:
        """Start scoring in the background; the Future's result is a RewardBatch."""
        future: Future = Future()

        def work() -> None:
            try:
                future.set_result(self.score(prompts, completions, metas))
            except BaseException as error:  # noqa: BLE001 - hand it to whoever waits
                future.set_exception(error)

        threading.Thread(target=work, name="k3post-reward-batch", daemon=True).start()
        return future

    def score(self, prompts: Sequence[str], completions: Sequence[str], metas: Sequence[dict]) -> RewardBatch:
        if not len(prompts) == len(completions) == len(metas):
            sizes = (len(prompts), len(completions), len(metas))
            raise ValueError(f"prompts, completions, metas differ in length: {sizes}")
        outputs, errors = self._run_all(prompts, completions, metas)
        samples = [combine_rewards(self.specs, outputs[i], errors[i]) for i in range(len(prompts))]
        num_failures = 0
        for index, sample in enumerate(samples):
            for name, message in sample.errors.items():
                LOG.warning("reward %r failed on sample %d: %s", name, index, message)
            num_failures += len(sample.errors)
        with self._lock:
            self.failures += num_failures
        return RewardBatch(rewards=[s.reward for s in samples], samples=samples, num_failures=num_failures)

    def _run_all(self, prompts, completions, metas) -> tuple[list[dict], list[dict]]:
        """Every call, at most `max_workers` at a time, each timed from its own start."""
        outputs: list[dict] = [{} for _ in prompts]
        errors: list[dict] = [{} for _ in prompts]
        pending = deque((i, spec) for i in range(len(prompts)) for spec in self.specs)
        running: dict[tuple[int, str], float] = {}
        done: queue.SimpleQueue = queue.SimpleQueue()  # per batch: late answers of abandoned calls land nowhere
        while pending or running:
            while pending and len(running) < self.max_workers:
                index, spec = pending.popleft()
                args = (spec, index, prompts[index], completions[index], metas[index], done)
                threading.Thread(target=_call, args=args, name=f"k3post-reward-{spec.name}", daemon=True).start()
                running[(index, spec.name)] = time.monotonic()
            wait_s = min(running.values()) + self.timeout_s - time.monotonic()
            try:
                index, name, ok, value = done.get(timeout=max(wait_s, 0.0))
                if running.pop((index, name), None) is not None:
                    (outputs if ok else errors)[index][name] = value
            except queue.Empty:
                pass
            now = time.monotonic()
            for (index, name), started in list(running.items()):
                if now - started > self.timeout_s:
                    del running[(index, name)]
                    errors[index][name] = f"timed out after {self.timeout_s:g} s"
                    with self._lock:
                        self.abandoned += 1
        return outputs, errors
