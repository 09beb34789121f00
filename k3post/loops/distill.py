"""Multi-teacher on-policy distillation: the driver loop, top to bottom.

    prompts (each tagged with its teacher)
      → samplers: the student's completions + log μ(y_t)
      → teachers (each row to its own, scored as its loss needs): log π_T(y_t) [B, T] to the driver;
        top-k [B, T, k], full [B, T, V] or hidden [B, T, H] payloads to the learner by reference
      → advantages A_t = −c_i·(log μ − log π_T)        (pure maths, k3post.algo.opd; sampled-token rows)
        [+ w · group-normalised reward advantage, for sources that name rewards (algo.advantages)]
      → learner: each teacher's loss term on its rows (algo/objectives.py: PerTeacherOPD)
      → weight sync learner → samplers
      → metrics; held-out evaluation; checkpoint

The loop only sees protocols (loops/protocols.py): it runs the same in-process or on Ray.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from k3post.algo.aggregate import masked_mean
from k3post.algo.objectives import PerTeacherOPD
from k3post.algo.opd import sampled_token_advantages, teacher_kl_per_token
from k3post.algo.advantages import group_advantages, mix_reward_advantages
from k3post.algo.cross_tokenizer import alignment_metrics
from k3post.config.schema import DistillRecipe
from k3post.data.mixture import PromptMixture
from k3post.loops.common import LoopParts, SkippedUpdates, due, resume, step_sampling, timed, train_loop  # noqa: F401
from k3post.loops.drift_gate import DriftGate
from k3post.loops.evaluate import HeldOut, evaluate
from k3post.loops.protocols import LearnerHandle, SamplerGroup, TeacherGroup, WeightSync
from k3post.loops.rewarding import RewardScorer, repeat_prompts
from k3post.loops.routing import prefix_metrics, rows_by_teacher, score_for_learner, teachers_in_turn
from k3post.loops.teacher_answers import PendingAnswers, answer_prompts
from k3post.track.samples import format_samples_table, write_samples
from k3post.types import Prompt, Rollouts, SamplingParams, TrainBatch, tensor_bytes


@dataclass
class DistillRun:
    recipe: DistillRecipe
    run_dir: Path
    samplers: SamplerGroup
    teachers: dict[str, TeacherGroup]
    learner: LearnerHandle
    weight_sync: WeightSync
    objective: PerTeacherOPD  # the learner's objective: says how each teacher is scored
    data: PromptMixture
    say: Callable[[str], None] = print
    rewards: RewardScorer | None = None  # task rewards mixed into OPD (sources that name rewards)
    drift: DriftGate | None = None  # acts on sampler/teacher drift (train.drift); made from the recipe if None
    cross_tokenizer: frozenset[str] = frozenset()  # teachers that read the student's text (another tokenizer)
    next_answers: NextAnswers = field(default_factory=lambda: NextAnswers())  # on spare CPU cores, during training

    def __post_init__(self):
        if self.drift is None:
            self.drift = DriftGate(self.recipe.train.drift, self.say, exact=self.recipe.sampling.on_policy == "bitwise")


def step_prompts(run: DistillRun, peek: bool = False) -> list[Prompt]:
    """The next step's prompts (each repeated sampling.n times: a group per prompt); `peek`: the
    same prompts, left undrawn."""
    draw = run.data.peek_batch if peek else run.data.next_batch
    return repeat_prompts(draw(run.recipe.data.prompts_per_step), run.recipe.sampling.n)


def learn_from(run: DistillRun, rollouts: Rollouts, times: dict[str, float], step: int,
               answers: PendingAnswers | None = None,
               while_training: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Score → advantages (+ task rewards) → one learner step on `rollouts` → the drift gate
    (loops/drift_gate.py: it may warn, switch on an IS correction for the next batches, or stop);
    the step's metrics. `while_training` is called just before the learner's step is sent (work
    for the actors the learner leaves idle).

    Shared by both modes: the advantages use the sampler's recorded log μ, so rollouts drawn
    with weights one update old (async mode) are corrected by the loss's importance ratio."""
    recipe, reward_metrics = run.recipe, {}
    pending_rewards = run.rewards.submit(rollouts) if run.rewards else None  # scored while teachers score
    scoring = {name: run.objective.term(name).scoring for name in run.teachers}
    with timed(times, "score"):
        teacher_logprobs_BT, parts, payloads, received = score_for_learner(run.teachers, scoring, rollouts,
                                                                           teachers_in_turn(recipe.teachers))
    mask_BT = rollouts.loss_mask_BT
    advantages_BT = sampled_token_advantages(rollouts.sampler_logprobs_BT, teacher_logprobs_BT, mask_BT,
                                             1.0, recipe.loss.kl_discount)
    # −coef·k_t with each row's teacher's coef (in float64: a coef past float32's range still gives ±inf).
    advantages_BT = (advantages_BT.double() * row_coefs(run, parts, len(rollouts))).to(advantages_BT.dtype)
    if pending_rewards is not None:
        with timed(times, "reward"):
            scored = pending_rewards.result()
        reward_advantages_B = group_advantages(scored.rewards_B, recipe.sampling.n, recipe.loss.reward_advantage)
        advantages_BT = mix_reward_advantages(advantages_BT, reward_advantages_B, mask_BT, recipe.loss.reward_coef)
        reward_metrics = scored.metrics(recipe.scoring.pass_threshold)
    batch = TrainBatch(rollouts.prompt_ids, rollouts.completion_ids_BT, mask_BT, rollouts.sampler_logprobs_BT,
                       advantages_BT, teacher_parts=parts, is_correction=run.drift.correction,
                       answers=answers_of(run, rollouts, times, step, answers))
    while_training()
    with timed(times, "train"):
        metrics = run.learner.train_step(batch, *payloads)
    # What reached the driver this step: the rollouts and the teachers' [B, T] answers, O(B·T).
    metrics["io/driver_bytes"] = float(tensor_bytes(rollouts) + received)
    kl_BT = teacher_kl_per_token(rollouts.sampler_logprobs_BT, teacher_logprobs_BT, mask_BT)
    for name, rows in rows_by_teacher(rollouts.prompts).items():
        metrics[f"distill/kl/{name}"] = float(masked_mean(kl_BT[rows], mask_BT[rows]))
        if name in run.cross_tokenizer:
            metrics.update(alignment_metrics(run.teachers[name].alignment_counts().result(), name))
    for name, teacher in run.teachers.items():
        metrics.update(prefix_metrics(teacher.prefix_counts().result(), name))
    metrics.update(reward_metrics)
    # A stop carries the step's figures and phase times so far: the loop logs them (loops/common.py).
    metrics.update(run.drift.check(step, {**metrics, **times}, rollouts, run.teachers))
    return metrics


