"""Multi-teacher on-policy distillation: the driver loop, top to bottom.

    prompts (each tagged with its teacher)
      → samplers: the student's completions + log μ(y_t)
      → teachers (each row to its own): log π_T(y_t)
      → advantages A_t = −c·(log μ − log π_T)          (pure maths, k3post.algo.opd)
      → learner: importance-sampled policy-gradient step
      → weight sync learner → samplers
      → metrics; held-out evaluation; checkpoint

The loop only sees protocols (loops/protocols.py): it runs the same in-process or on Ray.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from k3post.algo.aggregate import masked_mean
from k3post.algo.opd import sampled_token_advantages, teacher_kl_per_token
from k3post.config.errors import UserError
from k3post.config.schema import DistillRecipe
from k3post.data.mixture import PromptMixture
from k3post.loops.common import checkpoint, due, resume, timed
from k3post.loops.evaluate import HeldOut, evaluate
from k3post.loops.protocols import LearnerHandle, SamplerGroup, TeacherGroup
from k3post.loops.routing import rows_by_teacher, score_routed
from k3post.track.metrics import MetricsLog
from k3post.track.progress import Progress
from k3post.track.samples import format_samples_table, write_samples
from k3post.types import SamplingParams, TrainBatch


@dataclass
class DistillRun:
    recipe: DistillRecipe
    run_dir: Path
    samplers: SamplerGroup
    teachers: dict[str, TeacherGroup]
    learner: LearnerHandle
    data: PromptMixture
    say: Callable[[str], None] = print


def _sampling(run: DistillRun, step: int) -> SamplingParams:
    s = run.recipe.sampling
    # A fresh seed per step, derived from the recipe seed: a resumed run samples what an
    # uninterrupted one would have.
    return SamplingParams(s.max_new_tokens, s.temperature, s.top_p, seed=run.recipe.train.seed * 1_000_003 + step)


def distill_step(run: DistillRun, step: int) -> dict[str, float]:
    """One OPD step; returns its metrics."""
    recipe, times = run.recipe, {}
    step_start = time.perf_counter()
    prompts = run.data.next_batch(recipe.data.prompts_per_step)
    with timed(times, "sample"):
        rollouts = run.samplers.sample(prompts, _sampling(run, step))
    full = recipe.loss.kind == "full_vocab"
    with timed(times, "score"):
        teacher_full_BTV = score_routed(run.teachers, rollouts, full=True) if full else None
        teacher_lp_BT = (teacher_full_BTV.gather(-1, rollouts.completion_ids_BT[..., None]).squeeze(-1)
                         * rollouts.loss_mask_BT) if full else score_routed(run.teachers, rollouts)
    mask_BT = rollouts.loss_mask_BT
    advantages_BT = sampled_token_advantages(rollouts.sampler_logprobs_BT, teacher_lp_BT, mask_BT,
                                             recipe.loss.kl_coef, recipe.loss.kl_discount)
    batch = TrainBatch(rollouts.prompt_ids, rollouts.completion_ids_BT, mask_BT, rollouts.sampler_logprobs_BT,
                       advantages_BT, teacher_full_BTV)
    with timed(times, "train"):
        metrics = run.learner.train_step(batch)
    with timed(times, "sync"):
        run.samplers.load_weights(run.learner.weights(), version=step)
    kl_BT = teacher_kl_per_token(rollouts.sampler_logprobs_BT, teacher_lp_BT, mask_BT)
    for name, rows in rows_by_teacher(prompts).items():
        metrics[f"distill/kl/{name}"] = float(masked_mean(kl_BT[rows], mask_BT[rows]))
    times["time/step_s"] = time.perf_counter() - step_start
    metrics.update(times)
    metrics["throughput/tokens_per_s"] = rollouts.num_tokens() / times["time/step_s"]
    metrics["rollout/response_len"] = rollouts.num_tokens() / len(rollouts)
    return metrics


def _evaluate(run: DistillRun, heldout: HeldOut, step: int) -> dict[str, float]:
    start = time.perf_counter()
    metrics, rows = evaluate(run.samplers, run.teachers, heldout)
    for row in rows:  # the teacher's answers are kept only at step 0 (they never change)
        if step != 0:
            row.pop("teacher_answer")
    write_samples(run.run_dir, step, rows)
    metrics["time/eval_s"] = time.perf_counter() - start
    return metrics


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
                f"Lower optim.lr or loss.kl_coef, check the data and the teachers, or raise "
                f"train.max_skipped_steps (0 = never stop).")


def run_distill(run: DistillRun) -> list[dict]:
    """Train to `train.steps`, resuming from the run directory's last checkpoint if there is one."""
    recipe = run.recipe
    total = recipe.train.steps
    start = resume(run.run_dir, run.learner, run.data, run.say)
    run.samplers.load_weights(run.learner.weights(), version=start)
    ev = recipe.eval
    heldout = HeldOut([p for s in recipe.data.sources for p in run.data.heldout(s.name)[: ev.prompts_per_source]],
                      SamplingParams(ev.max_new_tokens, ev.temperature, 1.0, seed=recipe.train.seed))
    history: list[dict] = []
    skipped = SkippedUpdates(recipe.train.max_skipped_steps, run.run_dir / "metrics.jsonl")
    with MetricsLog(run.run_dir, resume_step=start if start else None) as log, \
            Progress(total, start_step=start) as progress:
        if start == 0:
            metrics = _evaluate(run, heldout, 0)
            log.log(0, metrics)
            history.append({"step": 0, **metrics})
            progress.message("step 0 (before training): " + _eval_line(metrics))
        for step in range(start + 1, total + 1):
            metrics = distill_step(run, step)
            if due(step, recipe.train.eval_every, total):
                metrics.update(_evaluate(run, heldout, step))
                progress.message(f"eval at step {step}: " + _eval_line(metrics))
            log.log(step, metrics)
            history.append({"step": step, **metrics})
            progress.update(step, metrics)
            skipped.check(step, metrics, progress.message)
            if due(step, recipe.train.checkpoint_every, total):
                checkpoint(run.run_dir, run.learner, run.data, step, recipe.train.keep_checkpoints)
    _print_before_after(run, total, ev.print_samples)
    return history


def _eval_line(metrics: dict[str, float]) -> str:
    return " ".join(f"{k.removeprefix('eval/')}={v:.3f}" for k, v in metrics.items()
                    if k.startswith(("eval/kl/", "eval/fkl/")))


def _read_samples(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "samples" / f"step-{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _print_before_after(run: DistillRun, last_step: int, count: int) -> None:
    """A few held-out prompts, taken in turn from each teacher's share, with the student's
    answer before training and now."""
    before, after = _read_samples(run.run_dir, 0), _read_samples(run.run_dir, last_step)
    by_teacher: dict[str, list[int]] = {}
    for i, row in enumerate(after):
        by_teacher.setdefault(row.get("teacher", ""), []).append(i)
    order = [i for group in zip(*by_teacher.values()) for i in group] if by_teacher else []
    rows = []
    for i in order[:count]:
        row = after[i]
        entry = {"prompt": row["prompt"], "teacher": row.get("teacher", "")}
        if i < len(before):
            entry["student before"] = before[i]["student"]
        entry["student after"] = row["student"]
        rows.append(entry)
    if rows:
        run.say(format_samples_table(rows))