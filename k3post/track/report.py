"""The evaluation report: report.json (every number), report.md (tables), PNG plots.

report.json: {"recipe", "created", "seed", "engine", "confidence", "models": [...], "records": [...],
"failures": [...]}; a record is one number with its model, task, metric, n, seed and interval.

report.md tables:
- models × tasks: the headline metric of each task (pass@1, NLL, ...), "value [low, high]";
  further pass@k in their own columns;
- students × teachers: reverse KL(student‖teacher) / forward KL(teacher‖student), per KL task;
- FP8 serving: KL(full‖FP8), top-1 agreement, and the FP8 twin's change in each headline metric,
  paired over the prompts (replies) both were measured on, with its interval and direction;
- failures: what could not be evaluated, and why.

Plots (matplotlib, headless): one bar chart per task metric and per KL task (error bars = the
interval), and, when a run's checkpoints were evaluated, metric vs training step.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from k3post.track.atomic import write_text_atomic

HEADLINE = {"generation": "pass@1", "nll": "nll", "fp8_gap": "fp8_kl"}


def _num(x: float, digits: int = 3) -> str:
    """Fixed point, or two significant digits in scientific notation when fixed point would show 0."""
    return f"{x:.2e}" if x != 0 and abs(x) < 0.5 * 10 ** -digits else f"{x:.{digits}f}"


def _delta(x: float) -> str:
    return "0" if x == 0 else f"{x:+.4f}" if abs(x) >= 1e-3 else f"{x:+.2e}"


def _cell(r: dict | None, digits: int = 3) -> str:
    if r is None:
        return "—"
    return f"{_num(r['value'], digits)} [{_num(r['ci_low'], digits)}, {_num(r['ci_high'], digits)}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _model_names(records: list[dict], models: list[dict]) -> list[str]:
    names = [m["name"] for m in models]
    return names + sorted({r["model"] for r in records} - set(names))


def _find(records: list[dict], **match: Any) -> dict | None:
    for r in records:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _task_columns(records: list[dict]) -> list[tuple[str, str]]:
    """(task, metric) columns of the models × tasks table, in first-seen order."""
    columns: list[tuple[str, str]] = []
    for r in records:
        wanted = r["kind"] == "generation" and r["metric"].startswith("pass@") or r["metric"] == HEADLINE.get(r["kind"])
        if wanted and (r["task"], r["metric"]) not in columns:
            columns.append((r["task"], r["metric"]))
    return columns


def models_by_tasks(records: list[dict], models: list[dict]) -> list[str]:
    columns = [c for c in _task_columns(records) if c[1] != "fp8_kl"]
    if not columns:
        return []
    rows = []
    for name in _model_names(records, models):
        if any(r["model"] == name for r in records if (r["task"], r["metric"]) in columns):
            rows.append([name] + [_cell(_find(records, model=name, task=t, metric=m)) for t, m in columns])
    return _table(["model"] + [t if t == m else f"{t} {m}" for t, m in columns], rows)


def students_by_teachers(records: list[dict], models: list[dict]) -> list[str]:
    out = []
    for task in dict.fromkeys(r["task"] for r in records if r["kind"] == "kl"):
        kl = [r for r in records if r["task"] == task]
        teachers = list(dict.fromkeys(r["teacher"] for r in kl))
        for suffix, unit in (("", "nats per token"), ("_per_byte", "nats per byte of text, each side its own tokens")):
            if not any(r["metric"] == f"reverse_kl{suffix}" for r in kl):
                continue  # per token: only for teachers with the students' tokenizer
            rows = []
            for name in _model_names(kl, models):
                if any(r["model"] == name for r in kl):
                    rows.append([name] + [f"{_cell(_find(kl, model=name, teacher=t, metric=f'reverse_kl{suffix}'))} / "
                                          f"{_cell(_find(kl, model=name, teacher=t, metric=f'forward_kl{suffix}'))}"
                                          for t in teachers])
            out += [f"**{task}** — reverse KL(student‖teacher) on the student's samples / forward "
                    f"KL(teacher‖student) on the teacher's samples, {unit}"]
            out += [""] + _table(["student"] + teachers, rows) + [""]
    return out[:-1]


def fp8_table(records: list[dict]) -> list[str]:
    twins = list(dict.fromkeys(r["model"] for r in records if r.get("fp8_of")))
    if not twins:
        return []
    deltas = [(t, m) for t, m in _task_columns(records) if m != "fp8_kl"]
    rows = []
    for twin in twins:
        full = next(r["fp8_of"] for r in records if r["model"] == twin)
        row = [twin, full, _cell(_find(records, model=twin, metric="fp8_kl"), 4),
               _cell(_find(records, model=twin, metric="top1_agreement"))]
        for task, metric in deltas:
            a, b = _find(records, model=full, task=task, metric=metric), _find(records, model=twin, task=task,
                                                                                  metric=metric)
            row.append("—" if a is None or b is None else delta_cell(a, b))
        rows.append(row)
    return _table(["FP8 model", "full precision", "KL(full‖FP8)", "top-1 agreement"]
                  + [f"Δ {t if t == m else f'{t} {m}'}" for t, m in deltas], rows) + ["", FP8_NOTE]


# Why an FP8 twin can score better than its source, and why two engines disagree on one export.
FP8_NOTE = ("Δ = FP8 − full precision on the same prompts (or replies), with a paired bootstrap interval: "
            "*within noise* when it contains 0. Generation metrics are estimated from samples, and the two "
            "models' samples part at the first token where FP8 rounding changes a draw, so their Δ carries "
            "sampling noise of the size of the interval; the same export on two engines (hf, vllm) draws "
            "different samples too. NLL and KL(full‖FP8) are exact sums over fixed tokens; across engines "
            "they agree only at the same compute dtype (vLLM's `dtype: auto` is 16-bit for a float32 model) "
            "and vLLM's FP8 kernels are not transformers' (docs/eval.md, Statistics). A model trained with "
            "FP8 QAT learned under the quantised forward, and its export can score better than its "
            "unquantised source.")
LOWER_IS_BETTER = ("nll", "perplexity", "kl", "length", "repetition")


def delta_cell(base: dict, twin: dict) -> str:
    """'+0.0125 [-0.0031, +0.0280] within noise': the twin's change, paired over the units both
    were measured on when the records carry them, with which way it points."""
    from k3post.algo.eval_metrics import bootstrap_paired_difference  # noqa: PLC0415 (torch: only for tables)

    if not base.get("units") or base.get("unit_ids") != twin.get("unit_ids"):
        return f"{_delta(twin['value'] - base['value'])} (unpaired)"
    ab, tb = zip(*base["units"])
    at, tt = zip(*twin["units"])
    d = bootstrap_paired_difference((ab, tb), (at, tt), base.get("confidence", 0.95), seed=base.get("seed", 0))
    lower_better = any(word in twin["metric"] for word in LOWER_IS_BETTER)
    if d.low <= 0 <= d.high:
        verdict = "within noise"
    else:
        verdict = "better" if (d.value < 0) == lower_better else "worse"
    return f"{_delta(d.value)} [{_delta(d.low)}, {_delta(d.high)}] {verdict}"


def write_markdown(report: dict, plots: list[Path], out_dir: Path) -> str:
    records, models = report["records"], report["models"]
    lines = [f"# Evaluation: {report['recipe']}", "",
             f"{report['created']} · engine {report['engine']} · seed {report['seed']} · "
             f"{report['confidence']:.0%} intervals (Wilson over prompts for pass@k, bootstrap over "
             "sequences for KL/NLL), shown as value [low, high]", ""]
    sections = [("Models × tasks", models_by_tasks(records, models)),
                ("Students × teachers (KL)", students_by_teachers(records, models)),
                ("FP8 serving", fp8_table(records))]
    for title, body in sections:
        if body:
            lines += [f"## {title}", ""] + body + [""]
    if report["failures"]:
        lines += ["## Failures", ""] + [f"- **{f.get('model') or '(all models)'}** / **{f.get('task') or '(all tasks)'}**"
                                        f": {f['error']}".replace("\n", " ") for f in report["failures"]] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.relative_to(out_dir).as_posix()})" for p in plots] + [""]
    return "\n".join(lines)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _bar_chart(path: Path, title: str, ylabel: str, labels: list[str], series: dict[str, list[dict | None]]) -> None:
    import matplotlib  # noqa: PLC0415 - optional and slow to import

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(labels) * max(1, len(series)) + 2), 3.8))
    width = 0.8 / max(1, len(series))
    for s, (name, rs) in enumerate(series.items()):
        xs = [i + (s - (len(series) - 1) / 2) * width for i in range(len(labels))]
        values = [r["value"] if r else math.nan for r in rs]
        errors = [[max(0.0, r["value"] - r["ci_low"]) if r else 0 for r in rs],
                  [max(0.0, r["ci_high"] - r["value"]) if r else 0 for r in rs]]
        ax.bar(xs, values, width, yerr=errors, capsize=3, label=name if len(series) > 1 else None)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _line_chart(path: Path, title: str, ylabel: str, series: dict[str, list[dict]]) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, rs in series.items():
        rs = sorted(rs, key=lambda r: r["step"])
        steps = [r["step"] for r in rs]
        ax.plot(steps, [r["value"] for r in rs], marker="o", label=name)
        ax.fill_between(steps, [r["ci_low"] for r in rs], [r["ci_high"] for r in rs], alpha=0.2)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(records: list[dict], models: list[dict], out_dir: Path) -> list[Path]:
    plots_dir = out_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["task"], r["metric"])].append(r)
    for (task, metric), rs in groups.items():
        if rs[0]["kind"] == "kl":
            continue  # drawn per teacher below
        labels = [n for n in _model_names(rs, models) if any(r["model"] == n for r in rs)]
        path = plots_dir / f"{_safe(task)}-{_safe(metric)}.png"
        _bar_chart(path, f"{task}: {metric}", metric, labels, {metric: [_find(rs, model=n) for n in labels]})
        written.append(path)
    for task in dict.fromkeys(r["task"] for r in records if r["kind"] == "kl"):
        for metric in ("reverse_kl", "forward_kl", "reverse_kl_per_byte", "forward_kl_per_byte"):
            rs = [r for r in records if r["task"] == task and r["metric"] == metric]
            if not rs:
                continue
            labels = [n for n in _model_names(rs, models) if any(r["model"] == n for r in rs)]
            teachers = list(dict.fromkeys(r["teacher"] for r in rs))
            path = plots_dir / f"{_safe(task)}-{metric}.png"
            unit = "nats/byte" if metric.endswith("_per_byte") else "nats/token"
            _bar_chart(path, f"{task}: {metric} ({unit})", metric, labels,
                       {t: [_find(rs, model=n, teacher=t) for n in labels] for t in teachers})
            written.append(path)
    written += _over_steps(records, plots_dir)
    return written


def _over_steps(records: list[dict], plots_dir: Path) -> list[Path]:
    """Metric vs training step for every group (a run) evaluated at two or more steps."""
    written = []
    stepped = [r for r in records if r.get("step") is not None and not r.get("fp8_of")]
    by_plot: dict[tuple[str, str], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in stepped:
        if r["kind"] == "kl" or r["metric"] in ("pass@1", "nll"):
            line = f"{r['group']}" + (f" vs {r['teacher']}" if r.get("teacher") else "")
            by_plot[(r["task"], r["metric"])][line].append(r)
    for (task, metric), series in by_plot.items():
        series = {k: v for k, v in series.items() if len({r["step"] for r in v}) >= 2}
        if series:
            path = plots_dir / f"steps-{_safe(task)}-{_safe(metric)}.png"
            _line_chart(path, f"{task}: {metric} over training", metric, series)
            written.append(path)
    return written


def write_report(out_dir: Path, recipe_path: Path, recipe_meta: dict, models: list[dict], records: list[dict],
                 failures: list[dict], samples: list[dict]) -> dict:
    """Write report.json, report.md, samples.jsonl and plots/ under out_dir; returns the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"recipe": str(recipe_path), "created": time.strftime("%Y-%m-%d %H:%M:%S"), **recipe_meta,
              "models": models, "records": records, "failures": failures}
    write_text_atomic(out_dir / "report.json", json.dumps(report, indent=2, default=str) + "\n")
    write_text_atomic(out_dir / "samples.jsonl", "".join(json.dumps(s, default=str) + "\n" for s in samples))
    plots = write_plots(records, models, out_dir) if records else []
    write_text_atomic(out_dir / "report.md", write_markdown(report, plots, out_dir))
    return report
