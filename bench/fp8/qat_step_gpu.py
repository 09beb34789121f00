"""FP8-QAT training step time against bf16, side by side in one process (target: ≤ 1.3×).

Two learners on the same ~0.5B Llama built from a config (bench/learner/learner_memory.py's "big"),
both with the decoder compiled: one plain bf16, one with every eligible Linear FP8
fake-quantized (torchao QAT + k3post's straight-through wrapper). The step is the learner's
`train_step` (the sampled-token OPD loss on random advantages): per token the same forward
and backward through every Linear as an SFT step, which is where fake quantization costs.
They take turns, one step each per round, the order flipping every round, so the shared
machine's drift lands on both alike; the table gives each one's median step and the median
of the per-round ratios.

    python bench/fp8/qat_step_gpu.py                                 # H200: two shapes, 12 rounds
    python bench/fp8/qat_step_gpu.py --profile                       # + the top kernels of one step each
    .venv/bin/python bench/fp8/qat_step_gpu.py --device cpu --model small --shapes 4x2x16x16 --rounds 2   # smoke

A shape is ROWSxMICROxPROMPTxCOMPLETION: rows per step, rows per micro-batch, prompt and
completion tokens per row.

At the end each shape's FP8-QAT step time and its ratio to the bf16 step are appended to
bench/results/fp8-qat.jsonl (`results.record`; the rows they replace marked "current": false);
`--no-record` leaves the file alone, and a CPU run never records.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*

from bench.learner.learner_memory import MODELS, batch  # noqa: E402
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "Learner memory and step time: reference placement, LoRA, FP8 QAT (`bench/learner/learner_memory.py`)"


def result_rows(rows: list[dict], where: str, variant: str | None = None) -> list[dict]:
    """bench/results rows per shape: the QAT step's median seconds (3 decimals) and the median of
    the per-round QAT / bf16 ratios (2 decimals). `variant` names a non-default run (`--profile`,
    combo kernels) in place of the micro-batch."""
    out = []
    for r in rows:
        n_rows, micro, prompt_len, completion_len = r["shape"].split("x")
        head = f"QAT step on {where}, {n_rows} × ({prompt_len} + {completion_len}) tokens, " + (
            variant or f"micro-batch {micro}, compiled")
        spread = f"{r['ratio_min']:.2f}–{r['ratio_max']:.2f} over {r['rounds']} rounds"
        out += [{"metric": f"{head}: against the bf16 step", "value": rounded(r["ratio"], 2), "unit": "×",
                 "ratio_to": f"bf16 step, same process ({r['bf16']:.3f} s)", "notes": spread},
                {"metric": f"{head}: step time", "value": rounded(r["fp8-qat"], 3), "unit": "s", "notes": spread}]
    return out


def make_learner(args, qat: bool):
    from k3post.config.schema import ModelSpec, OptimSpec, QatSpec  # noqa: PLC0415
    from k3post.engine.learner.learner import Learner, LearnerConfig  # noqa: PLC0415

    spec = ModelSpec(**MODELS[args.model], dtype=args.dtype)
    return Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-5, micro_batch_size=1), total_steps=10_000,
                                 device=args.device, qat=QatSpec(enabled=qat), compile=args.device != "cpu"))


def timed_step(learner, b, sync) -> float:
    sync()
    start = time.perf_counter()
    learner.train_step(b)
    sync()
    return time.perf_counter() - start


def top_kernels(learner, b, sync, n: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        learner.train_step(b)
        sync()
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=n, max_name_column_width=70)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="big", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default="8x4x64x448,16x8x64x960")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per learner and shape (compiles)")
    parser.add_argument("--profile", action="store_true", help="print each learner's top GPU kernels")
    parser.add_argument("--combo-kernels", action="store_true",
                        help="let inductor launch independent small kernels together (both learners)")
    add_no_record(parser)
    args = parser.parse_args()

    import torch  # noqa: PLC0415

    if args.combo_kernels:
        import torch._inductor.config as inductor_config  # noqa: PLC0415

        inductor_config.combo_kernels = True

    from k3post.engine.common import quiet_libraries  # noqa: PLC0415

    quiet_libraries()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    learners = {"bf16": make_learner(args, qat=False), "fp8-qat": make_learner(args, qat=True)}
    params = sum(p.numel() for p in learners["bf16"].model.parameters())
    rows = []
    for shape in args.shapes.split(","):
        n_rows, micro, prompt_len, completion_len = (int(x) for x in shape.split("x"))
        b = batch(len(learners["bf16"].tokenizer), n_rows, prompt_len, completion_len)
        for learner in learners.values():
            learner.optim_spec = learner.optim_spec.model_copy(update={"micro_batch_size": micro})
            for _ in range(args.warmup):
                learner.train_step(b)
        times = {name: [] for name in learners}
        ratios = []
        for r in range(args.rounds):
            order = list(learners) if r % 2 == 0 else list(reversed(learners))
            got = {name: timed_step(learners[name], b, sync) for name in order}
            for name, t in got.items():
                times[name].append(t)
            ratios.append(got["fp8-qat"] / got["bf16"])
        tokens = n_rows * (prompt_len + completion_len)
        row = {"shape": shape, "tokens": tokens, "rounds": args.rounds, **{k: statistics.median(v) for k, v in times.items()},
               "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        rows.append(row)
        print(row, flush=True)
        if args.profile and cuda:
            for name, learner in learners.items():
                print(f"\n{name}, shape {shape}: top GPU kernels of one step\n{top_kernels(learner, b, sync)}")
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"\nLearner step, {name}, {params / 1e6:.0f}M-param Llama ({args.model}) {args.dtype}, decoder compiled, "
          f"the two learners alternating for {args.rounds} rounds, torch {torch.__version__}")
    print("| rows × (prompt + completion) | micro-batch rows | tokens/step | bf16 step s | FP8-QAT step s | "
          "QAT / bf16 (median of rounds) | range |\n|---|---|---|---|---|---|---|")
    for r in rows:
        n_rows, micro, prompt_len, completion_len = r["shape"].split("x")
        print(f"| {n_rows} × ({prompt_len} + {completion_len}) | {micro} | {r['tokens']} | {r['bf16']:.4f} | "
              f"{r['fp8-qat']:.4f} | **{r['ratio']:.2f}×** | {r['ratio_min']:.2f}–{r['ratio_max']:.2f} |")
    if cuda:
        variant = "with `--profile`" if args.profile else "inductor `combo_kernels`" if args.combo_kernels else None
        where = "one " + name.removeprefix("NVIDIA ")
        record_and_say("fp8-qat", result_rows(rows, where, variant), args.no_record, source_section=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
