"""`k3post eval EVAL.yaml [KEY.PATH=VALUE ...] [--out DIR]`: evaluate students and teachers, write a report.

Runs in this process (no Ray). The exit status is 0 when everything was evaluated, 1 when the
report lists failures (a model that did not load, a task with a bad row, a bad recipe entry),
and 2 for a recipe that cannot be read at all.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from k3post.cli.references import check_eval_tasks
from k3post.config.errors import UserError, located
from k3post.config.eval_load import load_eval_recipe
from k3post.engine.evaluation.eval_model import build_eval_model, reference_examples
from k3post.loops.eval_harness import run_evaluation
from k3post.loops.eval_plan import ModelEntry, expand_models
from k3post.track.progress import Progress
from k3post.track.report import write_report


def default_out_dir(recipe: Path) -> Path:
    return Path("runs") / "eval" / recipe.stem


def _model_row(entry: ModelEntry) -> dict:
    return {"name": entry.name, "role": entry.role, "group": entry.group, "step": entry.step,
            "fp8_of": entry.fp8_of, "spec": entry.spec.model.model_dump(mode="json", exclude_none=True),
            "system_prompt": entry.spec.system_prompt}


def _quiet() -> None:
    """math-verify warns once that its signal timeouts are off in threads (the reward pool's own
    per-call timeout applies instead)."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def append_to_cards(entries: list[ModelEntry], records: list[dict], models: list[dict], label: str) -> list[Path]:
    """Append each student checkpoint's rows of the report's tables to its README.md model card
    (a directory without a card gets one started); written atomically. Returns the cards written."""
    from k3post.track.atomic import write_text_atomic  # noqa: PLC0415
    from k3post.track.model_card import CARD_FILE, append_section, render  # noqa: PLC0415
    from k3post.track.report import models_by_tasks, students_by_teachers  # noqa: PLC0415

    written = []
    for entry in entries:
        path = entry.spec.model.path
        if entry.role != "student" or not path or not Path(path).is_dir():
            continue
        mine = [r for r in records if r["model"] == entry.name]
        lines = models_by_tasks(mine, models) + [""] + students_by_teachers(mine, models)
        if not mine:
            continue
        card_path = Path(path) / CARD_FILE
        card = card_path.read_text(encoding="utf-8") if card_path.is_file() else render(
            {"library_name": "transformers", "tags": ["k3post"]}, f"# {entry.name}")
        write_text_atomic(card_path, append_section(card, f"Evaluation: k3post eval {label}", lines))
        written.append(card_path)
    return written


def report_records_by_step(records: list[dict]) -> dict[int, dict[str, float]]:
    """The report's numbers as metric records: per training step (a run's checkpoint; 0 for
    any other model), `<task>/<metric>/<model group>` → value."""
    by_step: dict[int, dict[str, float]] = {}
    for r in records:
        by_step.setdefault(int(r["step"] or 0), {})[f"{r['task']}/{r['metric']}/{r['group']}"] = r["value"]
    return dict(sorted(by_step.items()))


def log_to_sinks(recipe, out_dir: Path, records: list[dict]) -> None:
    """The recipe's `track:` sinks (beside report.json) get the report's numbers, step by step."""
    from k3post.track.metrics import MetricsLog  # noqa: PLC0415
    from k3post.track.sinks import open_sinks  # noqa: PLC0415

    config = recipe.model_dump(mode="json")
    with MetricsLog(out_dir, tensorboard=False, sinks=open_sinks(recipe.track, out_dir, None, config)) as log:
        for step, record in report_records_by_step(records).items():
            log.log(step, record)


def run_eval(recipe_path: Path, overrides: list[str], out_dir: Path | None, card: bool = False) -> int:
    _quiet()
    loaded = load_eval_recipe(recipe_path, overrides)
    recipe = loaded.recipe
    check_eval_tasks(recipe, recipe_path)  # built-in sets and verifiers exist, before any model loads
    out_dir = out_dir or default_out_dir(recipe_path)
    for path in (out_dir, *out_dir.parents):
        if path.exists() and not path.is_dir():
            where = "is a file" if path == out_dir else f"is inside {path}, which is a file"
            raise UserError(located(out_dir, f"the report directory (--out) {where}; expected a directory"))
    out_dir.mkdir(parents=True, exist_ok=True)
    entries, plan_problems = expand_models(recipe, out_dir)
    failures = [{"model": p["name"] if p["entry"].startswith("students") else None,
                 "task": p["name"] if p["entry"].startswith("tasks") else None, "error": p["error"]}
                for p in loaded.problems] + plan_problems
    for failure in failures:
        print(f"k3post eval: skipped: {failure['error']}", file=sys.stderr)

    def open_model(entry: ModelEntry):
        return build_eval_model(entry.name, entry.spec, recipe.engine, recipe.threads, entry.export_from,
                                recipe.vllm)

    print(f"k3post eval: {len(entries)} models × {len(recipe.tasks)} tasks → {out_dir}", flush=True)
    results = run_evaluation(recipe, entries, open_model, recipe_path.parent, reference_examples,
                             lambda total: Progress(total, description="eval"))
    failures += results.failures
    meta = {"seed": recipe.seed, "engine": recipe.engine, "confidence": recipe.confidence,
            "sampling": recipe.sampling.model_dump(), "tasks": [t.model_dump() for t in recipe.tasks]}
    write_report(out_dir, recipe_path.resolve(), meta, [_model_row(e) for e in entries], results.records,
                 failures, results.samples)
    log_to_sinks(recipe, out_dir, results.records)
    print((out_dir / "report.md").read_text())
    if card:
        for path in append_to_cards(entries, results.records, [_model_row(e) for e in entries], recipe_path.name):
            print(f"k3post eval: appended the evaluation to {path}")
    for failure in results.failures:
        print(f"k3post eval: failed: {failure.get('model') or '-'} / {failure.get('task') or '-'}: {failure['error']}",
              file=sys.stderr)
    print(f"k3post eval: wrote {out_dir / 'report.json'}, report.md, plots/ "
          f"({len(results.records)} numbers, {len(failures)} failures)")
    return 1 if failures else 0
