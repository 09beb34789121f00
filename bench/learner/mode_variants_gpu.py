"""Cheaper layouts of the bitwise mode, tried on a GPU before any becomes the mode's: each one's
largest |log π − log μ| (it must stay exactly 0) and its sampling and learner times against the
mode as it is (docs/on-policy.md).

    python3 bench/learner/mode_variants_gpu.py recipes/quickstart.yaml --device cuda \\
        student.dtype=bfloat16 data.prompts_per_step=32 sampling.max_new_tokens=256 optim.micro_batch_size=32

The mode (k3post/model/batch_invariant.py) calls every Linear, norm and MLP of the student on
fresh 256-row blocks, so that each call has one shape and the GPU's libraries one kernel; counted
on a CPU, that is ×5.4 the operator calls of a learner pass in bf16 (bench/learner/mode_op_count.py).
Each variant below is a patch of the mode, applied to the sampler and the learner alike:

    blocks            the mode as it is (the reference)
    mlp-whole         the MLP is not run block by block: its Linears still are, and its activation
                      and product run on all rows at once (a GPU's elementwise kernels compute
                      every element alike, wherever it sits)
    linear-one-call   every Linear is one call on all its rows, cuBLAS with split-K off (vLLM's
                      claim for Hopper and Blackwell; bench/learner/invariance_probe_gpu.py
                      probes it GEMM by GEMM)
    norm-vllm-kernel  every RMSNorm is vLLM's batch-invariant Triton kernel (one program per row),
                      where vLLM is installed
    all               the three together

Each variant runs in a fresh process: cuBLAS reads its environment when its first handle is made.
What one run tells: a variant whose largest gap is not 0 breaks the invariant (on this GPU and
these shapes) and is out; among the others, the learner and sampling times against `blocks`.
`--qat`: under FP8 QAT with FP8 rollouts on its grid, as bench/learner/on_policy_cost.py --qat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.learner.invariance_probe_gpu import vllm_batch_invariant  # noqa: E402
from bench.learner.on_policy_cost import measure  # noqa: E402
from bench.opd.opd_gpu_rows import ON_POLICY_SECTION  # noqa: E402
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

from k3post.config.load import load_run_recipe  # noqa: E402

VARIANTS = ("blocks", "mlp-whole", "linear-one-call", "norm-vllm-kernel", "all")
NO_SPLIT_K = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def apply(variant: str, device: str) -> str | None:
    """Patch the mode in this process; why the variant cannot run here, if it cannot."""
    import k3post.model.batch_invariant as mode  # noqa: PLC0415

    parts = {"mlp-whole", "linear-one-call", "norm-vllm-kernel"} if variant == "all" else {variant}
    override = mode._override
    rms_norm = vllm_batch_invariant("rms_norm_batch_invariant") if "norm-vllm-kernel" in parts else None
    if "norm-vllm-kernel" in parts and (rms_norm is None or device != "cuda"):
        return "vLLM's Triton kernel needs vLLM and a GPU"
    if "linear-one-call" in parts:
        if device == "cuda":
            torch.backends.cuda.preferred_blas_library(backend="cublaslt")
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        mode.product_rows = lambda product, x: product(x)

    def patched(module, on_gpu):
        name = type(module).__name__
        if "mlp-whole" in parts and on_gpu and name.endswith("MLP"):
            return None
        if rms_norm is not None and name.endswith("RMSNorm"):
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
            norm = lambda x, w: rms_norm(x.contiguous(), w, eps)  # noqa: E731
            return lambda x: mode.exact_values(lambda x_, *_: module.__class__.forward(module, x_), norm, x,
                                               module.weight)
        return override(module, on_gpu)
    mode._override = patched
    return None


def run_one(args) -> dict:
    why = apply(args.one, args.device)
    if why is not None:
        return {"variant": args.one, "skipped": why}
    recipe = load_run_recipe(args.recipe, args.overrides)
    row = measure(recipe, "bitwise", args.repeats, torch.get_num_threads(), args.device, args.qat)
    return {"variant": args.one, **row}


def result_rows(found: list[dict], name: str) -> list[dict]:
    """bench/results rows: each measured variant's times against `blocks`, and its largest gap."""
    ran = {r["variant"]: r for r in found if "skipped" not in r}
    base = ran.get("blocks")
    rows = []
    for variant, r in ran.items():
        head = f"{name}, bitwise mode variant {variant}"
        rows.append({"metric": f"{head}: largest |log π − log μ|", "value": r["max_gap"], "unit": "nats"})
        if base is not None and variant != "blocks":
            for key, what in (("learner_s", "learner log π forward + backward"), ("sample_s", "sampling")):
                rows.append({"metric": f"{head}: {what} against blocks", "unit": "×",
                             "value": rounded(r[key] / base[key], 2), "ratio_to": f"blocks ({base[key]:.3f} s)"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as `k3post run` takes them")
    parser.add_argument("--device", default="cuda", help="cuda; cpu: a smoke run of this script")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--qat", action="store_true", help="FP8 QAT with FP8 rollouts on its grid")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--json", help="also write the rows measured here")
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # a child's variant
    add_no_record(parser)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return
    found = []
    for variant in args.variants:
        env = {**os.environ, **(NO_SPLIT_K if variant in ("linear-one-call", "all") else {})}
        command = [sys.executable, __file__, args.recipe, *args.overrides, "--one", variant, "--device", args.device,
                   "--repeats", str(args.repeats), *(["--qat"] if args.qat else [])]
        child = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = child.stdout.strip().splitlines()
        found.append(json.loads(lines[-1]) if child.returncode == 0 and lines
                     else {"variant": variant, "skipped": f"failed: {child.stderr.strip()[-500:]}"})
        print(json.dumps(found[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1), encoding="utf-8")
    recipe = load_run_recipe(args.recipe, args.overrides)
    name = (f"{Path(args.recipe).stem} ({recipe.data.prompts_per_step} prompts × {recipe.sampling.max_new_tokens} "
            f"tokens, {recipe.student.dtype}{', FP8 QAT, FP8 rollouts' if args.qat else ''})")
    record_and_say("on-policy-cost", result_rows(found, name), args.no_record or args.device != "cuda",
                   source_section=ON_POLICY_SECTION)


if __name__ == "__main__":
    main()
