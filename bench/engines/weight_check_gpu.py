"""The weight-sync checksum (engine/transport/weight_check.py) on a GPU: equal to the CPU's, and its cost.

For each element width (bf16, float32, float64), a tensor with a partial last row is hashed on
the CPU and on the GPU (the two must agree to the bit: a learner on a GPU is compared with
samplers anywhere), then a 28M-element (the quickstart's embedding) and a 1.2G-element tensor are
timed on the GPU against a device-to-device copy of the same tensor.

    python bench/engines/weight_check_gpu.py [--no-record]

At the end the checksum and copy milliseconds of each tensor and width are appended to
bench/results/weight-check-cost.jsonl (`results.record`; the rows they replace marked "current":
false); `--no-record` leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from k3post.engine.transport.weight_check import checksum

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "The weight-sync check's cost per sync (`bench/engines/weight_check_cost.py`)"
TENSORS = {(49152, 576): "the 28M-element tensor", (151936, 8192): "a 1.2G-element [151936, 8192] tensor"}
WIDTHS = {torch.bfloat16: "bf16", torch.float32: "float32"}


def result_rows(timings: list[tuple[tuple, torch.dtype, float, float]]) -> list[dict]:
    """bench/results rows of (shape, dtype, checksum ms, copy ms): 2 decimals, as the table."""
    rows = []
    for shape, dtype, hash_ms, copy_ms in timings:
        what = f"{TENSORS[shape]}, {WIDTHS[dtype]}"
        rows += [{"metric": f"GPU hash of {what}", "value": rounded(hash_ms, 2), "unit": "ms"},
                 {"metric": f"GPU copy of {what}", "value": rounded(copy_ms, 2), "unit": "ms"}]
    return rows


def _best(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_no_record(parser)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        t = torch.randn(3001, 701, generator=g).to(dtype)
        same = checksum(t) == checksum(t.cuda())
        print(f"{dtype}: CPU == GPU: {same}")
        assert same
    print("| tensor | dtype | checksum ms | copy ms |")
    print("|---|---|---|---|")
    timings = []
    for shape in TENSORS:
        for dtype in WIDTHS:
            t = torch.randn(shape, device="cuda", dtype=dtype)
            timings.append((shape, dtype, _best(lambda: checksum(t)) * 1e3, _best(lambda: t.clone()) * 1e3))
            print(f"| {shape} | {dtype} | {timings[-1][2]:.2f} | {timings[-1][3]:.2f} |")
            del t
    record_and_say("weight-check-cost", [{**r, "notes": "best of 5 after one untimed call"} for r in result_rows(timings)],
                   args.no_record, source_section=SECTION)


if __name__ == "__main__":
    main()
