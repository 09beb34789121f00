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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from k3post.algo.aggregate import masked_mean
from k3post.algo.opd import sampled_token_advantages, teacher_kl_per_token
from k3post.config.schema import DistillRecipe
from k3post.data.mixture import PromptMixture
from k3post.loops.evaluate import HeldOut, evaluate
from k3post.loops.protocols import LearnerHandle, SamplerGroup, TeacherGroup
from k3post.loops.routing import rows_by_teacher, score_routed
from k3post.track.atomic import latest_checkpoint, prune_checkpoints
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


@contextmanager
def timed(times: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    times[f"time/{phase}_s"] = time.perf_counter() - start


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


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


def _resume(run: DistillRun) -> int:
    found = latest_checkpoint(run.run_dir / "checkpoints")
    if found is None:
        return 0
    step, path = found
    state = run.learner.load_checkpoint(str(path))
    run.data.load_state_dict(state["data"])
    run.say(f"resumed from {path} (step {step})")
    return step


def _checkpoint(run: DistillRun, step: int) -> None:
    root = run.run_dir / "checkpoints"
    run.learner.save_checkpoint(str(root / f"step-{step}"), {"step": step, "data": run.data.state_dict()})
    prune_checkpoints(root, run.recipe.train.keep_checkpoints)


def _evaluate(run: DistillRun, heldout: HeldOut, step: int) -> dict[str, float]:
    start = time.perf_counter()
    metrics, rows = evaluate(run.samplers, run.teachers, heldout)
    for row in rows:  # the teacher's answers are kept only at step 0 (they never change)
        if step != 0:
            row.pop("teacher_answer")
    write_samples(run.run_dir, step, rows)
    metrics["time/eval_s"] = time.perf_counter() - start
    return metrics


def run_distill(run: DistillRun) -> list[dict]:
    """Train to `train.steps`, resuming from the run directory's last checkpoint if there is one."""
    recipe = run.recipe
    total = recipe.train.steps
    start = _resume(run)
    run.samplers.load_weights(run.learner.weights(), version=start)
    ev = recipe.eval
    heldout = HeldOut([p for s in recipe.data.sources for p in run.data.heldout(s.name)[: ev.prompts_per_source]],
                      SamplingParams(ev.max_new_tokens, ev.temperature, 1.0, seed=recipe.train.seed))
    history: list[dict] = []
    with MetricsLog(run.run_dir, resume_step=start if start else None) as log, \
            Progress(total, start_step=start) as progress:
        if start == 0:
            metrics = _evaluate(run, heldout, 0)
            log.log(0, metrics)
            history.append({"step": 0, **metrics})
            progress.message("step 0 (before training): " + _eval_line(metrics))
        for step in range(start + 1, total + 1):
            metrics = distill_step(run, step)
            if _due(step, recipe.train.eval_every, total):
                metrics.update(_evaluate(run, heldout, step))
                progress.message(f"eval at step {step}: " + _eval_line(metrics))
            log.log(step, metrics)
            history.append({"step": step, **metrics})
            progress.update(step, metrics)
            if _due(step, recipe.train.checkpoint_every, total):
                _checkpoint(run, step)
    _print_before_after(run, total, ev.print_samples)
    return history


def _eval_line(metrics: dict[str, float]) -> str:
    return " ".join(f"{k.removeprefix('eval/')}={v:.3f}" for k, v in metrics.items()
                    if k.startswith(("eval/kl/", "eval/fkl/")))


def _read_samples(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "samples" / f"step-{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _print_before_after(run: DistillRun, last_step: int, count: int) -> None:
    """A few held-out prompts with the student's answer before training and now."""
    before, after = _read_samples(run.run_dir, 0), _read_samples(run.run_dir, last_step)
    rows = []
    for i, row in enumerate(after[:count]):
        entry = {"prompt": row["prompt"], "teacher": row.get("teacher", "")}
        if i < len(before):
            entry["student before"] = before[i]["student"]
        entry["student after"] = row["student"]
        rows.append(entry)
    if rows:
        run.say(format_samples_table(rows))
