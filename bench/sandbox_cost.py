"""Cost of one sandboxed call: `run_python` on a trivial program and `rewards.code:tests_pass` on
a typical solution with 5 assert tests, N calls each, one after the other (what one reward thread
pays per sample).

    .venv/bin/python bench/sandbox_cost.py --calls 40

Prints a table: median, mean and p90 milliseconds per call, and which isolation layers were in
force (so a "fast" number from a host where the jail silently degraded is visible as such).
Run it as root for the full jail.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3post.rewards.sandbox import run_python  # noqa: E402
from rewards import code as code_reward  # noqa: E402

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


def _time(fn, calls: int) -> list[float]:
    fn()  # warm-up: page cache, lazily created cgroup parents
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()

    def trivial():
        result = run_python(TRIVIAL)
        assert result.ok and result.stdout == "ok\n", result

    def five_tests():
        out = code_reward.tests_pass("", SOLUTION, TESTS)
        assert out["reward"] == 1.0, out

    isolation = run_python(TRIVIAL).isolation
    print(f"isolation: {', '.join(k for k, v in isolation.items() if v) or 'none'}"
          f" (missing: {', '.join(k for k, v in isolation.items() if not v) or 'none'})")
    print(f"| case | calls | median ms | mean ms | p90 ms |")
    print("|---|---|---|---|---|")
    for name, fn in (("run_python, trivial program", trivial), ("tests_pass, 5 tests", five_tests)):
        times = sorted(_time(fn, args.calls))
        p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
        print(f"| {name} | {args.calls} | {statistics.median(times):.1f} | {statistics.fmean(times):.1f} | {p90:.1f} |")


if __name__ == "__main__":
    main()
