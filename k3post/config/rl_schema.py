"""The schema of RL recipes (`kind: rl`): prompts whose completions earn rewards, groups of n
samples per prompt, group-relative advantages and a clipped policy-gradient step. The parts it
shares with the other kinds live in schema.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from k3post.config.base import Strict
from k3post.config.data_limits import PromptLimitSpec
from k3post.config.drift_schema import DriftSpec
from k3post.config.learner_schema import LearnerSpec
from k3post.config.model_schema import ModelSpec
from k3post.config.schema import (EvalSpec, LoraSpec, OptimSpec, QatSpec, RaySpec, ReferenceSpec, ResourcesSpec,
                                  RewardModelSpec, RewardUse, SamplingSpec, ScoringSpec, TrainSpec, check_heldout_file,
                                  check_reward_uses, check_warmup_fits, check_weight_transport)
from k3post.config.track_schema import TrackSpec
from k3post.config.vllm_resources import check_sampler_engine


class RlSourceSpec(Strict):
    """RL prompts and the rewards their completions get (rows' extra fields reach the reward as `meta`)."""

    name: str = Field(min_length=1)
    prompts: str = Field(min_length=1, description="builtin:<name> or a .jsonl/.json/.parquet path")
    rewards: list[RewardUse] = Field(min_length=1)
    weight: PositiveFloat = 1.0
    heldout: int = Field(16, ge=0, description="rows kept out of training for evaluation")
    heldout_prompts: str | None = Field(None, min_length=1, description="a file of held-out prompts "
                                        "(instead of holding out `heldout` rows of `prompts`)")
    prompt_suffix: str = Field("", description="appended to each prompt's last user turn (an instruction)")

    @model_validator(mode="after")
    def _one_heldout(self):
        return check_heldout_file(self)


class RlDataSpec(PromptLimitSpec):  # + max_prompt_tokens, long_prompts (config/data_limits.py)
    sources: list[RlSourceSpec] = Field(min_length=1)
    prompts_per_step: PositiveInt = 4


class RlSamplingSpec(SamplingSpec):
    n: int = Field(4, ge=2, description="completions per prompt: the group the advantages compare")


class RlLossSpec(Strict):
    """The RL objective (k3post/algo/advantages.py, policy_loss.py, objectives.py: RlPolicyLoss).

    advantage: grpo (R − mean)/(std + eps) per group; dr_grpo without the std division; rloo the
    leave-one-out baseline. policy_loss: ppo_clip (ratio clipped to [1 − clip_low, 1 + clip_high],
    optional dual clip for negative advantages) or is (plain importance sampling); the ratio's
    denominator is the sampler's recorded logprob. aggregation: token (every token weighs the
    same) or sequence (every completion weighs the same). reference: a KL-to-reference term, as
    in distillation (kind, kl_coef, estimator k1/k2/k3).
    """

    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    policy_loss: Literal["ppo_clip", "is"] = "ppo_clip"
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: PositiveFloat = 0.2
    dual_clip: float | None = Field(None, gt=1)
    aggregation: Literal["token", "sequence"] = "token"
    reference: ReferenceSpec = ReferenceSpec()


class RlTrainSpec(TrainSpec):
    """The training loop of RL, which samples: + the drift gate (config/drift_schema.py)."""

    drift: DriftSpec = DriftSpec()


class RlRecipe(Strict):
    """RL from rewards: n samples per prompt, group-relative advantages, a clipped policy-gradient step."""

    kind: Literal["rl"]
    description: str = ""
    student: ModelSpec
    reward_models: dict[str, RewardModelSpec] = {}
    data: RlDataSpec
    sampling: RlSamplingSpec = RlSamplingSpec()
    loss: RlLossSpec = RlLossSpec()
    scoring: ScoringSpec = ScoringSpec()
    optim: OptimSpec = OptimSpec()
    learner: LearnerSpec = LearnerSpec()
    lora: LoraSpec = LoraSpec()
    qat: QatSpec = QatSpec()
    train: RlTrainSpec = RlTrainSpec()
    eval: EvalSpec = EvalSpec()
    resources: ResourcesSpec = ResourcesSpec()
    ray: RaySpec = RaySpec()
    track: TrackSpec  # where the metrics go (config/track_schema.py)

    @model_validator(mode="after")
    def _sources_and_rewards(self) -> "RlRecipe":
        names = [s.name for s in self.data.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources: source names must be unique (got {names})")
        check_reward_uses(self.data.sources, self.reward_models)
        check_weight_transport(self.sampling, self.resources)
        check_sampler_engine(self.sampling, self.resources)
        check_warmup_fits(self.optim, self.train)
        return self
