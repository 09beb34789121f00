"""Launching RL (`kind: rl`) and the rewards of an OPD run: data, reward functions, reward-model
groups (in this process or as Ray actors with their own resources), then the loop's run object."""

from __future__ import annotations

import time
from pathlib import Path

from k3post.config.schema import DistillRecipe, LossSpec, RewardModelSpec, RlRecipe, ScoringSpec
from k3post.data.mixture import PromptMixture, SourceSpec
from k3post.data.sources import load_prompt_rows
from k3post.dist.launch import ACTOR_RESTARTS, remote, sampler_actors, sampler_engine
from k3post.engine.learner import Learner, LearnerConfig
from k3post.engine.reward_model import RewardModelScorer
from k3post.engine.common import engine_device
from k3post.loops.distill import DistillRun
from k3post.loops.protocols import Done
from k3post.loops.rewarding import ModelReward, RewardModelGroup, RewardScorer, SourceRewards, metas_by_uid
from k3post.loops.rl import RlRun
from k3post.model.load import load_tokenizer
from k3post.rewards import RewardPool, make_reward_spec
from k3post.types import Prompt


class LocalRewardModel:
    """A reward model in this process (tests, `--in-process`)."""

    def __init__(self, engine: RewardModelScorer):
        self.engine = engine

    def score(self, prompts: list[Prompt], completions: list[str]) -> Done[list[float]]:
        return Done(self.engine.score(prompts, completions))


def _with_suffix(rows: list[dict], suffix: str) -> list[dict]:
    """Append `suffix` to each row's last user turn (a per-source instruction)."""
    if not suffix:
        return rows
    out = []
    for row in rows:
        turns = list(row["messages"])
        last = max(i for i, (role, _) in enumerate(turns) if role == "user") if any(
            role == "user" for role, _ in turns) else len(turns) - 1
        turns[last] = (turns[last][0], turns[last][1] + suffix)
        out.append({**row, "messages": turns})
    return out


def build_rl_data(recipe: RlRecipe) -> PromptMixture:
    sources = [SourceSpec(s.name, _with_suffix(load_prompt_rows(s.prompts, Path.cwd()), s.prompt_suffix), "",
                          s.weight, s.heldout) for s in recipe.data.sources]
    return PromptMixture(sources, recipe.train.seed)


def source_rewards(sources: list, scoring: ScoringSpec) -> dict[str, SourceRewards]:
    """Each source's reward functions loaded (a bad name fails here, before any model loads) into
    its own pool, and its reward-model uses."""
    out = {}
    for source in sources:
        if not source.rewards:
            continue
        specs = [make_reward_spec(use.fn, use.weight, use.metric_name, use.kwargs) for use in source.rewards if use.fn]
        models = [ModelReward(use.metric_name, use.model, use.weight) for use in source.rewards if use.model]
        out[source.name] = SourceRewards(RewardPool(specs, scoring.workers, scoring.timeout_s), models)
    return out


def rl_learner_config(recipe: RlRecipe, threads: int | None = None) -> LearnerConfig:
    return LearnerConfig(recipe.student, recipe.optim, LossSpec(reference=recipe.loss.reference), recipe.train.steps,
                         recipe.sampling.temperature, recipe.train.seed, threads, recipe.lora, recipe.qat,
                         objective="rl", compile=recipe.train.compile, rl=recipe.loss,
                         device=engine_device(recipe.resources.learner))


def reward_model_cpus(recipe: RlRecipe | DistillRecipe) -> float:
    return sum(m.resources.replicas * m.resources.num_cpus for m in recipe.reward_models.values())


def rl_cpus_needed(recipe: RlRecipe) -> float:
    groups = [recipe.resources.samplers, recipe.resources.learner]
    return sum(g.replicas * g.num_cpus for g in groups) + reward_model_cpus(recipe)


def _local_reward_models(specs: dict[str, RewardModelSpec]) -> dict[str, RewardModelGroup]:
    return {name: LocalRewardModel(RewardModelScorer(name, spec)) for name, spec in specs.items()}


def _ray_reward_models(specs: dict[str, RewardModelSpec]) -> tuple[dict[str, RewardModelGroup], list]:
    """One actor group per reward model, each replica with the model's own resources. Scoring is
    a pure function of its inputs, so a dead replica is restarted and its call retried."""
    from k3post.dist.reward_groups import RayRewardModel  # noqa: PLC0415

    groups = {name: RayRewardModel([remote(RewardModelScorer, spec.resources, ACTOR_RESTARTS).remote(
        name, spec, spec.resources.threads) for _ in range(spec.resources.replicas)])
        for name, spec in specs.items()}
    return groups, [actor for group in groups.values() for actor in group.actors]


def build_rl_in_process(recipe: RlRecipe, run_dir: Path) -> RlRun:
    from k3post.dist.local import LocalSamplers  # noqa: PLC0415

    data = build_rl_data(recipe)  # bad data and bad reward names fail before any model loads
    by_source = source_rewards(recipe.data.sources, recipe.scoring)
    scorer = RewardScorer(by_source, _local_reward_models(recipe.reward_models), metas_by_uid(data))
    res = recipe.resources  # threads: in one process the last engine built (the learner) sets them
    sampler_cls, sampler_args = sampler_engine(recipe, res.samplers.threads)  # sampling.engine, as in OPD
    return RlRun(recipe, run_dir, LocalSamplers(sampler_cls(*sampler_args)),
                 Learner(rl_learner_config(recipe, res.learner.threads)), data, scorer)


def build_rl_on_ray(recipe: RlRecipe, run_dir: Path) -> RlRun:
    import ray  # noqa: PLC0415

    from k3post.dist.ray_groups import RayLearner, RaySamplers  # noqa: PLC0415
    from k3post.dist.weight_groups import connect_weights  # noqa: PLC0415

    data = build_rl_data(recipe)
    by_source = source_rewards(recipe.data.sources, recipe.scoring)
    res = recipe.resources
    # As in distillation: the learner is not restarted (its state lives only there), samplers are
    # (unless their weight transport cannot re-sync a new process: sampler_restarts).
    learner = remote(Learner, res.learner, 0).remote(rl_learner_config(recipe, res.learner.threads))
    samplers = sampler_actors(recipe)
    models, model_actors = _ray_reward_models(recipe.reward_models)
    actors = [learner, *samplers, *model_actors]
    started = time.perf_counter()
    ray.get([actor.__ray_ready__.remote() for actor in actors])
    print(f"k3post: {len(actors)} actors ready in {time.perf_counter() - started:.0f}s (learner, {len(samplers)} "
          f"sampler(s), reward models: {', '.join(models) or 'none'})")
    scorer = RewardScorer(by_source, models, metas_by_uid(data))
    transport = connect_weights(recipe.sampling, res, learner, samplers)
    return RlRun(recipe, run_dir, RaySamplers(samplers, load_tokenizer(recipe.student).pad_token_id),
                 RayLearner(learner, transport), data, scorer)


def with_rewards(run: DistillRun, on_ray: bool) -> DistillRun:
    """An OPD run whose data sources name rewards gets its reward scorer (else it is unchanged)."""
    recipe = run.recipe
    if not any(s.rewards for s in recipe.data.sources):
        return run
    by_source = source_rewards(recipe.data.sources, recipe.scoring)
    models = _ray_reward_models(recipe.reward_models)[0] if on_ray else _local_reward_models(recipe.reward_models)
    run.rewards = RewardScorer(by_source, models, metas_by_uid(run.data))
    return run
