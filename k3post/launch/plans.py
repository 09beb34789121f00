"""What `k3post run` does for each recipe kind: the builder, the loop and the closing summary,
one typed row per kind."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from k3post.launch.backend import Backend
from k3post.launch.distill import build_distill_run
from k3post.launch.rl import build_rl_run
from k3post.launch.sft import build_sft_run
from k3post.loops.distill import DistillRun, run_distill
from k3post.loops.distill_async import run_distill_async
from k3post.loops.rl import run_rl
from k3post.loops.sft import run_sft
from k3post.track.summary import distill_summary, rl_summary, sft_summary


@dataclass(frozen=True)
class Plan:
    build: Callable[[Any, Path, Backend], Any]  # (recipe, run_dir, backend) -> the loop's run object
    loop: Callable[[Any], list[dict]]  # run object -> every logged row
    summary: Callable[[list[dict], Any], list[str]]  # (history, recipe) -> closing lines


def run_distill_mode(run: DistillRun) -> list[dict]:
    """`train.mode`: one loop function per mode (sync: sample, score, train, sync; async: sample
    step k+1 while step k trains)."""
    return {"sync": run_distill, "async": run_distill_async}[run.recipe.train.mode](run)


PLANS: dict[str, Plan] = {
    "distill": Plan(build_distill_run, run_distill_mode, distill_summary),
    "rl": Plan(build_rl_run, run_rl, rl_summary),
    "sft": Plan(build_sft_run, run_sft, sft_summary),
}
