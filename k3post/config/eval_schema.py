"""The evaluation recipe (`kind: eval`, recipes/eval/*.yaml). Defaults live here.

    kind: eval
    students:                       # name → where its weights come from
      base:    {model: {builtin: smollm2-135m-instruct, keep_layers: [...]}}
      trained: {run: ../../runs/quickstart}      # the run's initial student + every checkpoints/step-N
      served:  {model: {path: ../../runs/fp8}}   # an FP8 export is a plain HF directory
      qat:     {model: {path: ...}, fp8: export} # also evaluate its FP8 export (made here)
    teachers: {chat: ../teachers/smollm2-chat.yaml}   # files or inline, as in a distill recipe
    tasks:
      - {name: arith, kind: generation, data: "builtin:arith", verifier: math, samples: 4, k: [1, 4]}
      - {name: kl, kind: kl, prompts: "builtin:heldout-chat", limit: 32}
      - {name: nll, kind: nll, data: "builtin:reference"}
      - {name: fp8, kind: fp8_gap, prompts: "builtin:heldout-chat"}
      - {name: style, kind: text, prompts: "builtin:heldout-chat", score: answer_prefix}

Everything is strict (unknown keys are errors), like the training recipes. `k3post eval` loads
tasks and students one by one (config/eval_load.py), so one bad entry is reported and the rest
still run; `k3post validate` rejects the file.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from k3post.config.schema import ModelSpec, Strict, TeacherSpec, VllmSpec
from k3post.config.track_schema import TrackSpec

VERIFIERS = {  # verifier name → reward function (rewards/*.py) and its fixed keyword arguments
    "math": ("rewards.math:correctness", {}),
    "code": ("rewards.code:tests_pass", {"all_or_nothing": True}),
    "exact": ("rewards.match:exact_match", {}),
    "regex": ("rewards.match:regex_match", {}),
}


class EvalSamplingSpec(Strict):
    """Sampling shared by every task (a task may override max_new_tokens and temperature)."""

    max_new_tokens: PositiveInt = 64
    temperature: PositiveFloat = 1.0
    top_p: float = Field(1.0, gt=0, le=1)
    batch_size: PositiveInt = Field(16, description="prompts per engine call")


class StudentSpec(Strict):
    """A student: exactly one of `model` (any ModelSpec) or `run` (a run directory).

    `run` expands to the run's initial student (step 0, rebuilt from recipe.resolved.yaml) and
    each kept checkpoints/step-N — a training run evaluated over time. `fp8` adds a twin served
    in FP8: "export" writes one here with k3post.model.fp8_export, a path names an existing export.
    """

    model: ModelSpec | None = None
    run: str | None = None
    steps: list[int] | None = Field(None, description="only these steps of the run (0 = the initial student)")
    include_initial: bool = True
    fp8: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "StudentSpec":
        if (self.model is None) == (self.run is None):
            raise ValueError("give exactly one of model (a model spec) or run (a run directory)")
        if self.steps is not None and self.run is None:
            raise ValueError("steps only applies to a run")
        return self


class TaskBase(Strict):
    name: str = Field(min_length=1)
    limit: PositiveInt | None = Field(None, description="use only the first N rows")
    max_new_tokens: PositiveInt | None = None
    temperature: PositiveFloat | None = None
    # Hub datasets only (data: "hub:<name>"): which split/subset, and the prompt's column.
    split: str = "test"
    subset: str | None = None
    prompt_field: str = "prompt"


class GenerationTask(TaskBase):
    """Verifiable generation: `samples` completions per prompt, pass@k for each k."""

    kind: Literal["generation"]
    data: str = Field(min_length=1, description="builtin:<name>, a .jsonl/.json/.parquet file or hub:<name>")
    verifier: str = Field("math", description="math | code | exact | regex | <module>:<function>")
    answer_field: str | None = Field(None, description="default: 'tests' for code, else 'answer'")
    pattern: str | None = Field(None, description="regex verifier: the answer's pattern (group 1 if any)")
    samples: PositiveInt = 1
    k: list[PositiveInt] = Field([1], min_length=1)
    timeout_s: PositiveFloat = 10.0

    @model_validator(mode="after")
    def _consistent(self) -> "GenerationTask":
        if max(self.k) > self.samples:
            raise ValueError(f"k {max(self.k)} > samples {self.samples}: pass@k needs at least k samples per prompt")
        if self.verifier not in VERIFIERS and ":" not in self.verifier:
            raise ValueError(f"verifier {self.verifier!r}: expected one of {', '.join(VERIFIERS)} or "
                             "'<module>:<function>'")
        if (self.verifier == "regex") != (self.pattern is not None):
            raise ValueError("pattern is required by the regex verifier and only used by it")
        return self

    @property
    def gold_field(self) -> str:
        return self.answer_field or ("tests" if self.verifier == "code" else "answer")


class KLTask(TaskBase):
    """Exact full-vocabulary KL of every student against every teacher (or those listed)."""

    kind: Literal["kl"]
    prompts: str = Field(min_length=1)
    teachers: list[str] | None = Field(None, description="default: every teacher of the recipe")


class NLLTask(TaskBase):
    """Token-mean NLL of reference replies (rows: prompt + `completion_field`, or chats ending in the reply)."""

    kind: Literal["nll"]
    data: str = Field(min_length=1)
    completion_field: str = "completion"
    max_tokens: PositiveInt = 256


class Fp8GapTask(TaskBase):
    """What FP8 serving costs: exact KL(full precision ‖ FP8) on the full-precision model's samples."""

    kind: Literal["fp8_gap"]
    prompts: str = Field(min_length=1)


