"""vLLM's sleep mode around an engine's turns, so that engines sharing one GPU take it in turn.

One GPU holds the learner, a vLLM sampler and vLLM teachers only if each phase of a step finds
the memory it needs when it runs. vLLM's sleep mode (`LLM(enable_sleep_mode=True)`, CUDA only)
allocates an engine's weights and KV cache through its own allocator, tagged, so that

    llm.sleep(level=1)     copies the weights to pinned host memory and unmaps both tags:
                           the device memory goes back to the driver, usable by anyone;
    llm.wake_up(tags)      maps the tagged memory again and copies the weights back.

An engine with `vllm.sleep` sleeps between its turns (the loop's phases run one after another:
sample → score → train → sync):

    sampler   wake → generate → sleep        a weight sync wakes "weights" alone, writes the new
                                             ones, and the next rollout wakes "kv_cache"
    teacher   wake → score → sleep

Level 1 throughout: the weights come back on wake, so any order of calls is safe (level 2 drops
them instead, saving the host copy, but a sampler woken without a sync in between would sample
from garbage). The allocator is one per process (vLLM's `CuMemAllocator`), so two sleeping
engines must not share a process: each runs its engine core in its own process
(engine/vllm/vllm_engine.py) or its own Ray actor.

What each turn costs is measured: seconds to sleep and to wake, and the device memory free after
each (`torch.cuda.mem_get_info`), summed by `take_counts` into the step's metrics.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

TAGS = ("weights", "kv_cache")


def free_gib() -> float:
    """Device memory free now, in GiB (every process's use counted: what the next phase finds)."""
    return torch.cuda.mem_get_info()[0] / 2**30


class Sleeper:
    """Puts one engine to sleep between turns and wakes it for the next (a no-op when disabled)."""

    def __init__(self, llm: Any, enabled: bool):
        self.llm, self.enabled = llm, enabled
        self.awake: set[str] = set(TAGS)  # a new engine is awake
        self.counts: dict[str, float] = {}

    def _add(self, key: str, value: float) -> None:
        self.counts[key] = self.counts.get(key, 0.0) + value

    def wake(self, tags: tuple[str, ...] = TAGS) -> None:
        """Map and restore `tags` (those still asleep); the weights before the KV cache."""
        missing = [tag for tag in TAGS if tag in tags and tag not in self.awake]
        if not self.enabled or not missing:
            return
        started = time.perf_counter()
        self.llm.wake_up(tags=missing)
        self.awake.update(missing)
        self._add("wake_s", time.perf_counter() - started)
        self._add("wakes", 1.0)
        self.counts["free_gib_awake"] = free_gib()

    def sleep(self) -> None:
        """Weights to host memory, KV cache freed (level 1); nothing to do when already asleep."""
        if not self.enabled or not self.awake:
            return
        self.wake()  # vLLM sleeps whole: a half-woken engine is woken first
        started = time.perf_counter()
        self.llm.sleep(level=1)
        self.awake.clear()
        self._add("sleep_s", time.perf_counter() - started)
        self._add("sleeps", 1.0)
        self.counts["free_gib_asleep"] = free_gib()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Awake for the block, asleep after it (also when it raises: the GPU is shared)."""
        self.wake()
        try:
            yield
        finally:
            self.sleep()

    def take_counts(self) -> dict[str, float]:
        """The seconds and counts summed since the last call (and the last free-memory readings); reset."""
        counts, self.counts = self.counts, {}
        return counts
