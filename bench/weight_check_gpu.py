"""The weight-sync checksum (engine/weight_check.py) on a GPU: equal to the CPU's, and its cost.

For each element width (bf16, float32, float64), a tensor with a partial last row is hashed on
the CPU and on the GPU (the two must agree to the bit: a learner on a GPU is compared with
samplers anywhere), then a 28M-element (the quickstart's embedding) and a 1.2G-element tensor are
timed on the GPU against a device-to-device copy of the same tensor.

    python bench/weight_check_gpu.py
"""

from __future__ import annotations

import time

import torch

from k3post.engine.weight_check import checksum


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
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        t = torch.randn(3001, 701, generator=g).to(dtype)
        same = checksum(t) == checksum(t.cuda())
        print(f"{dtype}: CPU == GPU: {same}")
        assert same
    print("| tensor | dtype | checksum ms | copy ms |")
    print("|---|---|---|---|")
    for shape in ((49152, 576), (151936, 8192)):
        for dtype in (torch.bfloat16, torch.float32):
            t = torch.randn(shape, device="cuda", dtype=dtype)
            print(f"| {shape} | {dtype} | {_best(lambda: checksum(t)) * 1e3:.2f} | "
                  f"{_best(lambda: t.clone()) * 1e3:.2f} |")
            del t


if __name__ == "__main__":
    main()
