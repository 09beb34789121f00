"""OPD-step benchmark: per-phase time and student tokens/s for a recipe's models.

Runs the same recipe's steps in-process and on local Ray in one invocation, so the Ray
overhead is a ratio measured under the same machine load.

    .venv/bin/python bench/opd/opd_step.py                     # quickstart models, 1 warm-up + 4 steps
    .venv/bin/python bench/opd/opd_step.py recipes/smoke/tiny.yaml --steps 6

At the end each mode's phase times, tokens a step and tokens/s, and the ratios of the second mode
to the first, are appended to bench/results/opd-step-cpu.jsonl (`results.record`); `--no-record`
leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from k3post.config.load import load_distill_recipe
from k3post.engine.common import quiet_libraries

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

PHASES = ("sample", "score", "train", "sync", "step")
SECTION = "OPD step, quickstart models (`bench/opd/opd_step.py`)"


def measure(backend, recipe, steps: int) -> dict[str, float]:
    from k3post.launch.distill import build_distill_run  # noqa: PLC0415
    from k3post.loops.distill import distill_step  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        run = build_distill_run(recipe, Path(tmp), backend)
        run.weight_sync.push(0)
        setup_s = time.perf_counter() - started
        rows = [distill_step(run, step) for step in range(1, steps + 2)][1:]  # step 1 is warm-up
    out = {p: statistics.median(r[f"time/{p}_s"] for r in rows) for p in PHASES}
    out["tokens/s"] = statistics.median(r["throughput/tokens_per_s"] for r in rows)
    out["tokens/step"] = statistics.median(r["train/tokens"] for r in rows)
    out["setup"] = setup_s
    return out


def result_rows(recipe: str, results: dict[str, dict[str, float]]) -> list[dict]:
    """bench/results rows of a run, as the table prints them: per mode the set-up and phase
    seconds, tokens a step and tokens/s; then the second mode against the first."""
    rows = []
    for mode, r in results.items():
        head = f"{recipe}, {mode}"
        rows.append({"metric": f"{head}: set-up time", "value": rounded(r["setup"], 1), "unit": "s"})
        rows += [{"metric": f"{head}: {phase} time, median", "value": rounded(r[phase], 2), "unit": "s"}
                 for phase in PHASES]
        rows += [{"metric": f"{head}: tokens a step", "value": round(r["tokens/step"]), "unit": "tokens"},
                 {"metric": f"{head}: student tokens/s", "value": rounded(r["tokens/s"], 1), "unit": "tokens/s"}]
    if len(results) == 2:
        (first, a), (second, b) = results.items()
        rows += [{"metric": f"{recipe}, {second} against {first}: step time", "value": rounded(b["step"] / a["step"], 2),
                  "unit": "×", "ratio_to": first},
                 {"metric": f"{recipe}, {second} against {first}: tokens/s",
                  "value": rounded(b["tokens/s"] / a["tokens/s"], 2), "unit": "×", "ratio_to": first}]
    return rows


def main() -> int:
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default="recipes/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    parser.add_argument("--modes", default="in-process,ray")
    add_no_record(parser)
    args = parser.parse_args()
    recipe = load_distill_recipe(args.recipe)
    from k3post.launch.in_process import InProcessBackend  # noqa: PLC0415

    results = {}
    for mode in args.modes.split(","):
        if mode == "ray":
            from k3post.ray.backend import ray_backend  # noqa: PLC0415

            with ray_backend(recipe) as backend:
                results[mode] = measure(backend, recipe, args.steps)
        else:
            results[mode] = measure(InProcessBackend(), recipe, args.steps)

    print(f"\nOPD step, {args.recipe}: median of {args.steps} steps after 1 warm-up; "
          f"{platform.processor() or platform.machine()}, python {sys.version.split()[0]}")
    header = "| mode | setup s | sample s | score s | train s | sync s | step s | tokens/step | tokens/s |"
    print(header + "\n|" + "---|" * 9)
    for mode, r in results.items():
        print(f"| {mode} | {r['setup']:.1f} | {r['sample']:.2f} | {r['score']:.2f} | {r['train']:.2f} | "
              f"{r['sync']:.2f} | {r['step']:.2f} | {r['tokens/step']:.0f} | {r['tokens/s']:.1f} |")
    if len(results) == 2:
        a, b = results.values()
        print(f"\nratio {list(results)[1]} / {list(results)[0]}: step time {b['step'] / a['step']:.2f}x, "
              f"tokens/s {b['tokens/s'] / a['tokens/s']:.2f}x")
    record_and_say("opd-step-cpu", result_rows(args.recipe, results), args.no_record, source_section=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
