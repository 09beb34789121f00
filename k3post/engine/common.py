"""Small helpers shared by the engines."""

from __future__ import annotations

import os

import torch


def set_threads(num_threads: int | None) -> None:
    """Use `num_threads` intra-op threads (None: every core of the machine).

    The phases of a synchronous OPD step (sample, score, train) run one after another, so by
    default each engine may use the whole machine; Ray's OMP_NUM_THREADS=1 would waste it.
    """
    torch.set_num_threads(max(1, num_threads or os.cpu_count() or 1))
