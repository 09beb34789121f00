"""Pieces every training loop shares: phase timers, schedules, resume and checkpoints, the
stop on repeatedly skipped updates, and the step/eval/log/checkpoint driver (`train_loop`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterator

from k3post.config.errors import StepStopped, UserError
from k3post.config.schema import SamplingSpec, TrainSpec
from k3post.data.mixture import PromptMixture
from k3post.loops.protocols import Checkpointing
from k3post.loops.evaluate import RisingHeldOut
from k3post.track.atomic import latest_checkpoint, prune_checkpoints
from k3post.track.disk import run_dir_usage
from k3post.track.metrics import MetricsLog, read_metrics
from k3post.track.model_card import model_card
from k3post.track.sinks import run_track_config
from k3post.track.progress import Progress
from k3post.types import SamplingParams


@contextmanager
def timed(times: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    times[f"time/{phase}_s"] = time.perf_counter() - start


def step_sampling(sampling: SamplingSpec, seed: int, step: int) -> SamplingParams:
    """The sampling parameters of a step, with a fresh seed per step derived from the recipe
    seed: a resumed run samples what an uninterrupted one would have."""
    return SamplingParams(sampling.max_new_tokens, sampling.temperature, sampling.top_p, seed=seed * 1_000_003 + step)


def due(step: int, every: int, last: int) -> bool:
    """Whether a periodic action (eval, checkpoint) runs at `step`: every N steps and at the end."""
    return step == last or (every > 0 and step % every == 0)


def resume(run_dir: Path, learner: Checkpointing, data: PromptMixture, say: Callable[[str], None]) -> int:
    """Restore the last complete checkpoint (learner state and data position); 0 if none."""
    found = latest_checkpoint(run_dir / "checkpoints")
    if found is None:
        return 0
    step, path = found
    try:
        state = learner.load_checkpoint(str(path.absolute()))  # absolute: see `checkpoint`
    except Exception as err:  # a damage the checks before the resume (track/checkpoint_files.py) cannot see
        inner = getattr(err, "cause", None) or err  # from a Ray actor: RayTaskError's cause
        if isinstance(inner, UserError) or isinstance(err, UserError):
            raise
        cause = f"{type(inner).__name__}: " + (str(inner).strip().splitlines() or [""])[-1][:300]
        raise UserError(f"{path}: cannot resume from this checkpoint ({cause}). Move it out of checkpoints/ to "
                        f"resume from the one before, or pass --restart to start over") from err
    data.load_state_dict(state["data"])
    say(f"resumed from {path} (step {step})")
    return step


def checkpoint(run_dir: Path, learner: Checkpointing, data: PromptMixture, step: int, keep: int,
               card: str | None = None) -> None:
    """Save the learner's state and the data position as checkpoints/step-N, then keep the last
    `keep`. `card` (track/model_card.py) travels in run_state as `model_card`: the learner
    writes it as the checkpoint's README.md inside its atomic directory."""
    root = run_dir / "checkpoints"
    path = root / f"step-{step}"
    state = {"step": step, "data": data.state_dict()}
    if card is not None:
        state["model_card"] = card
    # Absolute: the learner's ranks may run on other nodes, in another working directory (a Ray
    # job's is unpacked per node); the run directory must be on storage they all share.
    learner.save_checkpoint(str(path.absolute()), state)
    prune_checkpoints(root, keep)


class RunRecord:
    """What the loop remembers of its run for the checkpoints' model cards and the held-out trend:
    the resolved recipe, the evaluation before training and the latest one. A resumed run reads
    the rows of metrics.jsonl up to its checkpoint back in."""

    def __init__(self, run_dir: Path, start: int):
        self.recipe = run_track_config(run_dir)[1]
        self.baseline: dict[str, float] = {}
        self.latest: dict[str, float] = {}
        self.trend = RisingHeldOut()
        for row in read_metrics(run_dir / "metrics.jsonl") if start else []:
            if row["step"] <= start:
                self.add(row["step"], {k: v for k, v in row.items() if k != "step"}, lambda _: None)

    def add(self, step: int, metrics: dict[str, float], say: Callable[[str], None]) -> None:
        evaluation = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if not evaluation:
            return
        if step == 0:
            self.baseline = evaluation
        self.latest = evaluation
        self.trend.check(step, evaluation, say)

    def card(self, step: int) -> str:
        return model_card(self.recipe, step, self.latest, self.baseline)


