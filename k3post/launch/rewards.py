"""The rewards of a run (RL, or OPD sources that name rewards): each source's rule functions in
a pool of its own, and one engine group per reward model (with its own resources) over the
backend. Reward functions load here, so a bad name fails before any model does."""

from __future__ import annotations

from k3post.config.rl_schema import RlRecipe
from k3post.config.schema import DistillRecipe, ScoringSpec
from k3post.data.mixture import PromptMixture
from k3post.engine.evaluation.reward_model import RewardModelScorer
from k3post.launch.backend import Backend, EngineSpec
from k3post.launch.engines import ACTOR_RESTARTS
from k3post.loops.rewarding import ModelReward, RewardScorer, SourceRewards, metas_by_uid
from k3post.rewards import RewardPool, make_reward_spec


def source_rewards(sources: list, scoring: ScoringSpec) -> dict[str, SourceRewards]:
    """Each source's reward functions loaded into its own pool, and its reward-model uses."""
    out = {}
    for source in sources:
        if not source.rewards:
            continue
        specs = [make_reward_spec(use.fn, use.weight, use.metric_name, use.kwargs) for use in source.rewards if use.fn]
        models = [ModelReward(use.metric_name, use.model, use.weight) for use in source.rewards if use.model]
        out[source.name] = SourceRewards(RewardPool(specs, scoring.workers, scoring.timeout_s), models)
    return out


def reward_scorer(recipe: DistillRecipe | RlRecipe, data: PromptMixture, backend: Backend) -> RewardScorer:
    """The run's reward scorer. Reward models score as a pure function of their inputs, so a dead
    replica is restarted and its call retried."""
    by_source = source_rewards(recipe.data.sources, recipe.scoring)
    models = {name: backend.reward_model(EngineSpec(RewardModelScorer, (name, spec), spec.resources, ACTOR_RESTARTS))
              for name, spec in recipe.reward_models.items()}
    return RewardScorer(by_source, models, metas_by_uid(data))