def answers_overlap(recipe: DistillRecipe) -> bool:
    """Whether the teachers answer while the student samples: when each has its own GPU share. On
    CPUs they would share the cores with the sampler (measured on 2 cores: the student's sampling
    3.5× slower, the whole step 1.4× slower), so they answer after it."""
    return recipe.resources.samplers.num_gpus > 0 and all(t.resources.num_gpus > 0 for t in recipe.teachers.values())


def ask_for_answers(run: DistillRun, prompts: list[Prompt], step: int) -> PendingAnswers | None:
    """The teachers' own answers to some of the step's prompts (loss.teacher_answers), asked now.
    None without teacher answers."""
    spec = run.recipe.loss.teacher_answers
    if spec is None:
        return None
    params = step_sampling(run.recipe.sampling, run.recipe.train.seed, step)
    return PendingAnswers(run.teachers, answer_prompts(prompts, spec.prompts_per_step), params, spec.coef)


def answers_while_training(recipe: DistillRecipe) -> bool:
    """Whether, on CPUs, the teachers answer the next step's prompts while the learner trains: only
    where the learner's threads and the teachers' fit this machine's cores side by side. Sharing
    cores costs more than it hides (measured 2026-12-05 on 2 cores, recipes/distill/cross-tokenizer.yaml
    with answers, the learner on every core and two 1-thread teachers: 12.9 s a step against 10.9 s
    with the answers asked after the scoring), so otherwise they answer after the scoring."""
    learner, teachers = recipe.resources.learner, [t.resources for t in recipe.teachers.values()]
    if learner.threads is None or any(t.threads is None for t in teachers):
        return False  # an actor on every core
    threads = learner.threads * learner.replicas + sum(t.threads * t.replicas for t in teachers)
    return threads <= (os.cpu_count() or 1)


