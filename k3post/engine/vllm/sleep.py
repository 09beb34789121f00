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

A sampler sleeps at level 1 every time: the weights come back on wake, so any order of calls is
safe (level 2 drops them instead, but a sampler woken without a sync in between would sample from
garbage). A teacher's weights never change, so copying them to the host at every sleep is waste
(into freshly pinned memory, ~6 GiB/s measured, against ~40 GiB/s for the copy back). A frozen
engine (`keep_weights`) therefore sleeps at level 1 once, keeps that host copy for the rest of the
run, and sleeps at level 2 after that (nothing copied); each wake hands the kept copy back to
vLLM's allocator, whose wake copies it in as it would its own:

    first sleep   level 1, then `_keep_host_copies` in the worker: a reference to each weights
                  allocation's host copy (vLLM's wake would drop its own)
    later sleeps  level 2: device memory unmapped, nothing copied
    each wake     `_lend_host_copies` in the worker (refused if the allocations changed since),
                  then vLLM's wake: map, copy the host copy in

The allocator is one per process (vLLM's `CuMemAllocator`), so two sleeping engines must not
share a process: each runs its engine core in its own process (engine/vllm/vllm_engine.py) or
its own Ray actor.

What each turn costs is measured: seconds to sleep and to wake, and the device memory free after
each (`torch.cuda.mem_get_info`), summed by `take_counts` into the step's metrics.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

TAGS = ("weights", "kv_cache")
WEIGHTS_TAG = "weights"  # vLLM's tag for the model's allocations (CuMemAllocator.use_memory_pool)


def free_gib() -> float:
    """Device memory free now, in GiB (every process's use counted: what the next phase finds)."""
    return torch.cuda.mem_get_info()[0] / 2**30


class Sleeper:
    """Puts one engine to sleep between turns and wakes it for the next (a no-op when disabled).
    `keep_weights`: the engine's weights never change (a teacher): sleep without copying them
    after the first time (the module docstring)."""

    def __init__(self, llm: Any, enabled: bool, keep_weights: bool = False):
        self.llm, self.enabled, self.keep_weights = llm, enabled, keep_weights
        self.awake: set[str] = set(TAGS)  # a new engine is awake
        self.counts: dict[str, float] = {}
        self.kept = False  # a host copy of the weights is kept in the worker (after the first sleep)

    def _add(self, key: str, value: float) -> None:
        self.counts[key] = self.counts.get(key, 0.0) + value

    def wake(self, tags: tuple[str, ...] = TAGS) -> None:
        """Map and restore `tags` (those still asleep); the weights before the KV cache."""
        missing = [tag for tag in TAGS if tag in tags and tag not in self.awake]
        if not self.enabled or not missing:
            return
        started = time.perf_counter()
        if self.kept and WEIGHTS_TAG in missing:  # (after the first, level-1 sleep the copy lent is vLLM's own)
            self.llm.collective_rpc(_lend_host_copies)
        self.llm.wake_up(tags=missing)
        self.awake.update(missing)
        self._add("wake_s", time.perf_counter() - started)
        self._add("wakes", 1.0)
        self.counts["free_gib_awake"] = free_gib()

    def sleep(self) -> None:
        """Weights to host memory (or, for a frozen engine with its copy kept, dropped), KV cache
        freed; nothing to do when already asleep."""
        if not self.enabled or not self.awake:
            return
        self.wake()  # vLLM sleeps whole: a half-woken engine is woken first
        started = time.perf_counter()
        self.llm.sleep(level=2 if self.kept else 1)
        if self.keep_weights and not self.kept:
            self.llm.collective_rpc(_keep_host_copies)
            self.kept = True
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


def _weight_allocations() -> dict[int, Any]:
    """The worker's weights allocations in vLLM's sleep allocator: device address -> its record
    (`handle[1]` its bytes, `cpu_backup_tensor` the host copy a level-1 sleep made)."""
    from vllm.device_allocator.cumem import CuMemAllocator  # noqa: PLC0415

    entries = CuMemAllocator.get_instance().pointer_to_data
    return {ptr: data for ptr, data in entries.items() if data.tag == WEIGHTS_TAG}


def _keep_host_copies(worker: Any) -> int:
    """Runs in each worker right after its first (level-1) sleep: keeps a reference to every
    weights allocation's host copy, which vLLM's wake would otherwise let go. The bytes kept."""
    allocations = _weight_allocations()
    if any(data.cpu_backup_tensor is None for data in allocations.values()):
        raise RuntimeError("a frozen vLLM engine's first sleep left a weights allocation without a host copy")
    worker.k3post_host_weights = {ptr: data.cpu_backup_tensor for ptr, data in allocations.items()}
    return sum(copy.numel() for copy in worker.k3post_host_weights.values())


def _lend_host_copies(worker: Any) -> int:
    """Runs in each worker before a wake that follows a level-2 sleep: gives every weights
    allocation its kept host copy back, for vLLM's wake to copy in. Refused if the allocations
    are not those of the first sleep (their addresses and sizes): the copy would not fit them."""
    allocations, kept = _weight_allocations(), getattr(worker, "k3post_host_weights", {})
    if set(allocations) != set(kept) or any(kept[ptr].numel() != data.handle[1] for ptr, data in allocations.items()):
        raise RuntimeError("a frozen vLLM engine's weight allocations changed since its first sleep; "
                           "its kept host copy no longer fits them")
    for ptr, data in allocations.items():
        data.cpu_backup_tensor = kept[ptr]
    return len(allocations)
