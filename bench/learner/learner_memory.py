"""Learner memory and step time: where the reference model lives, LoRA, and FP8 QAT.

Each variant runs in its own subprocess (so peak memory is its own), on the same model, batch
and seed; the parent prints one table with ratios to the no-reference baseline.

    (a) none         no reference model
    (b) copy         a second, frozen copy of the model as the reference
    (c) grad_buffer  the reference held on the host and swapped through the .grad buffers
    (d) lora         LoRA rank 16; the reference is the base model with adapters disabled
    (e) qat          FP8 fake-quantized Linears (torchao QAT), no reference

    .venv/bin/python bench/learner/learner_memory.py                          # CPU: SmolLM2-135M, fp32
    python bench/learner/learner_memory.py --device cuda --model big --dtype bfloat16   # GPU: 0.5B from a config

CPU peak is the process's max RSS (host = device there, so the host copy of the trick counts);
GPU peak is torch.cuda.max_memory_allocated (the trick's host copy is not device memory).

At the end the reference variants' peaks and step times (absolute for none, ratios for the others;
what the grad-buffer reference saves against the copy, in model copies) are appended to
bench/results/reference-cost.jsonl, and the QAT variant's peak against none to
bench/results/fp8-qat.jsonl (`results.record`; the rows they replace marked "current": false);
`--no-record` leaves the files alone (a trial run).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "Learner memory and step time: reference placement, LoRA, FP8 QAT (`bench/learner/learner_memory.py`)"

VARIANTS = ("none", "copy", "grad_buffer", "lora", "qat")
MODELS = {
    "smollm2": {"builtin": "smollm2-135m-instruct"},
    # ~0.5B parameters built from a config (random init; the tiny char tokenizer keeps the
    # embedding small, so the count is almost all transformer blocks).
    "big": {"tiny": {"hidden_size": 1024, "intermediate_size": 4096, "num_layers": 30, "num_heads": 16,
                     "num_kv_heads": 16, "seed": 0}},
    "small": {"tiny": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2}},
}


def batch(vocab: int, rows: int, prompt_len: int, completion_len: int, seed: int = 0):
    import torch  # noqa: PLC0415

    from k3post.types import TrainBatch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab, (prompt_len,), generator=g).tolist() for _ in range(rows)]
    completion = torch.randint(4, vocab, (rows, completion_len), generator=g)
    mask = torch.ones(rows, completion_len)
    return TrainBatch(prompts, completion, mask, -torch.rand(rows, completion_len, generator=g) * 3,
                      torch.randn(rows, completion_len, generator=g) * mask)


def run_variant(args) -> dict:
    import torch  # noqa: PLC0415

    from k3post.config.schema import LoraSpec, ModelSpec, OptimSpec, QatSpec, ReferenceSpec  # noqa: PLC0415
    from k3post.engine.learner.learner import Learner, LearnerConfig  # noqa: PLC0415

    v = args.variant
    reference = ReferenceSpec(kind={"copy": "copy", "grad_buffer": "grad_buffer"}.get(v, "none"),
                              kl_coef=0.1 if v in ("copy", "grad_buffer", "lora") else 0.0)
    spec = ModelSpec(**MODELS[args.model], dtype=args.dtype)
    config = LearnerConfig(student=spec, optim=OptimSpec(lr=1e-5, micro_batch_size=args.micro), reference=reference,
                           total_steps=100, device=args.device, lora=LoraSpec(rank=16 if v == "lora" else 0),
                           qat=QatSpec(enabled=v == "qat"), compile=args.compile)
    learner = Learner(config)
    params = sum(p.numel() for p in learner.model.parameters())
    b = batch(len(learner.tokenizer), args.rows, args.prompt_len, args.completion_len)
    cuda = args.device.startswith("cuda")
    times = []
    for step in range(args.steps + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        learner.train_step(b)
        if cuda:
            torch.cuda.synchronize()
        if step:  # step 0 is warm-up (allocations, kernel selection)
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"variant": v, "params": params, "peak_gib": peak / 2**30, "step_s": sorted(times)[len(times) // 2]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the decoder (GPU)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    add_no_record(parser)
    args = parser.parse_args()
    if args.variant:
        from k3post.engine.common import quiet_libraries  # noqa: PLC0415

        quiet_libraries()
        print(json.dumps(run_variant(args)))
        return 0
    rows = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", variant] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("variant", "variants", "compile", "no_record")] + (["--compile"] if args.compile else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{variant}: failed\n{out.stderr[-2000:]}")
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = next((r for r in rows if r["variant"] == "none"), rows[0])
    print(f"\nlearner step, model={args.model} ({base['params'] / 1e6:.0f}M params) dtype={args.dtype} "
          f"device={args.device} ({platform.machine()}), {args.rows}x({args.prompt_len}+{args.completion_len}) tokens, "
          f"micro-batch {args.micro}, median of {args.steps} steps{', compiled' if args.compile else ''}")
    print("| variant | peak GiB | × (a) | step s | × (a) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['peak_gib']:.2f} | {r['peak_gib'] / base['peak_gib']:.3f} | {r['step_s']:.3f} | "
              f"{r['step_s'] / base['step_s']:.2f} |")
    model_gib = base["params"] * (2 if args.dtype == "bfloat16" else 4) / 2**30
    print(f"one model copy = {model_gib:.2f} GiB")
    where = "one " + gpu_name() if args.device.startswith("cuda") else "the CPU"
    head = run_name(args, base["params"])
    notes = f"each variant in its own process; median of {args.steps} steps after a warm-up step"
    for subject, out in result_rows(rows, head, where, model_gib, args.dtype).items():
        record_and_say(subject, [{**r, "notes": r.get("notes") or notes} for r in out], args.no_record,
                       source_section=SECTION)
    return 0


def gpu_name() -> str:
    import torch  # noqa: PLC0415

    return torch.cuda.get_device_name().removeprefix("NVIDIA ")


def run_name(args, params: int) -> str:
    """The model, batch and mode as the recorded metrics name them, e.g. "503M Llama, 8 × (64 + 448)
    tokens, eager" or "SmolLM2-135M fp32, 8 × (48 + 48) tokens (peak = max RSS)"."""
    millions = f"{params / 1e6:.0f}M" if params >= 1e7 else f"{params / 1e6:.2f}M"
    model = "SmolLM2-135M" if args.model == "smollm2" else f"{millions} Llama"
    model += " fp32" if args.dtype == "float32" else ""
    tokens = f"{args.rows} × ({args.prompt_len} + {args.completion_len}) tokens"
    mode = (", compiled" if args.compile else ", eager") if args.device.startswith("cuda") else " (peak = max RSS)"
    return f"{model}, {tokens}{mode}"


