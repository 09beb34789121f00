"""The recipe's rewards: reward-model actor groups, a data source's reward uses, where rule
rewards run, and the check that ties the uses to the models (rewards/, docs/rewards.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from k3post.config.base import Strict
from k3post.config.model_schema import TinyModelSpec
from k3post.config.resource_schema import ResourceSpec


class RewardModelSpec(Strict):
    """A reward model: a sequence classifier scoring (prompt, completion) pairs, in its own actor group.

    `path`: any Hugging Face AutoModelForSequenceClassification directory; `tiny`: a random
    Llama classifier with the repo's character tokenizer (tests). The score is the logit of
    `label` (0 for the usual one-logit reward models). Inputs longer than `max_length` tokens
    keep their end (the completion).
    """

    path: str | None = Field(None, description="a Hugging Face AutoModelForSequenceClassification directory")
    tiny: TinyModelSpec | None = Field(None, description="instead of path: a random Llama classifier with the "
                                                         "repo's character tokenizer (tests)")
    label: int = Field(0, ge=0, description="the score is this label's logit (0 for the usual one-logit reward model)")
    batch_size: PositiveInt = Field(8, description="(prompt, completion) pairs scored per forward")
    max_length: PositiveInt = Field(1024, description="longer inputs keep their last this many tokens (the completion)")
    resources: ResourceSpec = Field(ResourceSpec(), description="Ray resources of the reward model's actor group")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "RewardModelSpec":
        if (self.path is None) == (self.tiny is None):
            raise ValueError("give exactly one of path (an HF classifier directory) or tiny")
        return self


class RewardUse(Strict):
    """One reward of a data source: a rule function (`fn: rewards.<module>:<function>`, with
    `kwargs` bound to it) or a reward model of the recipe (`model: <name>`), and its weight.
    The source's reward is R = Σ weight · r; each r is logged unweighted as rl/reward/<name>
    (name: the function's name or the model's, unless given)."""

    fn: str | None = Field(None, pattern=r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$",
                           description="a rule reward function, rewards.<module>:<function>")
    model: str | None = Field(None, description="instead of fn: the name of one of the recipe's reward_models")
    weight: float = Field(1.0, description="this reward's weight w in the source's reward R = Σ w · r")
    name: str | None = Field(None, min_length=1, description="the metric name, rl/reward/<name>; null: the "
                                                             "function's name or the model's")
    kwargs: dict[str, Any] = Field({}, description="keyword arguments bound to the function (fn only)")

    @model_validator(mode="after")
    def _fn_or_model(self) -> "RewardUse":
        if (self.fn is None) == (self.model is None):
            raise ValueError("give exactly one of fn (rewards.<module>:<function>) or model (a reward model name)")
        if self.kwargs and self.fn is None:
            raise ValueError("kwargs are bound to a reward function (fn), not to a reward model")
        return self

    @property
    def metric_name(self) -> str:
        return self.name or (self.fn.rpartition(":")[2] if self.fn else self.model)


class ScoringSpec(Strict):
    """Where and how rule rewards run: a thread pool beside the driver (k3post/rewards/pool.py)."""

    workers: PositiveInt = Field(4, description="threads that run rule reward functions")
    timeout_s: PositiveFloat = Field(30.0, description="a reward call running longer scores 0 for its sample "
                                                       "(a logged failure)")
    pass_threshold: float = Field(1.0, description="rl/pass_rate is the fraction of samples whose total reward "
                                                   "R is at least this")


def check_reward_uses(sources: list, reward_models: dict) -> None:
    """Per-source rewards: names unique within a source, models defined by the recipe, and every
    reward model used by some source (an unused one would hold its actors' resources for nothing)."""
    for i, source in enumerate(sources):
        names = [use.metric_name for use in source.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources[{i}].rewards: reward names must be unique within a source (got {names}); "
                             f"set `name:` to tell two uses of one function apart")
        for j, use in enumerate(source.rewards):
            if use.model is not None and use.model not in reward_models:
                known = ", ".join(sorted(reward_models)) or "none"
                raise ValueError(f"data.sources[{i}].rewards[{j}].model: '{use.model}' is not a reward model of "
                                 f"this recipe (reward_models: {known})")
    used = {use.model for source in sources for use in source.rewards if use.model is not None}
    unused = sorted(set(reward_models) - used)
    if unused:
        raise ValueError(f"reward_models: {', '.join(unused)} {'is' if len(unused) == 1 else 'are'} named by no data "
                         f"source's rewards, so {'it' if len(unused) == 1 else 'they'} would start and score nothing; "
                         f"name it in data.sources[i].rewards (model: <name>) or remove it")
