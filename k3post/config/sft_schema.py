"""The schema of SFT recipes (`kind: sft`): chat examples whose final reply is the target,
optionally with FP8 QAT and LoRA. The parts it shares with the other kinds live in schema.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from k3post.config.base import Strict
from k3post.config.data_limits import PromptLimitSpec
from k3post.config.draft_schema import DraftSpec, check_draft
from k3post.config.learner_schema import LearnerSpec
from k3post.config.model_schema import ModelSpec
from k3post.config.schema import (LearnerResourcesSpec, LoraSpec, OptimSpec, QatSpec, RaySpec, TrainSpec,
                                  check_warmup_fits)
from k3post.config.track_schema import TrackSpec


class SftSourceSpec(Strict):
    """SFT examples: rows with a final assistant message or a completion field."""

    name: str = Field(min_length=1, description="the source's name (metrics name it)")
    examples: str = Field(min_length=1, description="builtin:<name> or a .jsonl/.json/.parquet path")
    completion_field: str = Field("completion", description=(
        "the row field holding the reply, for rows that do not end with an assistant message"))
    weight: PositiveFloat = Field(1.0, description="share of each step's examples, relative to the other sources")
    heldout: int = Field(32, ge=0, description="rows kept out of training for the held-out NLL")


class SftDataSpec(PromptLimitSpec):  # + max_prompt_tokens, long_prompts (config/data_limits.py)
    sources: list[SftSourceSpec] = Field(min_length=1, description="the example sources")
    examples_per_step: PositiveInt = Field(8, description="examples per step, split over the sources by weight")
    max_completion_tokens: PositiveInt = Field(256, description=(
        "reply tokens trained on per example, the end-of-turn token included; a longer reply is cut"))


class SftEvalSpec(Strict):
    examples_per_source: PositiveInt = Field(32, description="held-out examples per source scored for eval/nll")


class SftRecipe(Strict):
    """Supervised fine-tuning (optionally with FP8 QAT and LoRA): loss on the reply tokens only."""

    kind: Literal["sft"] = Field(description="supervised fine-tuning")
    description: str = Field("", description="free text about the recipe (the model cards quote it)")
    student: ModelSpec = Field(description="the model being trained (a model spec)")
    data: SftDataSpec = Field(description="the chat examples whose final reply is the target")
    optim: OptimSpec = Field(OptimSpec(), description="AdamW, linear warmup then cosine decay")
    learner: LearnerSpec = Field(LearnerSpec(), description="how each learner rank holds the student "
                                                            "(precision, sharding)")
    lora: LoraSpec = Field(LoraSpec(), description="LoRA adapters instead of full fine-tuning")
    qat: QatSpec = Field(QatSpec(), description="FP8 quantization-aware training")
    draft: DraftSpec = Field(DraftSpec(), description="a draft head trained with the student (off by default)")
    train: TrainSpec = Field(TrainSpec(), description="the training loop: steps, evaluation, checkpoints")
    eval: SftEvalSpec = Field(SftEvalSpec(), description="held-out evaluation: the NLL of held-out replies")
    resources: LearnerResourcesSpec = Field(LearnerResourcesSpec(), description="Ray resources of the learner")
    ray: RaySpec = Field(RaySpec(), description="how the run gets a Ray cluster")
    # config/track_schema.py
    track: TrackSpec = Field(description="where the metrics go besides metrics.jsonl")

    @model_validator(mode="before")
    @classmethod
    def _student_not_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" in data:
            raise ValueError("model: SFT recipes name the model being trained `student:` (as distill and rl "
                             "recipes do); rename the key")
        return data

    @model_validator(mode="after")
    def _warmup_fits(self) -> "SftRecipe":
        check_warmup_fits(self.optim, self.train)
        check_draft(self.draft, None, samples=False)
        return self
