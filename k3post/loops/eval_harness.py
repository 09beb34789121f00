"""`run_evaluation`: every model on every task that applies to it, failures recorded, not raised.

Order of work:
1. prepare each task once: load its rows, check every row has what the task needs (a gold
   answer, tests, a reference reply), build its verifier. A task that fails here is reported
   with the file and row, and skipped;
2. for each student (with its FP8 twin, if any), then each teacher: open the model, run every
   task that applies, close it. Teachers stay open once opened: every student's KL needs them;
3. return the records (one per number of the report), the failures, and a few samples.

A model that fails to open (a missing path) or a task that fails on one model costs that
model/task pair only; the rest of the evaluation runs and the report says what failed.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from k3post.config.errors import UserError
from k3post.config.eval_schema import VERIFIERS, EvalRecipe, GenerationTask, NLLTask
from k3post.data.eval_sets import load_eval_rows, require_field
from k3post.loops.eval_plan import ModelEntry
from k3post.loops.eval_tasks import TASK_RUNNERS, EvalContext, EvalModel, PreparedTask, applies
from k3post.rewards.loader import make_reward_spec
from k3post.rewards.pool import RewardPool
from k3post.track.progress import Progress
from k3post.types import Prompt

LOG = logging.getLogger(__name__)


@dataclass
class EvalResults:
    records: list[dict] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)  # {"model", "task", "error"}
    samples: list[dict] = field(default_factory=list)


def _describe(error: Exception) -> str:
    return str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"


def prepare_task(spec, base_dir: Path, reference_examples: Callable) -> PreparedTask:
    """Load and check a task's rows (UserError naming the file and row when one is unusable)."""
    data = spec.data if hasattr(spec, "data") else spec.prompts
    rows, label = load_eval_rows(data, base_dir, spec.split, spec.subset, spec.prompt_field)
    rows = rows[: spec.limit] if spec.limit else rows
    if isinstance(spec, NLLTask):
        return PreparedTask(spec, reference_examples(rows, spec.completion_field, label), label=label)
    prompts = [Prompt(r["id"], label, "", tuple(tuple(m) for m in r["messages"])) for r in rows]
    metas = [{k: v for k, v in r.items() if k not in ("id", "messages")} for r in rows]
    if not isinstance(spec, GenerationTask):
        return PreparedTask(spec, prompts, metas, label)
    require_field(rows, spec.gold_field, label, f"the {spec.verifier} verifier compares against it")
    # The shipped verifiers read meta["answer"] (meta["tests"] for code): a gold answer kept under
    # another name is copied there.
    canonical = "tests" if spec.verifier == "code" else "answer"
    for meta in metas:
        meta[canonical] = meta[spec.gold_field]
    target, kwargs = VERIFIERS.get(spec.verifier, (spec.verifier, {}))
    kwargs = dict(kwargs)
    if spec.pattern is not None:
        kwargs["pattern"] = spec.pattern
    reward = make_reward_spec(target, name="verifier", kwargs=kwargs)
    return PreparedTask(spec, prompts, metas, label, RewardPool([reward], max_workers=2, timeout_s=spec.timeout_s))


class _Models:
    """Opens models through the engine factory; teachers stay open, students are closed per unit."""

    def __init__(self, entries: list[ModelEntry], open_model: Callable[[ModelEntry], EvalModel]):
        self.by_name = {e.name: e for e in entries}
        self.open_model = open_model
        self.teachers: dict[str, EvalModel] = {}
        self.unit: dict[str, EvalModel] = {}  # the student and its FP8 twin being evaluated now

    def teacher(self, name: str) -> EvalModel:
        if name not in self.teachers:
            self.teachers[name] = self.open_model(self.by_name[name])
        return self.teachers[name]

    def twin(self, name: str) -> EvalModel:
        if name not in self.unit:
            raise UserError(f"the full-precision model {name} is not available (it failed to load)")
        return self.unit[name]

    def open(self, entry: ModelEntry) -> EvalModel:
        if entry.role == "teacher":
            return self.teacher(entry.name)
        if entry.fp8_of is None:  # a new unit starts: drop the previous student and twin
            self.unit.clear()
            gc.collect()
        self.unit[entry.name] = self.open_model(entry)
        return self.unit[entry.name]


def _units_of_work(entries: list[ModelEntry], tasks: list[PreparedTask]) -> int:
    return sum(applies(t.spec.kind, e) for e in entries for t in tasks)


def run_evaluation(recipe: EvalRecipe, entries: list[ModelEntry], open_model: Callable[[ModelEntry], EvalModel],
                   base_dir: Path, reference_examples: Callable,
                   make_progress: Callable[[int], Progress] | None = None) -> EvalResults:
    """Evaluate `entries` on the recipe's tasks. `open_model` is the engine factory; `reference_examples`
    turns NLL rows into examples (engine/evaluation/eval_model.py); `make_progress(total)` the progress display."""
    results = EvalResults()
    tasks: list[PreparedTask] = []
    for spec in recipe.tasks:
        try:
            tasks.append(prepare_task(spec, base_dir, reference_examples))
        except Exception as error:  # noqa: BLE001 - reported; the other tasks still run
            results.failures.append({"model": None, "task": spec.name, "error": _describe(error)})
    models = _Models(entries, open_model)
    ctx = EvalContext(recipe, models.teacher, models.twin)
    total, done = _units_of_work(entries, tasks), 0
    progress = (make_progress or (lambda n: Progress(n, enabled=False, description="eval")))(max(total, 1))
    for entry in entries:
        todo = [t for t in tasks if applies(t.spec.kind, entry)]
        try:
            model = models.open(entry)
        except Exception as error:  # noqa: BLE001 - a model that does not load costs its own rows only
            results.failures.append({"model": entry.name, "task": None, "error": _describe(error)})
            done += len(todo)
            progress.update(done, {})
            progress.message(f"{entry.name}: failed to load: {_describe(error)}")
            continue
        for task in todo:
            try:
                records = TASK_RUNNERS[task.spec.kind](ctx, entry, model, task)
                results.records += records
                summary = "  ".join(f"{r['metric']}{'[' + r['teacher'] + ']' if r.get('teacher') else ''}="
                                    f"{r['value']:.3f}" for r in records)
                progress.message(f"{entry.name} · {task.spec.name}: {summary}")
            except Exception as error:  # noqa: BLE001
                if not isinstance(error, UserError):
                    LOG.exception("task %s on %s failed", task.spec.name, entry.name)
                results.failures.append({"model": entry.name, "task": task.spec.name, "error": _describe(error)})
                progress.message(f"{entry.name} · {task.spec.name}: FAILED: {_describe(error)}")
            done += 1
            progress.update(done, {})
    progress.close()
    results.samples = ctx.samples
    return results
