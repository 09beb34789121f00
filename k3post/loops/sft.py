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
from typing import Callable

from k3post.config.sft_schema import SftRecipe
from k3post.data.mixture import PromptMixture
from k3post.loops.common import LoopParts, resume, train_loop
from k3post.loops.protocols import SftLearner
from k3post.types import Prompt


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


def heldout_examples(run: SftRun) -> list[Prompt]:
    n = run.recipe.eval.examples_per_source
    return [p for s in run.recipe.data.sources for p in run.data.heldout(s.name)[:n]]


def run_sft(run: SftRun) -> list[dict]:
    """Train to `train.steps` on the shared loop (loops/common.py: evaluation, logging, the stop
    on repeatedly skipped updates, checkpoints), resuming from the run directory if it can."""
    start = resume(run.run_dir, run.learner, run.data, run.say)
    heldout = heldout_examples(run)
    parts = LoopParts(run.run_dir, run.recipe.train, run.learner, run.data, step=lambda step: sft_step(run, step),
                      evaluate=lambda step: run.learner.sft_eval(heldout),
                      describe_eval=lambda metrics: f"held-out NLL {metrics['eval/nll']:.4f}")
    return train_loop(parts, start)
