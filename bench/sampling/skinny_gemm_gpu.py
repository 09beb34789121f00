"""The decode step's GEMMs alone: one cuBLAS GEMM against the same product split along K.

A decode step multiplies a few rows (1-32) by each weight matrix. The GPU's time for such a GEMM
should be the time to read the weight, but a GEMM is tiled over its *output*, and a [32 × 896]
output makes few tiles: the MLP's down projection (32 × 4,864 by 4,864 × 896) keeps a few dozen of
the H100's 132 multiprocessors busy, each reading a long strip of K, and took 16 µs against the 2.6
µs its 8.7 MB need at the HBM bandwidth (docs/benchmarks.md, "The sampler's decode step against
the roofline"). Splitting K into S slices makes S times the tiles:

    x W^T = Σ_s x[:, s-th slice] W[:, s-th slice]^T,

one batched GEMM over the S slices (strided views of x and W, nothing copied) and a sum of the S
partial products in fp32. This script times, per GEMM of the 0.40B Qwen2 student of
bench/opd/opd_step_gpu.py and per row count, the plain GEMM and the split one for several S, each
captured 200 times in one CUDA graph (the time per GEMM is the replay's over 200), beside the
weight's read time at the bandwidth the script measures with a device copy.

At the end the 32-row figures (cuBLAS, and the fastest split with its S) are appended to
bench/results/decode-step-gpu.jsonl; `--no-record` leaves the file alone.

    python bench/sampling/skinny_gemm_gpu.py [--rows 1,8,32] [--splits 2,4,8,16] [--json FILE] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say  # noqa: E402

# name: (in_features K, out_features N) of the student's GEMMs (hidden 896, MLP 4,864, 14/2 heads
# of 64, vocabulary 49,152); qkv and gate_up are the stacked groups of model/generation/fused_projections.py.
SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896),
          "head": (896, 49152)}
REPLAYS = 200


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x W^T as `splits` GEMMs over slices of K in one batched call, summed in fp32."""
    rows, k = x.shape
    chunk = k // splits
    xs = x.view(rows, splits, chunk).transpose(0, 1)            # [S, rows, chunk]
    ws = weight.view(weight.shape[0], splits, chunk).permute(1, 2, 0)  # [S, chunk, N]
    return torch.bmm(xs, ws).float().sum(0).to(x.dtype)


def graph_time_us(fn, *args) -> float:
    """GPU µs per call: `REPLAYS` calls captured in one CUDA graph, median of 5 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS):
            fn(*args)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / REPLAYS)
    return sorted(times)[2]


def bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (read + write bytes / s) of a 1 GiB buffer, GB/s."""
    source = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    torch.cuda.synchronize()
    return 2 * source.numel() * 2 * 10 / (start.elapsed_time(end) / 1000) / 1e9


def measure(rows_list, splits_list) -> list[dict]:
    rows_out = []
    gbs = bandwidth_gbs()
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        read_us = n * k * 2 / (gbs * 1e3)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            exact = (x.float() @ weight.float().T)
            plain_error = (F.linear(x, weight).float() - exact).abs().max().item()
            row = {"gemm": name, "K": k, "N": n, "rows": rows, "read_us": round(read_us, 2),
                   "cublas_us": round(graph_time_us(F.linear, x, weight), 2), "splits": {}}
            for s in (s for s in splits_list if k % s == 0 and k // s >= 64):
                error = (split_k_linear(x, weight, s).float() - exact).abs().max().item()
                row["splits"][s] = {"us": round(graph_time_us(split_k_linear, x, weight, s), 2),
                                    "error_vs_cublas": round(error / max(plain_error, 1e-12), 2)}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    print(f"copy bandwidth {gbs:.0f} GB/s")
    return rows_out


def result_rows(results: list[dict], gpu: str) -> list[dict]:
    """bench/results rows: per GEMM at 32 rows, cuBLAS's µs and the fastest split's, against the
    weight's read time."""
    rows = []
    for r in (r for r in results if r["rows"] == 32):
        shape = f"{r['gemm']} ({r['K']} × {r['N']}), 32 rows, L2-warm, {gpu}"
        best = min(r["splits"], key=lambda s: r["splits"][s]["us"])
        rows += [{"metric": f"GEMM alone, {shape}: cuBLAS", "value": r["cublas_us"], "unit": "µs",
                  "notes": f"weight read at the measured copy bandwidth: {r['read_us']} µs"},
                 {"metric": f"GEMM alone, {shape}: K split by hand, fastest S", "value": r["splits"][best]["us"],
                  "unit": "µs", "notes": f"S = {best}; one batched GEMM and an fp32 sum"}]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--splits", default="2,4,8,16")
    parser.add_argument("--json")
    parser.add_argument("--commit", default="auto")
    add_no_record(parser)
    args = parser.parse_args()
    results = measure([int(r) for r in args.rows.split(",")], [int(s) for s in args.splits.split(",")])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ").split(" ")[0]
    record_and_say("decode-step-gpu", result_rows(results, gpu), args.no_record, commit_=args.commit,
                   source_section="The sampler's decode step against the roofline "
                                  "(`bench/sampling/decode_step_gpu.py`)")


if __name__ == "__main__":
    main()
