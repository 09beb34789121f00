"""Pieces every training loop shares: phase timers, schedules, resume and checkpoints."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from k3post.data.mixture import PromptMixture
from k3post.loops.protocols import LearnerHandle
from k3post.track.atomic import latest_checkpoint, prune_checkpoints


@contextmanager
def timed(times: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    times[f"time/{phase}_s"] = time.perf_counter() - start


def due(step: int, every: int, last: int) -> bool:
    """Whether a periodic action (eval, checkpoint) runs at `step`: every N steps and at the end."""
    return step == last or (every > 0 and step % every == 0)


def resume(run_dir: Path, learner: LearnerHandle, data: PromptMixture, say: Callable[[str], None]) -> int:
    """Restore the last complete checkpoint (learner state and data position); 0 if none."""
    found = latest_checkpoint(run_dir / "checkpoints")
    if found is None:
        return 0
    step, path = found
    state = learner.load_checkpoint(str(path))
    data.load_state_dict(state["data"])
    say(f"resumed from {path} (step {step})")
    return step


def checkpoint(run_dir: Path, learner: LearnerHandle, data: PromptMixture, step: int, keep: int) -> None:
    root = run_dir / "checkpoints"
    learner.save_checkpoint(str(root / f"step-{step}"), {"step": step, "data": data.state_dict()})
    prune_checkpoints(root, keep)
