"""SFT in `bf16-mixed` against pure `bf16` (and fp32): held-out NLL and step time, side by side.

Pure bf16 keeps the weights and AdamW moments in bf16 (8 bits of mantissa): an update smaller
than about 2⁻⁸ of a weight rounds away, so at small learning rates training stalls early.
`bf16-mixed` keeps fp32 master weights and moments (FSDP2's MixedPrecisionPolicy, one rank here)
and computes in bf16. The question: is bf16-mixed's held-out NLL at least as good, and
what does it cost per step?

The task is learnable and self-contained (no hub): column addition written out in characters,
"What is 4821 + 377?" → "5198", on a Llama-shaped student with the repo's character tokenizer
(k3post/model/loading/tiny.py). Every learner starts from the same weights (the same seed) and sees the
same batches; each is the learner a recipe gets for its `learner.precision` (learner_rank.py).

    python bench/learner/sft_precision.py --device cuda                     # the H200 run (~2 min)
    .venv/bin/python bench/learner/sft_precision.py --steps 30 --hidden 128 # a CPU smoke run

Each learner's last held-out NLL, its step time and that time against pure bf16's are appended to
bench/results/sft-precision.jsonl (`results.record`); `--no-record` leaves the file alone.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

from k3post.algo.objectives import SftNll  # noqa: E402
from k3post.config.learner_schema import LearnerSpec  # noqa: E402
from k3post.config.schema import ModelSpec, OptimSpec, TinyModelSpec  # noqa: E402
from k3post.engine.learner.learner import LearnerConfig  # noqa: E402
from k3post.engine.sharded.learner_rank import group_backend, make_learner  # noqa: E402
from k3post.engine.sharded.rank import RankSpec, destroy_group  # noqa: E402
from k3post.types import Prompt  # noqa: E402

SECTION = "bf16-mixed against pure bf16 on an SFT task (`bench/learner/sft_precision.py`)"


def result_rows(results: list[dict], args) -> list[dict]:
    """Per learner: the held-out NLL at the last evaluation, the step time (4 decimals, as the
    table) and, but for pure bf16 itself, the step time against pure bf16's."""
    base = next((r for r in results if r["precision"] == "bf16"), None)
    lr = f"{args.lr:.0e}".replace("e-0", "e-")
    head = f"SFT, {args.layers}-layer Llama, hidden {args.hidden}, {args.steps} steps × {args.batch}, lr {lr}"
    rows = []
    for r in results:
        name = f"{head}, {r['precision']} ({r['learner']})"
        step, nll = r["curve"][-1]
        rows += [{"metric": f"{name}: held-out NLL at step {step}", "value": rounded(nll, 4), "unit": "nats/token"},
                 {"metric": f"{name}: step time", "value": rounded(r["step_s"], 4), "unit": "s"}]
        if base is not None and r is not base:
            rows.append({"metric": f"{name}: step time against pure bf16", "ratio_to": "the bf16 learner, same run",
                         "value": rounded(r["step_s"] / base["step_s"], 2), "unit": "×"})
    return rows


def addition_examples(n: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(10_000), rng.randrange(10_000)
        rows.append(Prompt(f"add-{seed}-{i}", "add", "", (("user", f"What is {a} + {b}?"), ("assistant", str(a + b)))))
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_arm(precision: str, args, train: list[Prompt], heldout: list[Prompt]) -> dict:
    dtype = "float32" if precision == "fp32" else "bfloat16"
    student = ModelSpec(tiny=TinyModelSpec(hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                           num_layers=args.layers, num_heads=8, num_kv_heads=8, seed=0), dtype=dtype)
    config = LearnerConfig(student=student, objective=SftNll(), optim=OptimSpec(lr=args.lr, warmup_steps=20, micro_batch_size=args.batch),
                           total_steps=args.steps, device=args.device, max_completion_tokens=8)
    rank = RankSpec(backend=group_backend(args.device), port=free_port())
    learner = make_learner(config, LearnerSpec(precision=precision), rank)
    curve, seconds = [], 0.0
    try:
        for step in range(args.steps):
            batch = train[step * args.batch:(step + 1) * args.batch]
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            learner.sft_step(batch)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds += time.perf_counter() - start if step else 0.0  # step 0 warms up
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                curve.append((step + 1, learner.sft_eval(heldout)["eval/nll"]))
    finally:
        destroy_group()
    return {"precision": precision, "learner": type(learner).__name__, "curve": curve,
            "step_s": seconds / max(args.steps - 1, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precisions", default="bf16,bf16-mixed,fp32")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--eval-every", type=int, default=100)
    add_no_record(parser)
    args = parser.parse_args()
    train, heldout = addition_examples(args.steps * args.batch, 0), addition_examples(256, 1)
    results = [run_arm(p, args, train, heldout) for p in args.precisions.split(",")]
    base = next((r for r in results if r["precision"] == "bf16"), results[0])
    print(f"\nSFT on {args.device}: {args.layers}-layer Llama, hidden {args.hidden}, {args.steps} steps x {args.batch} "
          f"examples, lr {args.lr}; held-out NLL per reply token on 256 examples\n")
    steps = [s for s, _ in results[0]["curve"]]
    print("| precision | learner | " + " | ".join(f"NLL @ {s}" for s in steps) + " | step s | × bf16 time |")
    print("|---|---|" + "---|" * len(steps) + "---|---|")
    for r in results:
        nll = " | ".join(f"{v:.4f}" for _, v in r["curve"])
        print(f"| {r['precision']} | {r['learner']} | {nll} | {r['step_s']:.4f} | {r['step_s'] / base['step_s']:.2f} |")
    record_and_say("sft-precision", result_rows(results, args), args.no_record, source_section=SECTION)


if __name__ == "__main__":
    main()