class NextAnswers:
    """On CPUs with cores to spare (`answers_while_training`), the teachers answer the *next* step's
    prompts while the learner trains on this step (the teachers are idle then): the answers depend
    on the teachers and the prompts only, never on the student. Not before an evaluation (it would
    hide their time in the evaluation's) nor after the last step. A resumed run asks afresh for the
    same prompts with the same seed, so it gets the same answers."""

    def __init__(self):
        self.step, self.pending = 0, None

    def ask(self, run: DistillRun, step: int) -> None:
        """Ask now for step `step + 1`'s answers, when they are due and would not overlap an eval."""
        train = run.recipe.train
        if run.recipe.loss.teacher_answers is None or step >= train.steps or due(step, train.eval_every, train.steps):
            return
        self.step, self.pending = step + 1, ask_for_answers(run, step_prompts(run, peek=True), step + 1)

    def take(self, step: int, prompts: list[Prompt]) -> PendingAnswers | None:
        """The answers asked for `step` (None if none were); they must be for these prompts."""
        pending, self.pending = (self.pending, None) if self.step == step else (None, None)
        if pending is not None and not pending.prompt_uids <= {p.uid for p in prompts}:
            raise AssertionError(f"step {step}: the teachers answered other prompts than the step's")
        return pending


def answers_of(run: DistillRun, rollouts: Rollouts, times: dict[str, float], step: int,
               pending: PendingAnswers | None) -> TrainBatch | None:
    """The answers asked at the step's start (teachers on GPUs) or asked now, awaited."""
    if run.recipe.loss.teacher_answers is None:
        return None
    with timed(times, "answers"):  # the time they add beyond the student's sampling
        return (pending or ask_for_answers(run, rollouts.prompts, step)).result()


def row_coefs(run: DistillRun, parts, num_rows: int):
    """Each row's teacher's coefficient, [B, 1]: the sampled-token advantage is −coef·k_t."""
    coefs_B = torch.ones(num_rows, dtype=torch.float64)
    for part in parts:
        coefs_B[list(part.rows)] = run.objective.term(part.teacher).coef
    return coefs_B[:, None]


def with_timing(metrics: dict[str, float], times: dict[str, float], rollouts: Rollouts,
                step_start: float) -> dict[str, float]:
    """The step's metrics plus its phase times, wall time and student tokens/s."""
    times["time/step_s"] = time.perf_counter() - step_start
    metrics.update(times)
    metrics["throughput/tokens_per_s"] = rollouts.num_tokens() / times["time/step_s"]
    metrics["rollout/response_len"] = rollouts.num_tokens() / len(rollouts)
    metrics["rollout/prompt_len"] = sum(len(p) for p in rollouts.prompt_ids) / len(rollouts)
    metrics.update(rollouts.sampler_stats)
    return metrics


def distill_step(run: DistillRun, step: int) -> dict[str, float]:
    """One synchronous OPD step: sample, score, train, sync; returns its metrics."""
    times: dict[str, float] = {}
    step_start = time.perf_counter()
    prompts = step_prompts(run)
    overlap = answers_overlap(run.recipe)
    ahead = not overlap and answers_while_training(run.recipe)
    answers = ask_for_answers(run, prompts, step) if overlap else run.next_answers.take(step, prompts)
    with timed(times, "sample"):
        rollouts = run.samplers.sample(prompts, step_sampling(run.recipe.sampling, run.recipe.train.seed, step))
    metrics = learn_from(run, rollouts, times, step, answers,
                         while_training=(lambda: run.next_answers.ask(run, step)) if ahead else (lambda: None))
    with timed(times, "sync"):
        run.weight_sync.push(step)
    return with_timing(metrics, times, rollouts, step_start)


def evaluate_run(run: DistillRun, heldout: HeldOut, step: int) -> dict[str, float]:
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
    start, heldout = prepare(run)
    parts = LoopParts(run.run_dir, run.recipe.train, run.learner, run.data, step=lambda step: distill_step(run, step),
                      evaluate=lambda step: evaluate_run(run, heldout, step), describe_eval=eval_line)
    history = train_loop(parts, start)
    print_before_after(run, run.recipe.train.steps, run.recipe.eval.print_samples)
    return history


def prepare(run: DistillRun) -> tuple[int, HeldOut]:
    """Resume (the step to go on from), give the samplers the learner's weights, and pick the
    held-out prompts."""
    recipe = run.recipe
    start = resume(run.run_dir, run.learner, run.data, run.say)
    run.weight_sync.push(start)
    ev = recipe.eval
    heldout = HeldOut([p for s in recipe.data.sources for p in run.data.heldout(s.name)[: ev.prompts_per_source]],
                      SamplingParams(ev.max_new_tokens, ev.temperature, 1.0, seed=recipe.train.seed))
    return start, heldout


def eval_line(metrics: dict[str, float]) -> str:
    return " ".join(f"{k.removeprefix('eval/')}={v:.3f}" for k, v in metrics.items()
                    if k.startswith(("eval/kl/", "eval/fkl/", "eval/kl_per_byte/", "eval/fkl_per_byte/")))


def _read_samples(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "samples" / f"step-{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def print_before_after(run: DistillRun, last_step: int, count: int) -> None:
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