"""The pipeline recipe (`kind: pipeline`): training and evaluation stages run in order, each
stage's final student handed to the next (DESIGN: SFT with FP8 QAT → OPD → eval).

    kind: pipeline
    stages:
      - {name: sft, recipe: sft/smollm2-math-fp8-qat.yaml}
      - {name: opd, recipe: quickstart.yaml, student_from: sft, overrides: [train.steps=14]}
      - {name: eval, recipe: eval/quickstart.yaml, students_from: [sft, opd]}

A stage's `recipe` is any sft / distill / rl / eval recipe file (relative to the pipeline file).
`student_from: S` starts a training stage from stage S's last checkpoint; `students_from` adds
each named stage's run (its initial student and every checkpoint) to an eval stage's students.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from k3post.config.schema import Strict

STAGE_NAME = r"^[A-Za-z0-9_-]+$"


class StageSpec(Strict):
    name: str = Field(pattern=STAGE_NAME, description="also the stage's directory under the run directory")
    recipe: str = Field(min_length=1, description="an sft, distill, rl or eval recipe file, relative to the "
                                                  "pipeline file")
    overrides: list[str] = Field(default_factory=list, description="dotted KEY.PATH=VALUE overrides of the stage's "
                                                                   "recipe, as on the command line")
    student_from: str | None = Field(None, description="train from this earlier stage's last checkpoint")
    students_from: list[str] = Field(default_factory=list, description=(
        "eval stages: these earlier stages' runs (initial student and every checkpoint) join the students"))

    @model_validator(mode="after")
    def _overrides_are_assignments(self) -> "StageSpec":
        for item in self.overrides:
            if not re.match(r"^[\w.-]+=", item):
                raise ValueError(f"override {item!r} is not KEY.PATH=VALUE")
        return self


class PipelineRecipe(Strict):
    kind: Literal["pipeline"] = Field("pipeline", description="stages run in order")
    description: str = Field("", description="free text about the pipeline")
    stages: list[StageSpec] = Field(min_length=1, description="the stages, in the order they run")

    @model_validator(mode="after")
    def _stages_refer_backwards(self) -> "PipelineRecipe":
        seen: list[str] = []
        for stage in self.stages:
            if stage.name in seen:
                raise ValueError(f"two stages are named {stage.name!r}")
            for source in ([stage.student_from] if stage.student_from else []) + stage.students_from:
                if source not in seen:
                    raise ValueError(f"stage {stage.name!r} takes its student from {source!r}, which is not an "
                                     f"earlier stage (earlier: {', '.join(seen) or 'none'})")
            seen.append(stage.name)
        return self
