"""The schema of SFT recipes (`kind: sft`): chat examples whose final reply is the target,
optionally with FP8 QAT and LoRA. The parts it shares with the other kinds live in schema.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from k3post.config.base import Strict
from k3post.config.data_limits import PromptLimitSpec
from k3post.config.learner_schema import LearnerSpec
from k3post.config.model_schema import ModelSpec
from k3post.config.schema import (LearnerResourcesSpec, LoraSpec, OptimSpec, QatSpec, RaySpec, TrainSpec,
                                  check_warmup_fits)
from k3post.config.track_schema import TrackSpec


class SftSourceSpec(Strict):
    """SFT examples: rows with a final assistant message or a completion field."""

    name: str = Field(min_length=1)
    examples: str = Field(min_length=1, description="builtin:<name> or a .jsonl/.json/.parquet path")
    completion_field: str = "completion"
    weight: PositiveFloat = 1.0
    heldout: int = Field(32, ge=0, description="rows kept out of training for the held-out NLL")


class SftDataSpec(PromptLimitSpec):  # + max_prompt_tokens, long_prompts (config/data_limits.py)
    sources: list[SftSourceSpec] = Field(min_length=1)
    examples_per_step: PositiveInt = 8
    max_completion_tokens: PositiveInt = 256


class SftEvalSpec(Strict):
    examples_per_source: PositiveInt = 32


class SftRecipe(Strict):
    """Supervised fine-tuning (optionally with FP8 QAT and LoRA): loss on the reply tokens only."""

    kind: Literal["sft"]
    description: str = ""
    student: ModelSpec
    data: SftDataSpec
    optim: OptimSpec = OptimSpec()
    learner: LearnerSpec = LearnerSpec()
    lora: LoraSpec = LoraSpec()
    qat: QatSpec = QatSpec()
    train: TrainSpec = TrainSpec()
    eval: SftEvalSpec = SftEvalSpec()
    resources: LearnerResourcesSpec = LearnerResourcesSpec()
    ray: RaySpec = RaySpec()
    track: TrackSpec  # where the metrics go (config/track_schema.py)

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
        return self
