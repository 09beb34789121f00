"""Tables (and a figure) from the three runs of the Kimi demo (docs/kimi.md).

Reads `metrics.jsonl` of each run directory and prints, as markdown:
  1. held-out reverse KL (eval/kl/<teacher>) and forward KL at every evaluation, per run;
  2. the worst MoE layer's max/mean expert load (moe/load_max_over_mean/max) and lowest
     normalised load entropy at every train step, per MoE run.
With --png it also draws both as one two-panel figure (matplotlib). Each run's last held-out
reverse KL and (MoE runs) its last worst-layer max/mean load are appended to
bench/results/kimi-demo.jsonl (`results.record`; the command recorded is this report's, the runs
named by --run); `--no-record` leaves the file alone.

    python bench/demos/kimi_demo_report.py --run kimi-quantile=/tmp/kdemo/kimi-quantile \
        --run kimi-none=/tmp/kdemo/kimi-none --run dense=/tmp/kdemo/dense --png docs/figures/kimi-demo.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "Kimi Linear student vs dense, and MoE balance (`recipes/distill/kimi-demo*.yaml`)"


def read(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def series(rows: list[dict], prefix: str) -> dict[int, float]:
    """step -> the first metric starting with `prefix` (one teacher in the demo)."""
    out = {}
    for row in rows:
        keys = sorted(k for k in row if k.startswith(prefix))
        if keys:
            out[int(row["step"])] = float(row[keys[0]])
    return out


def table(runs: dict[str, list[dict]], prefix: str, title: str) -> str:
    columns = {name: series(rows, prefix) for name, rows in runs.items()}
    columns = {name: col for name, col in columns.items() if col}
    steps = sorted({s for col in columns.values() for s in col})
    lines = [f"| step | {' | '.join(f'{name} {title}' for name in columns)} |",
             "|---|" + "---|" * len(columns)]
    for step in steps:
        cells = [f"{columns[name][step]:.3f}" if step in columns[name] else "" for name in columns]
        lines.append(f"| {step} | {' | '.join(cells)} |")
    return "\n".join(lines)


def result_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """Per run: the held-out reverse KL at its last evaluation and the worst MoE layer's max/mean
    expert load at its last step (3 and 2 decimals, as docs/benchmarks.md's table)."""
    rows = []
    for name, metrics in runs.items():
        for prefix, what, digits, unit in (("eval/kl/", "held-out reverse KL", 3, "nats/token"),
                                           ("moe/load_max_over_mean/max", "worst MoE layer's max/mean expert load", 2,
                                            "×")):
            points = series(metrics, prefix)
            if points:
                step = max(points)
                rows.append({"metric": f"Kimi demo, run `{name}`: {what} at step {step}",
                             "value": rounded(points[step], digits), "unit": unit})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", action="append", required=True, help="name=run_dir")
    parser.add_argument("--png", default=None)
    add_no_record(parser)
    args = parser.parse_args()
    runs = {name: read(path) for name, path in (r.split("=", 1) for r in args.run)}
    print(table(runs, "eval/kl/", "reverse KL"), end="\n\n")
    print(table(runs, "eval/fkl/", "forward KL"), end="\n\n")
    print(table(runs, "moe/load_max_over_mean/max", "max/mean load"), end="\n\n")
    print(table(runs, "moe/load_entropy/min", "load entropy (min layer)"))
    if args.png:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
        for name, rows in runs.items():
            kl = series(rows, "eval/kl/")
            left.plot(list(kl), list(kl.values()), marker="o", label=name)
            load = series(rows, "moe/load_max_over_mean/max")
            if load:
                right.plot(list(load), list(load.values()), marker=".", label=name)
        left.set(xlabel="step", ylabel="held-out reverse KL (nats/token)", title="eval/kl")
        right.axhline(1.0, color="grey", lw=0.5)
        right.set(xlabel="step", ylabel="max / mean expert load (worst layer)", title="MoE balance")
        left.legend(), right.legend()
        fig.tight_layout()
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=90)
    record_and_say("kimi-demo", result_rows(runs), args.no_record, source_section=SECTION)


if __name__ == "__main__":
    main()
