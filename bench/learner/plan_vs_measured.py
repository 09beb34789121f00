"""`k3post plan`'s learner estimate beside a GPU measurement of the same shape.

Takes bench/learner/learner_sharded.py's own arguments and prints, for each learner × reference of the
command, the peak the planner predicts (k3post/plan/memory.py, from the shape's config on the
meta device). With `--run` it then runs bench/learner/learner_sharded.py with the same arguments on this
machine's GPU, so the measured "peak GiB per rank" column prints right below the predictions.

    python bench/learner/plan_vs_measured.py --shape qwen2-7b --layers 18 --rows 4 --seq 1024 --micro 2 \
        --learners sharded-bf16-mixed+ac --references none,grad_buffer,copy            # CPU: predictions only
    python bench/learner/plan_vs_measured.py --shape llama-1.3b --rows 8 --seq 2048 --micro 8 --compile \
        --learners sharded-bf16-mixed+model --references none --run                    # on the GPU machine

Prompts are 64 tokens of each `--seq` (as learner_sharded.py builds its batches), every row the
same length (no attention mask: keys and values saved at the KV-head count).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*

PROMPT = 64  # bench/learner/learner_sharded.py: prompt = 64


def setup_for(kind: str, reference: str, rows: int, seq: int, micro: int, ranks: int, compiled: bool):
    """The LearnerSetup of a learner_sharded.py `--learners` kind (its +ac, +model suffixes)."""
    from k3post.plan.memory import LearnerSetup  # noqa: PLC0415

    sharded = not kind.startswith("unsharded")
    return LearnerSetup(precision="bf16-mixed" if sharded else "bf16", sharded=sharded, ranks=ranks,
                        micro_batch=min(micro, rows), seq_len=seq, completion_len=seq - PROMPT,
                        shard_unit="model" if "+model" in kind else "block", activation_checkpointing="+ac" in kind,
                        compiled=compiled, reference=reference, padded=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2-7b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--learners", default="sharded-bf16-mixed+ac")
    parser.add_argument("--references", default="none,copy,grad_buffer")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--run", action="store_true",
                        help="also run bench/learner/learner_sharded.py with these arguments")
    args, rest = parser.parse_known_args()

    from bench.learner.learner_sharded import SHAPES, hf_config  # noqa: PLC0415

    from k3post.plan.memory import GIB, learner_peak  # noqa: PLC0415
    from k3post.plan.shapes import shape_of  # noqa: PLC0415

    if args.shape not in SHAPES:
        parser.error(f"--shape {args.shape}: expected one of {', '.join(sorted(SHAPES))}")
    shape = shape_of(hf_config(args.shape, args.layers), args.shape)
    print(f"\n{args.shape} ({shape.params / 1e9:.2f}B, {shape.layers} layers), {args.rows} × {args.seq} tokens per "
          f"rank, micro-batch {args.micro}, compile {args.compile}: the planner's peak per rank\n")
    print("| learner | reference | predicted peak GiB | parts (GiB) |")
    print("|---|---|---|---|")
    for kind in args.learners.split(","):
        for reference in args.references.split(","):
            peak = learner_peak(shape, setup_for(kind, reference, args.rows, args.seq, args.micro, args.ranks,
                                                 args.compile))
            parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in peak.parts.items() if v)
            print(f"| {kind} | {reference} | {peak.total / GIB:.1f} | {parts} |")
    if not args.run:
        return 0
    command = [sys.executable, str(Path(__file__).with_name("learner_sharded.py")), "--device", "cuda",
               "--shape", args.shape, "--rows", str(args.rows), "--seq", str(args.seq), "--micro", str(args.micro),
               "--ranks", str(args.ranks), "--learners", args.learners, "--references", args.references, *rest]
    if args.layers:
        command += ["--layers", str(args.layers)]
    if args.compile:
        command.append("--compile")
    print("\nmeasured:", " ".join(command[1:]), flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
