"""Cost of one sandboxed call: `run_python` on a trivial program and `rewards.code:tests_pass` on
a typical solution with 5 assert tests, N calls each, one after the other (what one reward thread
pays per sample).

    .venv/bin/python bench/sandbox/sandbox_cost.py --calls 40 [--baseline GIT_REV]
    setpriv --reuid=65534 --regid=65534 --clear-groups PYTHON bench/sandbox/sandbox_cost.py ...   (non-root)

Prints a table: median, mean and p90 milliseconds per call, the jail mode ("root", "userns",
"none") and which isolation layers were in force (so a "fast" number from a host where the jail
silently degraded is visible as such). With --baseline, the sandbox of that commit (sandbox.py,
every _jail*.py, rewards/code.py taken from git into a temporary directory) is timed in the same
run, calls interleaved with the current one, so a noisy machine slows both alike; the ratio column
is current / baseline. Run it as root for the full jail, and as a non-root user (PYTHON: an
interpreter that user can execute) for the user-namespace jail.

At the end each case's median per call (and, with --baseline, its ratio to the baseline's) is
appended to bench/results/sandbox-cost.jsonl (`results.record`; the rows they replace marked
"current": false), named "<--label> [against <baseline>], as <user>: <case>"; `--no-record`
leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from k3post.rewards.sandbox import run_python  # noqa: E402
from rewards import code as code_reward  # noqa: E402

from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "Sandbox cost per call (`bench/sandbox/sandbox_cost.py`)"

TRIVIAL = "print('ok')\n"
SOLUTION = """```python
def sort_unique(xs):
    seen = set()
    out = []
    for x in sorted(xs):
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
```"""
TESTS = {"tests": [
    "assert sort_unique([3, 1, 2]) == [1, 2, 3]",
    "assert sort_unique([]) == []",
    "assert sort_unique([5, 5, 5]) == [5]",
    "assert sort_unique([-1, 2, -1, 0]) == [-1, 0, 2]",
    "assert sort_unique(list(range(100, 0, -1)))[:3] == [1, 2, 3]",
]}


def _load(name: str, path: Path, source: str):
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def baseline(rev: str, directory: Path):
    """(run_python, tests_pass) of the sandbox at git revision `rev`, or in the directory `rev`
    (an export, for a machine whose checkout lacks the history:
    `git archive REV k3post/rewards rewards/code.py | tar -x -C DIR`)."""
    exported = Path(rev) if Path(rev).is_dir() else None

    def show(path: str) -> str:
        if exported is not None:
            return (exported / path).read_text()
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True, text=True).stdout
    if exported is not None:
        listing = [str(path.relative_to(exported)) for path in sorted((exported / "k3post/rewards").glob("*.py"))]
    else:
        listing = subprocess.run(["git", "ls-tree", "--name-only", rev, "k3post/rewards/"], cwd=REPO, check=True,
                                 capture_output=True, text=True).stdout.split()
    for path in listing:
        if Path(path).name.startswith("_jail") and path.endswith(".py"):
            (directory / Path(path).name).write_text(show(path))
    sandbox = _load("k3post_baseline_sandbox", directory / "sandbox.py", show("k3post/rewards/sandbox.py"))
    code = _load("k3post_baseline_code", directory / "code.py",
                 show("rewards/code.py").replace("k3post.rewards.sandbox", "k3post_baseline_sandbox"))
    return sandbox.run_python, code.tests_pass


def cases(run, tests_pass):
    def trivial():
        result = run(TRIVIAL)
        assert result.ok and result.stdout == "ok\n", result

    def five_tests():
        out = tests_pass("", SOLUTION, TESTS)
        assert out["reward"] == 1.0, out
    return {"`run_python` of a trivial program": trivial, "`rewards.code:tests_pass` with 5 tests": five_tests}


def _stats(times: list[float]) -> tuple[float, float, float]:
    times = sorted(times)
    return statistics.median(times), statistics.fmean(times), times[min(len(times) - 1, int(0.9 * len(times)))]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--baseline", help="a git revision (or a directory exporting one) whose sandbox to time alongside")
    parser.add_argument("--label", default="current jail",
                        help="what is measured, the recorded metrics' first words (e.g. 'non-root jail')")
    add_no_record(parser)
    args = parser.parse_args()
    variants = {"current": cases(run_python, code_reward.tests_pass)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            variants["baseline"] = cases(*baseline(args.baseline, Path(tmp)))
        probe = run_python(TRIVIAL)
        isolation = probe.isolation
        print(f"jail: {probe.jail}; isolation: {', '.join(k for k, v in isolation.items() if v) or 'none'}"
              f" (missing: {', '.join(k for k, v in isolation.items() if not v) or 'none'})")
        print("| case | variant | calls | median ms | mean ms | p90 ms | median ratio |")
        print("|---|---|---|---|---|---|---|")
        medians = {}
        for case in variants["current"]:
            times = {variant: [] for variant in variants}
            for fns in variants.values():
                fns[case]()  # warm-up: page cache, cgroup parents, bytecode
            for _ in range(args.calls):
                for variant, fns in variants.items():
                    times[variant].append(_timed(fns[case]))
            reference = _stats(times["baseline"])[0] if "baseline" in times else None
            for variant in variants:
                median, mean, p90 = _stats(times[variant])
                ratio = f"{median / reference:.2f}" if reference else "—"
                print(f"| {case} | {variant} | {args.calls} | {median:.1f} | {mean:.1f} | {p90:.1f} | {ratio} |")
            medians[case] = (_stats(times["current"])[0], reference)
    missing = ", ".join(k for k, v in isolation.items() if not v) or "none"
    notes = (f"{args.calls} calls each" + (f", interleaved with the baseline {args.baseline}" if args.baseline else "")
             + f"; jail {probe.jail}, isolation layers missing: {missing}")
    rows = result_rows(medians, args.label, as_user(probe.jail), baseline_name(args.baseline))
    record_and_say("sandbox-cost", [{**r, "notes": notes} for r in rows], args.no_record, source_section=SECTION)


def as_user(jail: str) -> str:
    """Who ran the calls, as the metric names say it."""
    uid = os.geteuid()
    return "as root" if uid == 0 else f"as uid {uid}" + (" (user namespaces)" if jail == "userns" else "")


def baseline_name(rev: str | None) -> str | None:
    """The baseline's commit: the revision, or an export directory's trailing `-<commit>`."""
    return None if rev is None else (Path(rev).name.rsplit("-", 1)[-1] if Path(rev).is_dir() else rev)


def result_rows(medians: dict[str, tuple[float, float | None]], label: str, who: str, baseline: str | None) -> list[dict]:
    """bench/results rows: per case the current sandbox's median ms per call (1 decimal, as the
    table) and, with a baseline, the median's ratio to the baseline's (2 decimals)."""
    head = f"{label} against {baseline}, {who}" if baseline else f"{label}, {who}"
    rows = []
    for case, (median, reference) in medians.items():
        rows.append({"metric": f"{head}: {case}, median per call", "value": rounded(median, 1), "unit": "ms"})
        if reference:
            rows.append({"metric": f"{head}: {case}, median against the baseline", "value": rounded(median / reference, 2),
                         "unit": "×", "ratio_to": f"the sandbox at {baseline}"})
    return rows


if __name__ == "__main__":
    main()
