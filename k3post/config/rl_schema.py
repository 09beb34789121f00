"""The schema of RL recipes (`kind: rl`): prompts whose completions earn rewards, groups of n
samples per prompt, group-relative advantages and a clipped policy-gradient step. The parts it
shares with the other kinds live in schema.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from k3post.config.base import Strict
from k3post.config.data_limits import PromptLimitSpec
from k3post.config.draft_schema import DraftSpec, check_draft
from k3post.config.drift_schema import DriftSpec
from k3post.config.learner_schema import LearnerSpec
from k3post.config.model_schema import ModelSpec
from k3post.config.on_policy import check_on_policy
from k3post.config.schema import (EvalSpec, LoraSpec, OptimSpec, QatSpec, RaySpec, ReferenceSpec, ResourcesSpec,
                                  RewardModelSpec, RewardUse, SamplingSpec, ScoringSpec, TrainSpec, check_heldout_file,
                                  check_fp8_sampling, check_reward_uses, check_warmup_fits,
                                  check_weight_transport)
from k3post.config.track_schema import TrackSpec
from k3post.config.vllm_resources import check_sampler_engine, check_sleeping_sampler


class RlSourceSpec(Strict):
    """RL prompts and the rewards their completions get (rows' extra fields reach the reward as `meta`)."""

    name: str = Field(min_length=1, description="the source's name, unique in the recipe (metrics name it)")
    prompts: str = Field(min_length=1, description="builtin:<name> or a .jsonl/.json/.parquet path")
    rewards: list[RewardUse] = Field(min_length=1, description=(
        "the rewards of this source's completions: R = Σ weight · r (a row's other fields reach them as meta)"))
    weight: PositiveFloat = Field(1.0, description="share of each step's prompts, relative to the other sources")
    heldout: int = Field(16, ge=0, description="rows kept out of training for evaluation, chosen by a hash of "
                                               "their ids")
    heldout_prompts: str | None = Field(None, min_length=1, description="a file of held-out prompts "
                                        "(instead of holding out `heldout` rows of `prompts`)")
    prompt_suffix: str = Field("", description="appended to each prompt's last user turn (an instruction)")

    @model_validator(mode="after")
    def _one_heldout(self):
        return check_heldout_file(self)


class RlDataSpec(PromptLimitSpec):  # + max_prompt_tokens, long_prompts (config/data_limits.py)
    sources: list[RlSourceSpec] = Field(min_length=1, description="the prompt sources and their rewards")
    prompts_per_step: PositiveInt = Field(4, description="prompts per step (each sampled `sampling.n` times), split "
                                                         "over the sources by weight")


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

    advantage: Literal["grpo", "dr_grpo", "rloo"] = Field("grpo", description=(
        "grpo: (R − mean)/(std + eps) per group; dr_grpo: R − mean; rloo: R − the mean of the others"))
    policy_loss: Literal["ppo_clip", "is"] = Field("ppo_clip", description=(
        "ppo_clip: the ratio clipped to [1 − clip_low, 1 + clip_high]; is: plain importance sampling (the ratio's "
        "denominator is the sampler's recorded logprob)"))
    clip_low: float = Field(0.2, gt=0, lt=1, description="ppo_clip: the ratio's lower clip is 1 − clip_low")
    clip_high: PositiveFloat = Field(0.2, description="ppo_clip: the ratio's upper clip is 1 + clip_high")
    dual_clip: float | None = Field(None, gt=1, description=(
        "ppo_clip, negative advantages A: the loss −ρA is capped at −dual_clip·A; null: no dual clip"))
    aggregation: Literal["token", "sequence"] = Field("token", description=(
        "token: every token weighs the same; sequence: every completion weighs the same"))
    reference: ReferenceSpec = Field(ReferenceSpec(), description="a KL-to-reference term, as in distillation")


class RlTrainSpec(TrainSpec):
    """The training loop of RL, which samples: + the drift gate (config/drift_schema.py)."""

    drift: DriftSpec = Field(DriftSpec(), description="the drift gate: what happens when the sampler and the "
                                                      "learner disagree")


class RlRecipe(Strict):
    """RL from rewards: n samples per prompt, group-relative advantages, a clipped policy-gradient step."""

    kind: Literal["rl"] = Field(description="RL from rewards")
    description: str = Field("", description="free text about the recipe (the model cards quote it)")
    student: ModelSpec = Field(description="the model being trained (a model spec)")
    reward_models: dict[str, RewardModelSpec] = Field({}, description=(
        "name → a reward model that data sources' rewards name (model: <name>)"))
    data: RlDataSpec = Field(description="the prompts and the rewards their completions get")
    sampling: RlSamplingSpec = Field(RlSamplingSpec(), description="the student's rollouts: n per prompt")
    loss: RlLossSpec = Field(RlLossSpec(), description="the RL objective: advantages and the policy loss")
    scoring: ScoringSpec = Field(ScoringSpec(), description="the thread pool that runs rule rewards")
    optim: OptimSpec = Field(OptimSpec(), description="AdamW, linear warmup then cosine decay")
    learner: LearnerSpec = Field(LearnerSpec(), description="how each learner rank holds the student "
                                                            "(precision, sharding)")
    lora: LoraSpec = Field(LoraSpec(), description="LoRA adapters instead of full fine-tuning")
    qat: QatSpec = Field(QatSpec(), description="FP8 quantization-aware training")
    draft: DraftSpec = Field(DraftSpec(), description="a draft head trained with the student, and speculative "
                                                      "rollouts with it (off by default)")
    train: RlTrainSpec = Field(RlTrainSpec(), description="the training loop: steps, evaluation, checkpoints")
    eval: EvalSpec = Field(EvalSpec(), description="held-out evaluation: the rewards of held-out prompts")
    resources: ResourcesSpec = Field(ResourcesSpec(), description="Ray resources of the learner and the samplers "
                                                                  "(reward models: their own resources)")
    ray: RaySpec = Field(RaySpec(), description="how the run gets a Ray cluster")
    # config/track_schema.py
    track: TrackSpec = Field(description="where the metrics go besides metrics.jsonl")

    @model_validator(mode="after")
    def _sources_and_rewards(self) -> "RlRecipe":
        names = [s.name for s in self.data.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources: source names must be unique (got {names})")
        check_reward_uses(self.data.sources, self.reward_models)
        check_weight_transport(self.sampling, self.resources)
        check_fp8_sampling(self.sampling, self.qat)
        check_sampler_engine(self.sampling, self.resources)
        check_sleeping_sampler(self.sampling, self.resources, "sync")
        check_on_policy(self)
        check_draft(self.draft, self.sampling)
        check_warmup_fits(self.optim, self.train)
        return self