class SkippedUpdates:
    """Stops a run whose updates keep being skipped.

    The learner skips an update whose loss or gradient is not finite (train/skipped = 1) and
    keeps the weights it had. One such step is noise; several in a row mean the run is broken
    (a diverged policy, a teacher returning -inf, a learning rate far too high), and going on
    would only burn compute. `limit` consecutive skips stop the run; 0 never stops it.
    """

    def __init__(self, limit: int, metrics_path: Path):
        self.limit, self.metrics_path, self.in_a_row = limit, metrics_path, 0

    def check(self, step: int, metrics: dict[str, float], say: Callable[[str], None]) -> None:
        """Call after the step's metrics are logged and before its checkpoint."""
        if not metrics.get("train/skipped"):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        say(f"step {step}: update skipped, the loss or gradient is not finite (train/loss="
            f"{metrics.get('train/loss')}, train/grad_norm={metrics.get('train/grad_norm')}); "
            f"{self.in_a_row} in a row" + (f", the run stops at {self.limit}" if self.limit else ""))
        if self.limit and self.in_a_row >= self.limit:
            first = step - self.in_a_row + 1
            raise UserError(
                f"stopped at step {step}: the last {self.in_a_row} updates (steps {first}-{step}) were skipped "
                f"because the loss or the gradient was not finite (train/skipped = 1 in {self.metrics_path}). "
                f"No checkpoint of step {step} was written; the last checkpoint holds the weights from before. "
                f"Lower optim.lr or loss.kl_coef, check the data, the teachers and the rewards, or raise "
                f"train.max_skipped_steps (0 = never stop).")


@dataclass
class LoopParts:
    """What `train_loop` drives: one training step and one evaluation, as closures over a run."""

    run_dir: Path
    train: TrainSpec
    learner: Checkpointing
    data: PromptMixture
    step: Callable[[int], dict[str, float]]
    evaluate: Callable[[int], dict[str, float]]
    describe_eval: Callable[[dict[str, float]], str]  # one line of the evaluation's headline numbers


def train_loop(parts: LoopParts, start: int) -> list[dict]:
    """Steps start+1 … train.steps: step, evaluate when due, log, stop on repeated skipped
    updates, checkpoint when due. Evaluates once before training when starting from scratch.
    A step that raises `StepStopped` (the drift gate) is logged from the metrics the error
    carries, like any step (no evaluation, no checkpoint), and the error ends the loop.
    `start` is the resumed step (common.resume); returns every logged row."""
    train, total = parts.train, parts.train.steps
    history: list[dict] = []
    skipped = SkippedUpdates(train.max_skipped_steps, parts.run_dir / "metrics.jsonl")
    # The sinks of the recipe's `track:` (metrics.jsonl always); the log cuts metrics.jsonl back
    # to the resumed step before the record reads it.
    with MetricsLog.for_run(parts.run_dir, resume_step=start if start else None) as log, \
            Progress(total, start_step=start) as progress:
        record = RunRecord(parts.run_dir, start)
        if start == 0:
            metrics = {**parts.data.input_metrics(), **parts.evaluate(0)}
            log.log(0, metrics)
            history.append({"step": 0, **metrics})
            progress.message("step 0 (before training): " + parts.describe_eval(metrics))
            record.add(0, metrics, progress.message)
        for step in range(start + 1, total + 1):
            try:
                metrics = parts.step(step)
            except StepStopped as stop:  # a check on the step's own figures: log them, then stop
                log.log(step, stop.metrics)
                history.append({"step": step, **stop.metrics})
                progress.update(step, stop.metrics)
                raise
            if due(step, train.eval_every, total):
                metrics.update(parts.evaluate(step))
                progress.message(f"eval at step {step}: " + parts.describe_eval(metrics))
            log.log(step, metrics)
            history.append({"step": step, **metrics})
            progress.update(step, metrics)
            record.add(step, metrics, progress.message)
            skipped.check(step, metrics, progress.message)
            if due(step, train.checkpoint_every, total):
                checkpoint(parts.run_dir, parts.learner, parts.data, step, train.keep_checkpoints, record.card(step))
        progress.message(run_dir_usage(parts.run_dir, train.keep_checkpoints))
    return history