def result_rows(rows: list[dict], head: str, where: str, model_gib: float,
                dtype: str = "bfloat16") -> dict[str, list[dict]]:
    """bench/results rows by subject. reference-cost: no reference's peak GiB (2 decimals) and step
    seconds (3), each other reference variant's peak (3 decimals) and step (2) against it, and the
    grad-buffer reference's saving against the copy in model copies; fp8-qat: the QAT variant's
    peak against the bf16 learner without it."""
    by = {r["variant"]: r for r in rows}
    base = by.get("none")
    if base is None:
        return {}
    ref, names = f"one-process learner, {head}", {"copy": "copy reference", "grad_buffer": "grad_buffer reference",
                                                   "lora": "LoRA rank 16 reference (adapters off)"}
    out = [{"metric": f"{ref}: no reference, peak memory", "value": rounded(base["peak_gib"], 2), "unit": "GiB"},
           {"metric": f"{ref}: no reference, step time", "value": rounded(base["step_s"], 3), "unit": "s"}]
    for variant, name in names.items():
        if variant in by:
            r = by[variant]
            out += [{"metric": f"{ref}: {name}, peak memory against no reference", "unit": "×",
                     "value": rounded(r["peak_gib"] / base["peak_gib"], 3), "ratio_to": "no reference"},
                    {"metric": f"{ref}: {name}, step time against no reference", "unit": "×",
                     "value": rounded(r["step_s"] / base["step_s"], 2), "ratio_to": "no reference"}]
    if {"copy", "grad_buffer"} <= set(by):
        saved = by["copy"]["peak_gib"] - by["grad_buffer"]["peak_gib"]
        out.append({"metric": f"{ref}: grad_buffer reference, memory below the copy reference, in model copies",
                    "value": rounded(saved / model_gib, 2), "unit": "model copies",
                    "notes": f"{saved:.2f} GiB; one model copy = {model_gib:.2f} GiB"})
    subjects = {"reference-cost": out}
    if "qat" in by:
        plain = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
        subjects["fp8-qat"] = [{"metric": f"QAT learner on {where}, {head}: peak memory against {plain}", "unit": "×",
                                "value": rounded(by["qat"]["peak_gib"] / base["peak_gib"], 3),
                                "ratio_to": f"the {plain} learner (no QAT)"}]
    return subjects


if __name__ == "__main__":
    sys.exit(main())
