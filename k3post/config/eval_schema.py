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

    max_new_tokens: PositiveInt = Field(64, description="longest completion, in tokens (a task may override it)")
    temperature: PositiveFloat = Field(1.0, description="sampling temperature (a task may override it)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: keep the most likely tokens up to this "
                                                     "probability mass (1: all)")
    batch_size: PositiveInt = Field(16, description="prompts per engine call")


class StudentSpec(Strict):
    """A student: exactly one of `model` (any ModelSpec) or `run` (a run directory).

    `run` expands to the run's initial student (step 0, rebuilt from recipe.resolved.yaml) and
    each kept checkpoints/step-N — a training run evaluated over time. `fp8` adds a twin served
    in FP8: "export" writes one here with k3post.model.export.fp8_export, a path names an existing export.
    """

    model: ModelSpec | None = Field(None, description="where the student's weights come from (a model spec)")
    run: str | None = Field(None, description=(
        "instead of model: a run directory; its initial student (step 0) and each kept checkpoints/step-N"))
    steps: list[int] | None = Field(None, description="only these steps of the run (0: the initial student)")
    include_initial: bool = Field(True, description="a run's initial student (step 0) is evaluated too")
    fp8: str | None = Field(None, description=(
        "also evaluate a twin served in FP8: export writes one here, a path names an existing export"))

    @model_validator(mode="after")
    def _one_source(self) -> "StudentSpec":
        if (self.model is None) == (self.run is None):
            raise ValueError("give exactly one of model (a model spec) or run (a run directory)")
        if self.steps is not None and self.run is None:
            raise ValueError("steps only applies to a run")
        return self


class TaskBase(Strict):
    name: str = Field(min_length=1, description="the task's name, unique in the recipe (the report's metrics "
                                                "name it)")
    limit: PositiveInt | None = Field(None, description="use only the first N rows")
    max_new_tokens: PositiveInt | None = Field(None, description="this task's completion length; null: "
                                                                 "sampling.max_new_tokens")
    temperature: PositiveFloat | None = Field(None, description="this task's temperature; null: "
                                                                "sampling.temperature")
    split: str = Field("test", description="hub:<name> data: the dataset split")
    subset: str | None = Field(None, description="hub:<name> data: the dataset subset (configuration)")
    prompt_field: str = Field("prompt", description="hub:<name> data: the column holding the prompt")


class GenerationTask(TaskBase):
    """Verifiable generation: `samples` completions per prompt, pass@k for each k."""

    kind: Literal["generation"] = Field(description=(
        "verifiable generation: `samples` completions per prompt, pass@k for each k"))
    data: str = Field(min_length=1, description="builtin:<name>, a .jsonl/.json/.parquet file or hub:<name>")
    verifier: str = Field("math", description="what checks a completion: math, code, exact, regex or a reward "
                                              "function <module>:<function>")
    answer_field: str | None = Field(None, description="the row field the verifier checks against; null: "
                                                       "'tests' for code, else 'answer'")
    pattern: str | None = Field(None, description="regex verifier: the answer's pattern (group 1 if any)")
    samples: PositiveInt = Field(1, description="completions per prompt")
    k: list[PositiveInt] = Field([1], min_length=1, description="pass@k is reported for each k (at most samples)")
    timeout_s: PositiveFloat = Field(10.0, description="a verifier call running longer scores 0")

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

    kind: Literal["kl"] = Field(description="exact full-vocabulary KL of every student against every teacher")
    prompts: str = Field(min_length=1, description="builtin:<name>, a .jsonl/.json/.parquet file or hub:<name>")
    teachers: list[str] | None = Field(None, description="the teachers to compare with; null: every teacher of "
                                                         "the recipe")


class NLLTask(TaskBase):
    """Token-mean NLL of reference replies (rows: prompt + `completion_field`, or chats ending in the reply)."""

    kind: Literal["nll"] = Field(description="token-mean NLL of reference replies")
    data: str = Field(min_length=1, description="builtin:<name>, a .jsonl/.json/.parquet file or hub:<name>")
    completion_field: str = Field("completion", description=(
        "the row field holding the reply, for rows that are not chats ending in the reply"))
    max_tokens: PositiveInt = Field(256, description="reply tokens scored per row at most, the end token included")


class Fp8GapTask(TaskBase):
    """What FP8 serving costs: exact KL(full precision ‖ FP8) on the full-precision model's samples."""

    kind: Literal["fp8_gap"] = Field(description="what FP8 serving costs: KL(full precision ‖ FP8) of each FP8 twin")
    prompts: str = Field(min_length=1, description="builtin:<name>, a .jsonl/.json/.parquet file or hub:<name>")


class TextTask(TaskBase):
    """What the completions look like (algo/text_metrics.py): one sample per prompt; mean length in
    tokens, distinct-n and repetition rate (seq-rep-n) of its words - collapse shows here when the
    KL does not - and, if `score` names one, the rate of a rule-based behaviour score."""

    kind: Literal["text"] = Field(description=(
        "what the completions look like: length, distinct-n, repetition rate, a behaviour score"))
    prompts: str = Field(min_length=1, description="builtin:<name>, a .jsonl/.json/.parquet file or hub:<name>")
    score: Literal["answer_prefix", "numbered_list", "brief"] | None = Field(
        None, description="also report the rate of this rule-based behaviour score (k3post/algo/text_metrics.py); "
                          "null: none")
    distinct_n: PositiveInt = Field(2, description="n of distinct-n: distinct word n-grams / all n-grams")
    repetition_n: PositiveInt = Field(4, description="n of the repetition rate: n-grams that repeat an earlier one "
                                                     "of the same completion")


TaskSpec = Annotated[Union[GenerationTask, KLTask, NLLTask, Fp8GapTask, TextTask], Field(discriminator="kind")]
TASK_KINDS: dict[str, type[TaskBase]] = {"generation": GenerationTask, "kl": KLTask, "nll": NLLTask,
                                         "fp8_gap": Fp8GapTask, "text": TextTask}


class EvalRecipe(Strict):
    kind: Literal["eval"] = Field(description="an evaluation recipe (k3post eval)")
    description: str = Field("", description="free text about the recipe")
    students: dict[str, StudentSpec] = Field({}, description="name → a student: a model spec or a run directory")
    teachers: dict[str, TeacherSpec] = Field({}, description=(
        "name → a teacher file or an inline teacher mapping, as in a distill recipe"))
    tasks: list[TaskSpec] = Field(min_length=1, description="what to measure, one entry per task (by kind)")
    sampling: EvalSamplingSpec = Field(EvalSamplingSpec(), description="sampling shared by every task")
    seed: int = Field(0, description="seed of the sampling and of the bootstrap intervals")
    # docs/engines.md
    engine: Literal["hf", "vllm"] = Field("hf", description=(
        "hf: transformers; vllm: sampling and scoring through vLLM (the KL tasks' full distributions still from "
        "an HF copy)"))
    vllm: VllmSpec = Field(VllmSpec(), description="options of the vLLM engine (engine: vllm)")
    confidence: float = Field(0.95, gt=0, lt=1, description="confidence level of the reported intervals")
    threads: PositiveInt | None = Field(None, description="torch threads; null: every core")
    # config/track_schema.py; report.json is always written. One record per evaluated model, at its
    # training step (0 for a model that is not a run's checkpoint), `<task>/<metric>/<model group>`.
    track: TrackSpec = Field(description="where the report's numbers also go, one record per model at its step")

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
