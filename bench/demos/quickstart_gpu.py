"""The quickstart on one GPU with vLLM, end to end: `k3post run recipes/distill/quickstart-gpu-vllm.yaml`
timed, and what it reached recorded.

The recipe is the CPU quickstart's models (SmolLM2-135M-Instruct as both teachers, the 24-of-30-layer
student) with the learner, a vLLM sampler and two vLLM teachers sharing one GPU in sleep mode, for
far more steps and prompts per step than a CPU affords. This script runs it as a user would (the
`k3post run` command, in a subprocess), then reads the run's metrics back:

- the wall time of the command (engine builds and evaluations included) and the run's own time;
- the median step time after the first steps (the engines' first turns compile and capture), and
  of each phase (sample, score, train, sync);
- the held-out reverse and forward KL to each teacher at the first and the last evaluation;
- the sampler's and each teacher's sleep and wake seconds and the GPU memory each finds free, and
  the sampler's seconds inside the engine at the last sync (sampler/reload_s).

    python3 bench/demos/quickstart_gpu.py [--steps N] [--limit-s S] [--no-record] [-- KEY=VALUE ...]

On the lent GPU machine, which has no Ray: tools/vllm_gpu/quickstart_run.sh (adds ray.in_process=true).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.demos.quickstart_demo import done_seconds, heldout_rows, read_metrics, timed  # noqa: E402
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

RECIPE = "recipes/distill/quickstart-gpu-vllm.yaml"
SECTION = "The quickstart on one GPU with vLLM (`bench/demos/quickstart_gpu.py`)"
SLEEP_KEYS = ("sleep_s", "wake_s", "free_gib_asleep", "free_gib_awake", "reload_s")


def step_rows(metrics: list[dict], skip: int = 5) -> list[dict]:
    """The median training step after the first `skip` (s), and the last step's sleep/wake figures."""
    steps = [m for m in metrics if "time/step_s" in m]
    rows = []
    for phase in ("step", "sample", "score", "train", "sync") if len(steps) > skip else ():
        what = "training step" if phase == "step" else f"{phase} phase"
        rows.append({"metric": f"{what}, median of steps {skip + 1}-{len(steps)}",
                     "value": rounded(statistics.median(m.get(f"time/{phase}_s", 0.0) for m in steps[skip:]), 3),
                     "unit": "s"})
    last = steps[-1] if steps else {}
    for key in sorted(last):
        role, _, name = key.partition("/")
        if role in ("sampler", "teacher") and name.split("/")[0] in SLEEP_KEYS:
            unit = "GiB" if "gib" in name else "s"
            rows.append({"metric": f"{key} (last step)", "value": rounded(last[key], 3), "unit": unit})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="train.steps (default: the recipe's)")
    parser.add_argument("--run-dir", default="runs/quickstart-gpu")
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--limit-s", type=float, help="stop the run after this many seconds and record what it reached "
                                                     "(a device call's time limit; the run directory resumes)")
    parser.add_argument("overrides", nargs="*", help="further KEY.PATH=VALUE overrides")
    add_no_record(parser)
    args = parser.parse_args()
    overrides = ([f"train.steps={args.steps}"] if args.steps else []) + args.overrides
    command = [sys.executable, "-m", "k3post.cli.main", "run", args.recipe, "--run-dir", args.run_dir, *overrides]
    wall, lines, returncode = timed(command, args.limit_s)
    cut = args.limit_s is not None and wall >= args.limit_s
    if returncode and not cut:
        print(f"the run failed (exit {returncode}); nothing recorded", file=sys.stderr)
        return returncode
    metrics = read_metrics(Path(args.run_dir))
    steps = [m for m in metrics if "time/step_s" in m]
    minutes, seconds = divmod(round(wall), 60)
    what = (f"`k3post run`, stopped at --limit-s {args.limit_s:g} after step {len(steps)}: wall time" if cut
            else "`k3post run`: wall time, engine builds and evaluations included")
    rows = [{"metric": what, "value": round(wall), "unit": "s",
             "notes": f"{minutes} min {seconds} s; {len(steps)} steps; {sum(m['time/step_s'] for m in steps):.0f} s "
                      f"of them, {sum(m.get('time/eval_s', 0.0) for m in metrics):.0f} s of evaluations"}]
    if (run_s := done_seconds(lines)) is not None:
        rows.append({"metric": "the run itself (k3post's \"done in\" line)", "value": run_s, "unit": "s"})
    rows += step_rows(metrics) + heldout_rows(metrics)
    print("\n| figure | value |\n|---|---|")
    for r in rows:
        print(f"| {r['metric']} | {r['value']} {r['unit']} |")
    record_and_say("quickstart-gpu", rows, args.no_record, source_section=SECTION,
                   command_="python3 bench/demos/quickstart_gpu.py " + " ".join(overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
