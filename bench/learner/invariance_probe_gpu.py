"""Which GPU kernels are batch-invariant as they are: a row's bits at every row count, with and
without cuBLAS's split-K (the question behind the cost of `sampling.on_policy: bitwise`).

    python3 bench/learner/invariance_probe_gpu.py --json $OUT/invariance.json

The mode (k3post/model/batch_invariant.py) calls every Linear, norm and MLP on fresh blocks of
256 rows, so that every call has one shape and cuBLAS one kernel. It is safe whatever cuBLAS
picks, and it costs a Python-driven call per block (docs/on-policy.md: ×5.5 the learner's train
phase on an H100). vLLM's batch-invariant mode (vllm/model_executor/layers/batch_invariant.py)
relies on another claim for Hopper and Blackwell: a GEMM's only batch-dependent reduction order is
split-K, which cuBLAS does not use without workspace (CUBLAS_WORKSPACE_CONFIG=:16:8,
CUBLASLT_WORKSPACE_SIZE=1, cuBLASLt preferred, no reduced-precision reductions). If that holds,
one call on all the rows gives each row the bits of a one-block call, and the blocks can go.

This probe checks the claim on the machine it runs on, for the benchmark student's shapes (0.40B
Qwen2: hidden 896, key/value width 128, MLP 4,864, vocabulary 49,152) in bf16: for each row
count M, one `F.linear` on M rows against the same rows computed one 256-row block at a time
(the mode's reference), plus the row-wise reductions the mode's pieces use (an RMSNorm's mean of
squares, a log-softmax's logsumexp over the vocabulary). Each setting runs in a fresh process,
since cuBLAS reads its environment when its first handle is made. Also two cheaper ways to keep
the blocks (views of one padded buffer instead of a clone per block; one batched GEMM over every
block instead of a call per block), against the mode's fresh cloned blocks; and, where vLLM is
installed, its persistent Triton matmul (one call on M rows against its own 256-row blocks: the
GEMM that both sides could share if cuBLAS is not invariant). Prints and writes the
count of rows that differ; no bench/results row (a probe of the platform, not of k3post).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROWS = (1, 7, 32, 255, 256, 257, 1000, 4096, 10000)
LINEARS = {"q_proj": (896, 896), "k_proj": (896, 128), "gate_proj": (896, 4864), "down_proj": (4864, 896),
           "lm_head": (896, 49152)}
BLOCK = 256
NO_SPLIT_K = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def blockwise(fn, x):
    """fn on fresh 256-row blocks of x, the last one zero-padded: the mode's reference."""
    import torch  # noqa: PLC0415

    out = []
    for start in range(0, x.shape[0], BLOCK):
        block = x[start:start + BLOCK]
        pad = block.new_zeros(BLOCK - block.shape[0], *block.shape[1:])
        out.append(fn(torch.cat([block, pad]).clone())[:block.shape[0]])
    return torch.cat(out)


def differing_rows(fn, x) -> dict[int, int]:
    """For each row count M: how many of the first M rows differ between one call and the blocks."""
    import torch  # noqa: PLC0415

    want = blockwise(fn, x)
    return {m: int((fn(x[:m].clone()) != want[:m]).any(dim=-1).sum()) for m in ROWS}


def padded_blocks(x):
    """x's rows zero-padded to whole 256-row blocks, in one fresh buffer: [blocks, 256, K]."""
    import torch  # noqa: PLC0415

    return torch.cat([x, x.new_zeros(-x.shape[0] % BLOCK, x.shape[1])]).view(-1, BLOCK, x.shape[1])


