"""RL from rewards (GRPO / Dr.GRPO / RLOO with a PPO-clip or IS loss): the driver loop, top to bottom.

    prompts (each source names its rewards)
      → samplers: n completions per prompt + log μ(y_t)           (a group per prompt)
      → rewards: rule functions in a thread pool, reward models in their actor group
      → advantages: group-relative, broadcast over the tokens    (pure maths, k3post.algo.advantages)
      → learner: policy-gradient step, μ's logprobs as the behaviour policy
      → weight sync learner → samplers
      → metrics (rl/reward/<name>, pass rate, response length); held-out evaluation; checkpoint

The loop only sees protocols (loops/protocols.py, loops/rewarding.py): it runs the same
in-process or over Ray actor groups.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from k3post.algo.advantages import group_advantages, token_advantages, zero_variance_share
from k3post.config.rl_schema import RlRecipe
from k3post.data.mixture import PromptMixture
from k3post.loops.common import LoopParts, resume, step_sampling, timed, train_loop
from k3post.loops.drift_gate import DriftGate
from k3post.loops.protocols import LearnerHandle, SamplerGroup, WeightSync
from k3post.loops.rewarding import RewardScorer, repeat_prompts
from k3post.track.samples import format_samples_table, write_samples
from k3post.types import Prompt, SamplingParams, TrainBatch


@dataclass
class RlRun:
    recipe: RlRecipe
    run_dir: Path
    samplers: SamplerGroup
    learner: LearnerHandle
    weight_sync: WeightSync
    data: PromptMixture
    rewards: RewardScorer
    say: Callable[[str], None] = print
    drift: DriftGate | None = None  # acts on sampler-vs-learner drift (train.drift); made from the recipe if None
    signal_warning: ZeroSignalWarning | None = None  # warns when most groups have equal rewards; made if None

    def __post_init__(self):
        if self.drift is None:
            self.drift = DriftGate(self.recipe.train.drift, self.say, exact=self.recipe.sampling.on_policy == "bitwise")
        if self.signal_warning is None:
            self.signal_warning = ZeroSignalWarning(self.say)


MOST_GROUPS = 0.5  # warn when more than this share of a step's groups have zero reward variance


def no_signal_message(share: float, group_size: int) -> str:
    return (f"no learning signal: all {group_size} samples of each group got the same reward in "
            f"{share:.0%} of groups, so their advantages (and loss) are 0; make prompts harder or easier, "
            f"raise sampling.n or sampling.temperature, or check the reward function (rl/zero_variance_groups)")


@dataclass
class ZeroSignalWarning:
    """Says `no_signal_message` once per streak of steps where most groups have zero reward variance."""
    say: Callable[[str], None] = print
    in_streak: bool = False

    def check(self, share: float, group_size: int) -> None:
        if share <= MOST_GROUPS:
            self.in_streak = False
            return
        if not self.in_streak:
            self.say(no_signal_message(share, group_size))
        self.in_streak = True


def rl_step(run: RlRun, step: int) -> dict[str, float]:
    """One RL step; returns its metrics."""
    recipe, times = run.recipe, {}
    started = time.perf_counter()
    group_size = recipe.sampling.n
    prompts = repeat_prompts(run.data.next_batch(recipe.data.prompts_per_step), group_size)
    with timed(times, "sample"):
        rollouts = run.samplers.sample(prompts, step_sampling(recipe.sampling, recipe.train.seed, step))
    with timed(times, "reward"):
        scored = run.rewards.submit(rollouts).result()
    mask_BT = rollouts.loss_mask_BT
    advantages_B = group_advantages(scored.rewards_B, group_size, recipe.loss.advantage)
    batch = TrainBatch(rollouts.prompt_ids, rollouts.completion_ids_BT, mask_BT, rollouts.sampler_logprobs_BT,
                       token_advantages(advantages_B, mask_BT, recipe.loss.aggregation), is_correction=run.drift.correction)
    with timed(times, "train"):
        metrics = run.learner.train_step(batch)
    metrics.update(scored.metrics(recipe.scoring.pass_threshold))
    rewards_PG = scored.rewards_B.reshape(-1, group_size)
    # Groups whose completions all got the same reward have zero advantage: no learning signal.
    metrics["rl/zero_variance_groups"] = zero_variance_share(rewards_PG)
    metrics["rl/constant_groups"] = metrics["rl/zero_variance_groups"]  # older name, kept for dashboards
    run.signal_warning.check(metrics["rl/zero_variance_groups"], group_size)
    metrics["rl/response_len"] = rollouts.num_tokens() / len(rollouts)
    metrics.update(rollouts.sampler_stats)  # speculative rollouts: acceptance length, drafts (may be empty)
    # May warn, switch on TIS/MIS, or stop (loops/drift_gate.py); a stop carries the step's figures
    # and phase times so far, which the loop logs (loops/common.py).
    metrics.update(run.drift.check(step, {**metrics, **times}))
    with timed(times, "sync"):
        run.weight_sync.push(step)
    times["time/step_s"] = time.perf_counter() - started
    metrics.update(times)
    metrics["throughput/tokens_per_s"] = rollouts.num_tokens() / times["time/step_s"]
    return metrics


def _evaluate(run: RlRun, heldout: list[Prompt], params: SamplingParams, step: int) -> dict[str, float]:
    """One completion per held-out prompt, scored with its source's rewards: eval/reward/<name>,
    eval/reward/total, eval/pass_rate, eval/response_len; the answers go to samples/step-N.jsonl."""
    started = time.perf_counter()
    rollouts = run.samplers.sample(heldout, params)
    scored = run.rewards.submit(rollouts).result()
    metrics = scored.metrics(run.recipe.scoring.pass_threshold, prefix="eval/")
    metrics["eval/response_len"] = rollouts.num_tokens() / len(rollouts)
    write_samples(run.run_dir, step, [
        {"prompt": p.as_chat()[-1]["content"], "source": p.source, "student": text, "reward": float(r)}
        for p, text, r in zip(heldout, rollouts.texts, scored.rewards_B.tolist())])
    metrics["time/eval_s"] = time.perf_counter() - started
    return metrics


def _eval_line(metrics: dict[str, float]) -> str:
    keys = ("eval/reward/total", "eval/pass_rate", "eval/response_len")
    return " ".join(f"{k.removeprefix('eval/')}={metrics[k]:.3f}" for k in keys if k in metrics)


def run_rl(run: RlRun) -> list[dict]:
    """Train to `train.steps`, resuming from the run directory's last checkpoint if there is one."""
    recipe = run.recipe
    start = resume(run.run_dir, run.learner, run.data, run.say)
    run.weight_sync.push(start)
    ev = recipe.eval
    heldout = [p for s in recipe.data.sources for p in run.data.heldout(s.name)[: ev.prompts_per_source]]
    params = SamplingParams(ev.max_new_tokens, ev.temperature, 1.0, seed=recipe.train.seed)
    parts = LoopParts(run.run_dir, recipe.train, run.learner, run.data, step=lambda step: rl_step(run, step),
                      evaluate=lambda step: _evaluate(run, heldout, params, step), describe_eval=_eval_line)
    history = train_loop(parts, start)
    _print_before_after(run, recipe.train.steps, ev.print_samples)
    return history


def _print_before_after(run: RlRun, last_step: int, count: int) -> None:
    def read(step: int) -> list[dict]:
        path = run.run_dir / "samples" / f"step-{step}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    before, after = read(0), read(last_step)
    rows = [{"prompt": a["prompt"], "before": f"[{b['reward']:+.2f}] {b['student']}",
             "after": f"[{a['reward']:+.2f}] {a['student']}"} for b, a in zip(before, after)][:count]
    if rows:
        run.say(format_samples_table(rows))