class TextTask(TaskBase):
    """What the completions look like (algo/text_metrics.py): one sample per prompt; mean length in
    tokens, distinct-n and repetition rate (seq-rep-n) of its words - collapse shows here when the
    KL does not - and, if `score` names one, the rate of a rule-based behaviour score."""

    kind: Literal["text"]
    prompts: str = Field(min_length=1)
    score: Literal["answer_prefix", "numbered_list", "brief"] | None = Field(
        None, description="a behaviour score of k3post/algo/text_metrics.py: BEHAVIOUR_SCORES")
    distinct_n: PositiveInt = 2
    repetition_n: PositiveInt = 4


TaskSpec = Annotated[Union[GenerationTask, KLTask, NLLTask, Fp8GapTask, TextTask], Field(discriminator="kind")]
TASK_KINDS: dict[str, type[TaskBase]] = {"generation": GenerationTask, "kl": KLTask, "nll": NLLTask,
                                         "fp8_gap": Fp8GapTask, "text": TextTask}


class EvalRecipe(Strict):
    kind: Literal["eval"]
    description: str = ""
    students: dict[str, StudentSpec] = {}
    teachers: dict[str, TeacherSpec] = {}
    tasks: list[TaskSpec] = Field(min_length=1)
    sampling: EvalSamplingSpec = EvalSamplingSpec()
    seed: int = 0
    # hf: transformers; vllm: sampling and scoring through vLLM (full distributions for the KL
    # tasks still from an HF copy; docs/engines.md), with `vllm` as its engine options.
    engine: Literal["hf", "vllm"] = "hf"
    vllm: VllmSpec = VllmSpec()
    confidence: float = Field(0.95, gt=0, lt=1)
    threads: PositiveInt | None = Field(None, description="torch threads; default: every core")
    # Where the report's numbers also go (config/track_schema.py; report.json is always written):
    # one record per evaluated model, at its training step (0 for a model that is not a run's
    # checkpoint), `<task>/<metric>/<model group>` → value.
    track: TrackSpec

    @model_validator(mode="after")
    def _references(self) -> "EvalRecipe":
        if not self.students and not self.teachers:
            raise ValueError("nothing to evaluate: give students and/or teachers")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"tasks: task names must be unique (got {names})")
        clash = sorted(set(self.students) & set(self.teachers))
        if clash:
            raise ValueError(f"students and teachers share the name(s) {clash}")
        for i, task in enumerate(self.tasks):
            if isinstance(task, KLTask):
                unknown = [t for t in task.teachers or [] if t not in self.teachers]
                if unknown or not self.teachers:
                    raise ValueError(f"tasks[{i}].teachers: {unknown or 'none'} not among the recipe's teachers "
                                     f"({', '.join(self.teachers) or 'none'})")
        return self