def cheaper_blocks(x, w) -> dict[str, dict[int, int]]:
    """Two cheaper ways to call the mode's 256-row blocks, against its fresh cloned blocks, by row
    count: views of one padded buffer (no clone per block), and one batched GEMM over every block
    (one launch instead of one per block)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    def views(t):
        return torch.cat([F.linear(block, w) for block in padded_blocks(t)])[:t.shape[0]]

    def batched(t):
        blocks = padded_blocks(t)
        return torch.bmm(blocks, w.t().expand(blocks.shape[0], -1, -1)).reshape(-1, w.shape[0])[:t.shape[0]]

    return {"views of one padded buffer": differing_rows(views, x),
            "one batched GEMM over the blocks": differing_rows(batched, x)}


def vllm_batch_invariant(name: str):
    """A function of vLLM's batch-invariant module (`matmul_persistent`: a·b with one tile
    configuration whatever M; `rms_norm_batch_invariant`: one program per row), where vLLM is
    installed: in vllm/model_executor/layers/ up to 0.26, vllm/model_executor/determinism/ later.
    None without vLLM."""
    import importlib  # noqa: PLC0415

    for module in ("vllm.model_executor.layers.batch_invariant", "vllm.model_executor.determinism.batch_invariant"):
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


def probe(no_split_k: bool, device: str) -> dict:
    """One setting, in this process (its environment already set)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    if no_split_k and device == "cuda":
        torch.backends.cuda.preferred_blas_library(backend="cublaslt")
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    g = torch.Generator(device=device).manual_seed(0)
    found, cheaper = {}, {}
    for name, (k, n) in LINEARS.items():
        x = torch.randn(max(ROWS), k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * k ** -0.5
        found[f"linear {name} [{k} -> {n}]"] = differing_rows(lambda t, w=w: F.linear(t, w), x)
        if name != "lm_head":  # (the batched GEMM would expand the head's weight per block)
            cheaper[f"linear {name} [{k} -> {n}]"] = cheaper_blocks(x, w)
    vllm_mm = vllm_batch_invariant("matmul_persistent") if device == "cuda" else None
    if vllm_mm is not None:
        for name, (k, n) in LINEARS.items():
            x = torch.randn(max(ROWS), k, device=device, dtype=torch.bfloat16, generator=g)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * k ** -0.5
            found[f"vLLM's persistent Triton matmul {name} [{k} -> {n}]"] = differing_rows(
                lambda t, w=w: vllm_mm(t, w.t()), x)
    h = torch.randn(max(ROWS), 896, device=device, dtype=torch.bfloat16, generator=g)
    found["rmsnorm mean of squares [896]"] = differing_rows(lambda t: t.float().pow(2).mean(-1, keepdim=True), h)
    z = torch.randn(max(ROWS) // 4, 49152, device=device, dtype=torch.float32, generator=g)
    found["logsumexp [49152], fp32"] = differing_rows(lambda t: torch.logsumexp(t, dim=-1, keepdim=True), z)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "no_split_k": no_split_k,
            "env": {k: os.environ.get(k) for k in NO_SPLIT_K}, "differing_rows": found,
            "cheaper_blocks": cheaper}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    parser.add_argument("--one", choices=["default", "no-split-k"], help=argparse.SUPPRESS)  # a child's setting
    args = parser.parse_args()
    if args.one:
        print(json.dumps(probe(args.one == "no-split-k", args.device)))
        return
    results = []
    for setting in ("default", "no-split-k"):
        env = {**os.environ, **(NO_SPLIT_K if setting == "no-split-k" else {})}
        child = subprocess.run([sys.executable, __file__, "--one", setting, "--device", args.device], env=env, capture_output=True, text=True,
                               check=True)
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    for r in results:
        print(f"\n{r['device']}, torch {r['torch']}, split-K {'off' if r['no_split_k'] else 'as cuBLAS picks'}: "
              f"rows that differ from the 256-row blocks, by row count M")
        print("| piece | " + " | ".join(f"M={m}" for m in ROWS) + " |")
        print("|---|" + "---:|" * len(ROWS))
        for piece, counts in r["differing_rows"].items():
            print(f"| {piece} | " + " | ".join(str(counts[str(m)]) for m in ROWS)
                  + " |")
        print("\nthe same blocks called more cheaply: rows that differ from the fresh cloned blocks")
        for piece, ways in r["cheaper_blocks"].items():
            for way, counts in ways.items():
                print(f"| {piece}, {way} | " + " | ".join(str(counts[str(m)]) for m in ROWS) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
