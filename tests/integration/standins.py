"""Stand-in actor classes of the integration tests, in a module of their own that imports nothing
heavy.

Ray pickles a class by reference (its module and name), so every actor of a class defined in a
test module imports that whole test module first, with the torch/transformers/k3post stack it
imports (~5 s of CPU per actor on the 2-core test machine). An actor of a class defined here
imports only this module."""

from __future__ import annotations

import os
import time

import ray


class Rank:
    """A learner rank of tests/integration/test_ray_rank_death.py."""

    def step(self, what: str) -> str:
        if what == "peer-gone":  # a survivor: its collective fails at once
            raise RuntimeError("Connection closed by peer")
        if what == "die":  # the rank that dies, a moment after the survivor's error
            time.sleep(1.0)
            os._exit(1)
        return what


class Probe:
    """A stand-in engine of tests/integration/test_ray_placement.py: where Ray put it."""

    def __init__(self, num_threads=None):
        pass

    def where(self) -> tuple[str, str, tuple[str, ...]]:
        context = ray.get_runtime_context()
        return (context.get_node_id(), context.get_placement_group_id() or "",
                tuple(context.get_accelerator_ids().get("GPU", [])))


class RowsChecker:
    """A teacher replica of tests/integration/test_ray_teacher_check.py: answers check_scores with
    figures made from the uids of the rows it was given (None for rows whose source is "empty":
    no tokens to compare)."""

    def check_scores(self, rollouts) -> dict[str, float] | None:
        if all(p.source == "empty" for p in rollouts.prompts):
            return None
        ids = [float(p.uid) for p in rollouts.prompts]
        return {"max_abs_diff": max(ids), "mean_abs_diff": sum(ids) / len(ids)}
