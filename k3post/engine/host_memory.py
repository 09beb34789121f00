"""How the engines' processes allocate host memory (set when the process starts).

A CPU learner step allocates and frees the same large tensors every step: activations, the
[B, T, V] distributions of a full-vocabulary loss (75 MB each for the quickstart's 8 × 48 tokens
and 49k vocabulary), gradient temporaries. With glibc's defaults every block over its dynamic
mmap threshold, and every free stretch at the top of the heap over 128 KiB, goes back to the
kernel, so the next step faults the same memory in again, 4 KiB at a time and zeroed. Measured on
the quickstart's learner step (2-core CPU, `bench/opd/opd_vs_trl_step.py`): ~730,000 page faults and
4-7 s of kernel time a step, the learner step 7.6 s instead of 5.3 s side by side.

`GLIBC_TUNABLES` below keeps freed memory in the process (trim threshold 16 GiB; the mmap
threshold at glibc's ceiling, 32 MiB, so only larger blocks are mapped per allocation) and backs
glibc's memory with transparent huge pages (`hugetlb=1`: 2 MiB pages, 512× fewer faults for the
blocks that are still mapped). The arithmetic is untouched: losses and weights are bit-identical
with and without it. The cost: a process keeps its peak heap (it does not shrink between phases).

glibc reads the variable once, when a process starts, so it is given to every Ray actor
(`k3post.ray.cluster.actor_env`); a `GLIBC_TUNABLES` the user set is passed on unchanged instead.
Another C library ignores it.
"""

from __future__ import annotations

import os

ALLOCATOR_TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:"
                      "glibc.malloc.trim_threshold=17179869184")


def allocator_env() -> dict[str, str]:
    """The environment variable an engine process should start with (the user's own wins)."""
    return {"GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ALLOCATOR_TUNABLES)}
