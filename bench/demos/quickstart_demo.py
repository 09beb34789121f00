"""The quickstart end to end: `make demo` timed, its held-out KLs read back, and both recorded.

Runs `make demo` from the repository root (the install into .venv first, when the Makefile's stamp
is missing, then `k3post run recipes/quickstart.yaml --run-dir runs/quickstart`), prints its output
as it goes, and then a table: the wall time of the whole command, the run's own time (k3post's
"done in" line) and the held-out reverse and forward KL to each teacher at the first and the last
evaluation (runs/quickstart/metrics.jsonl).

    .venv/bin/python bench/demos/quickstart_demo.py [--no-record]
    python3 bench/demos/quickstart_demo.py          # from a fresh clone: the install is timed too

At the end the figures are appended to bench/results/quickstart.jsonl (`results.record`; the rows
they replace marked "current": false); the wall time is named "install included" when the install
ran, "venv already installed" otherwise. `--no-record` leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SECTION = "The quickstart, end to end (`make demo`)"
RUN_DIR = REPO / "runs" / "quickstart"
DONE = re.compile(r"k3post: done in (\d+)s")


def evaluations(metrics: list[dict]) -> list[dict]:
    """The metrics rows that carry held-out KLs (one per evaluation), in step order."""
    return sorted((m for m in metrics if any(k.startswith("eval/kl/") for k in m)), key=lambda m: m["step"])


def result_rows(wall_s: float, run_s: int | None, installed: bool, metrics: list[dict]) -> list[dict]:
    """bench/results rows: the wall time (whole seconds), the run's own time, and per teacher the
    held-out reverse and forward KL (3 decimals) at the first and the last evaluation."""
    minutes, seconds = divmod(round(wall_s), 60)
    how = "install included" if installed else "venv already installed"
    rows = [{"metric": f"`make demo`, {how}: wall time", "value": round(wall_s), "unit": "s",
             "notes": f"{minutes} min {seconds} s"}]
    if run_s is not None:
        rows.append({"metric": "`make demo`: the run itself (k3post's \"done in\" line)", "value": run_s, "unit": "s"})
    return rows + heldout_rows(metrics)


def heldout_rows(metrics: list[dict]) -> list[dict]:
    """Per teacher, the held-out reverse and forward KL (3 decimals) at the first and the last evaluation."""
    rows, evals = [], evaluations(metrics)
    teachers = sorted({k.removeprefix("eval/kl/") for m in evals for k in m if k.startswith("eval/kl/")})
    for teacher in teachers:
        for key, kind in (("kl", "reverse"), ("fkl", "forward")):
            for m in evals[:1] + evals[-1:] if len(evals) > 1 else evals:
                if f"eval/{key}/{teacher}" in m:
                    rows.append({"metric": f"held-out {kind} KL, {teacher} teacher, step {m['step']}",
                                 "value": rounded(m[f"eval/{key}/{teacher}"], 3), "unit": "nats/token"})
    return rows


def timed(command: list[str], limit_s: float | None = None) -> tuple[float, list[str], int]:
    """Run `command` from the repository root, echoing its output: (wall seconds, lines, exit code).
    `limit_s`: stop it (SIGTERM) after that many seconds, so that a caller with a time limit of its
    own still reads what the run wrote by then."""
    started, lines = time.perf_counter(), []
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        stop = threading.Timer(limit_s, proc.terminate) if limit_s else None
        if stop is not None:
            stop.start()
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        if stop is not None:
            stop.cancel()
    return time.perf_counter() - started, lines, proc.wait()


def done_seconds(lines: list[str]) -> int | None:
    """The run's own time, from k3post's last "done in" line."""
    done = [int(m.group(1)) for line in lines if (m := DONE.search(line))]
    return done[-1] if done else None


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_no_record(parser)
    args = parser.parse_args()
    installed = not list((REPO / ".venv").glob(".installed-*"))
    wall, lines, returncode = timed(["make", "demo"])
    if returncode:
        print(f"make demo failed (exit {returncode}); nothing recorded", file=sys.stderr)
        return returncode
    rows = result_rows(wall, done_seconds(lines), installed, read_metrics(RUN_DIR))
    print("\n| figure | value |\n|---|---|")
    for r in rows:
        print(f"| {r['metric']} | {r['value']} {r['unit']} |")
    record_and_say("quickstart", rows, args.no_record, source_section=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
