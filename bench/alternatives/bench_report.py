"""Tables, curves and samples of bench/alternatives/opd_vs_alternatives.py from the eval harness's records.

results.md: the table at equal budget (each arm's last checkpoint, the untrained student and the
teacher), every checkpoint, which arm first reaches a forward-KL target, and samples side by side;
results.json: the same numbers; one PNG per figure (KL vs seconds and vs generated tokens, the
task's scores - the behaviour score, pass@1 - and the repetition rate vs seconds). `docs=<task>`
also copies the PNGs to docs/figures/opd-benchmark[-<task>]/ and puts results.md between the
task's markers in docs/opd-benchmark.md.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

FIGURE_OF_SCORE = {"pass@1": "accuracy-seconds"}  # any other score is the task's behaviour score


def task_suffix(task: str) -> str:
    """What names a task's run directory, figures and docs markers apart: nothing for the first
    task (behaviour), `-<task>` for another."""
    return "" if task == "behaviour" else f"-{task}"
DOCS = Path(__file__).resolve().parents[2] / "docs"


def value(records: list[dict], model: str, metric: str) -> dict | None:
    for r in records:
        if r["model"] == model and r["metric"] == metric:
            return r
    return None


def cell(r: dict | None, digits: int = 3) -> str:
    if r is None:
        return "-"
    if r["ci_low"] == r["ci_high"]:
        return f"{r['value']:.{digits}f}"
    return f"{r['value']:.{digits}f} [{r['ci_low']:.{digits}f}, {r['ci_high']:.{digits}f}]"


def points(kept, records: list[dict]) -> list[dict]:
    """One row per evaluated checkpoint (and the initial student at 0 s for every arm)."""
    rows = []
    for arm in dict.fromkeys(c.arm for c in kept):
        rows.append({"arm": arm, "model": "initial", "step": 0, "seconds": 0.0, "tokens": 0.0})
        rows += [{"arm": arm, "model": f"{c.arm}@{c.step}", "step": c.step, "seconds": c.seconds, "tokens": c.tokens}
                 for c in kept if c.arm == arm]
    for row in rows:
        for metric in ("reverse_kl", "forward_kl", "length", "distinct_2", "repetition_4"):
            row[metric] = value(records, row["model"], metric)
    return rows


def metric_columns(scores: list[str]) -> list[tuple[str, str]]:
    return [("reverse_kl", "reverse KL"), ("forward_kl", "forward KL"), *((s, s) for s in scores),
            ("length", "length"), ("distinct_2", "distinct-2"), ("repetition_4", "repetition-4")]


def table(models: list[tuple[str, str, str]], records: list[dict], scores: list[str]) -> list[str]:
    """Rows (label, model name, extra) × metric columns."""
    cols = metric_columns(scores)
    lines = ["| model | " + " | ".join(c[1] for c in cols) + " | seconds · steps · tokens |",
             "|" + "---|" * (len(cols) + 2)]
    for label, model, extra in models:
        lines.append(f"| {label} | " + " | ".join(cell(value(records, model, m), 1 if m == "length" else 3)
                                                   for m, _ in cols) + f" | {extra} |")
    return lines


def first_reaching(rows: list[dict], target: float) -> list[str]:
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        hit = [r for r in rows if r["arm"] == arm and r["forward_kl"] and r["forward_kl"]["value"] <= target]
        out.append(f"- {arm}: " + (f"{hit[0]['seconds']:.0f} s ({hit[0]['model']})" if hit else "not reached"))
    return out


def plot(path: Path, rows: list[dict], x: str, metric: str, xlabel: str, ylabel: str) -> Path:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm and r[metric]]
        xs, ys = [r[x] for r in mine], [r[metric]["value"] for r in mine]
        err = [[y - r[metric]["ci_low"] for y, r in zip(ys, mine)], [r[metric]["ci_high"] - y for y, r in zip(ys, mine)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=arm)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sample_lines(samples: list[dict], models: list[tuple[str, str]], count: int = 2) -> list[str]:
    style = [s for s in samples if s["task"] == "style"]
    ids = list(dict.fromkeys(s["id"] for s in style))[:count]
    lines = []
    for uid in ids:
        mine = [s for s in style if s["id"] == uid]
        if not mine:
            continue
        lines += ["", f"Prompt `{uid}`: {mine[0]['prompt']}", ""]
        for label, model in models:
            text = next((s["completion"] for s in mine if s["model"] == model), None)
            if text is not None:
                lines.append(f"- **{label}**: {json.dumps(text)}")
    return lines


def write_results(out: Path, kept, records: list[dict], samples: list[dict], notes: list[str], budget,
                  scores: list[str], clock: str = "wall", docs: str | None = None) -> None:
    rows = points(kept, records)
    for row in rows:
        row.update({score: value(records, row["model"], score) for score in scores})
    arms = list(dict.fromkeys(c.arm for c in kept))
    last = {arm: [c for c in kept if c.arm == arm][-1] for arm in arms}
    teacher = next((r["model"] for r in records if r["role"] == "teacher"), None)
    headline = [("untrained student", "initial", "0")] + [
        (arm, f"{c.arm}@{c.step}", f"{c.seconds:.0f} · {c.step} · {c.tokens:.0f}") for arm, c in last.items()]
    if teacher:
        headline.append((f"teacher ({teacher})", teacher, "-"))
    every = [(f"{c.arm} @ {c.seconds:.0f} s", f"{c.arm}@{c.step}", f"{c.seconds:.0f} · {c.step} · {c.tokens:.0f}")
             for c in kept]
    figures = {"fkl-seconds": ("seconds", "forward_kl", "training seconds", "held-out forward KL (nats/token)"),
               "rkl-seconds": ("seconds", "reverse_kl", "training seconds", "held-out reverse KL (nats/token)"),
               "fkl-tokens": ("tokens", "forward_kl", "generated tokens trained on", "held-out forward KL (nats/token)"),
               **{FIGURE_OF_SCORE.get(s, "behaviour-seconds"): ("seconds", s, "training seconds", f"{s} rate")
                  for s in scores},
               "repetition-seconds": ("seconds", "repetition_4", "training seconds", "repetition-4")}
    pngs = [plot(out / f"{name}.png", rows, *spec) for name, spec in figures.items()]
    initial_f = value(records, "initial", "forward_kl")
    target = 0.7 * initial_f["value"] if initial_f else float("nan")
    unit = "wall-clock" if clock == "wall" else "CPU (this process, all threads)"
    md = [f"Budget {budget.seconds:.0f} {unit} seconds of training per arm, checkpoints at "
          f"{', '.join(f'{m:.0%}' for m in budget.marks)} of it; intervals: 95% (bootstrap over held-out "
          "sequences for KL, length, distinct-2, repetition; Wilson over prompts for rates: the behaviour score, "
          "pass@1).", "",
          "At equal budget (each arm's last checkpoint):", "", *table(headline, records, scores), "",
          f"First checkpoint at or below forward KL {target:.3f} (−30% of the untrained student's):", "",
          *first_reaching(rows, target), "", "Every checkpoint:", "", *table(every, records, scores), ""]
    md += [f"![{p.stem}](FIGDIR/{p.name})" for p in pngs] + [""]
    md += ["Samples (held-out prompts, temperature 1):"]
    md += sample_lines(samples, [("untrained student", "initial")] + [(a, h[1]) for a, h in zip(arms, headline[1:])]
                       + ([("teacher", teacher)] if teacher else []))
    md += [""] + [f"Note: {n}" for n in notes]
    text = "\n".join(md) + "\n"
    (out / "results.md").write_text(text.replace("FIGDIR", "."))
    (out / "results.json").write_text(json.dumps({"checkpoints": [{**asdict(c), "path": str(c.path)} for c in kept],
                                                  "records": records, "notes": notes}, indent=1))
    if docs:
        to_docs(text, pngs, docs)


def to_docs(text: str, pngs: list[Path], task: str) -> None:
    """The PNGs into docs/figures/opd-benchmark[-<task>]/, the text between the task's markers
    (`<!-- bench:start -->` for the behaviour task, `<!-- bench:<task>:start -->` for another)."""
    suffix = task_suffix(task)
    tag = "bench" + suffix.replace("-", ":")
    start, end = f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"
    figdir = DOCS / "figures" / f"opd-benchmark{suffix}"
    figdir.mkdir(parents=True, exist_ok=True)
    for p in pngs:
        shutil.copy(p, figdir / p.name)
    doc = DOCS / "opd-benchmark.md"
    page = doc.read_text() if doc.exists() else "# OPD vs the alternatives\n"
    if start not in page:
        page += f"\n{start}\n{end}\n"
    head, rest = page.split(start, 1)
    doc.write_text(head + start + "\n" + text.replace("FIGDIR", f"figures/opd-benchmark{suffix}") + end
                   + rest.split(end, 1)[1])
