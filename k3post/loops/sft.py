"""Supervised fine-tuning (optionally with FP8 QAT): the driver loop, top to bottom.

    examples (a weighted, resumable mixture of SFT sources)
      → learner: NLL of the reply tokens only, token-normalised over the whole step
      → metrics; held-out NLL; checkpoint

Same run-directory contract as distillation: metrics.jsonl, TensorBoard, HF checkpoints,
resume from the last checkpoint with data position, optimizer, scheduler and RNG.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from k3post.config.schema import SftRecipe
from k3post.data.mixture import PromptMixture
from k3post.loops.common import checkpoint, due, resume
from k3post.track.metrics import MetricsLog
from k3post.track.progress import Progress
from k3post.types import Prompt


class SftLearner(Protocol):
    def sft_step(self, examples: list[Prompt]) -> dict[str, float]: ...
    def sft_eval(self, examples: list[Prompt]) -> dict[str, float]: ...
    def save_checkpoint(self, directory: str, run_state: dict) -> str: ...
    def load_checkpoint(self, directory: str) -> dict: ...


@dataclass
class SftRun:
    recipe: SftRecipe
    run_dir: Path
    learner: SftLearner
    data: PromptMixture
    say: Callable[[str], None] = print


def sft_step(run: SftRun, step: int) -> dict[str, float]:
    started = time.perf_counter()
    metrics = run.learner.sft_step(run.data.next_batch(run.recipe.data.examples_per_step))
    metrics["time/step_s"] = time.perf_counter() - started
    metrics["throughput/tokens_per_s"] = metrics["train/tokens"] / metrics["time/step_s"]
    return metrics


def run_sft(run: SftRun) -> list[dict]:
    recipe, total = run.recipe, run.recipe.train.steps
    start = resume(run.run_dir, run.learner, run.data, run.say)
    n = recipe.eval.examples_per_source
    heldout = [p for s in recipe.data.sources for p in run.data.heldout(s.name)[:n]]
    history: list[dict] = []
    with MetricsLog(run.run_dir, resume_step=start if start else None) as log, \
            Progress(total, start_step=start) as progress:
        if start == 0:
            metrics = run.learner.sft_eval(heldout)
            log.log(0, metrics)
            history.append({"step": 0, **metrics})
            progress.message(f"step 0 (before training): held-out NLL {metrics['eval/nll']:.4f}")
        for step in range(start + 1, total + 1):
            metrics = sft_step(run, step)
            if due(step, recipe.train.eval_every, total):
                metrics.update(run.learner.sft_eval(heldout))
                progress.message(f"eval at step {step}: held-out NLL {metrics['eval/nll']:.4f}")
            log.log(step, metrics)
            history.append({"step": step, **metrics})
            progress.update(step, metrics)
            if due(step, recipe.train.checkpoint_every, total):
                checkpoint(run.run_dir, run.learner, run.data, step, recipe.train.keep_checkpoints)
    return history
