"""The learner's LM head: chunked log-softmax of the sampled tokens, eager against compiled
(`train.compile`; k3post/model/scoring/logprobs.py), forward + backward on random inputs.

    python bench/learner/head_logprobs.py --device cuda                 # 10,240 positions, Qwen2.5's 151,936 vocabulary
    python bench/learner/head_logprobs.py --device cuda --vocab 49152   # SmolLM2's vocabulary

Prints ms per forward + backward of each (the rows alternate: eager, compiled, eager, compiled)
and the largest differences of the values and gradients between them. The best of each head's two
passes, and compiled against eager, are appended to bench/results/head-logprobs.jsonl
(`results.record`); `--no-record` leaves the file alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from k3post.model.scoring.logprobs import head_logprobs  # noqa: E402
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = ("Sharded learner on one H200: MFU, memory, the reference in the sharded gradient buffers "
           "(`bench/learner/learner_sharded.py --device cuda`)")


def result_rows(ms: dict[bool, list[float]], positions: int, hidden: int, vocab: int, dtype: str) -> list[dict]:
    """`ms`: compiled? -> ms of forward + backward in each pass. The best pass of each head (1
    decimal, as printed), the other passes in the notes, and compiled against eager."""
    head = f"LM head log-softmax, {positions:,} positions, H {hidden}, vocabulary {vocab:,}, {dtype}"
    best = {compiled: min(times) for compiled, times in ms.items()}
    rows = [{"metric": f"{head}, {'compiled' if compiled else 'eager'}: forward + backward, best pass",
             "value": rounded(best[compiled], 1), "unit": "ms",
             "notes": "passes: " + " / ".join(f"{t:.1f}" for t in times) + " ms"} for compiled, times in ms.items()]
    if len(best) == 2:
        rows.append({"metric": f"{head}: compiled against eager, best passes", "unit": "×", "ratio_to": "eager",
                     "value": rounded(best[True] / best[False], 2)})
    return rows


def synchronize(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize()


def timed(h0, w0, targets, compiled: bool, iters: int) -> tuple[float, tuple[torch.Tensor, ...]]:
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    for i in range(iters + 1):
        if i == 1:  # the first call compiles
            synchronize(h)
            start = time.perf_counter()
        h.grad = w.grad = None
        values = head_logprobs(h, w, targets, compiled=compiled)
        values.sum().backward()
    synchronize(h)
    return (time.perf_counter() - start) / iters * 1e3, (values.detach().float(), h.grad.float(), w.grad.float())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--positions", type=int, default=10240)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--iters", type=int, default=3)
    add_no_record(parser)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gen = torch.Generator(device=args.device).manual_seed(0)
    h0 = torch.randn(args.positions, args.hidden, device=args.device, dtype=dtype, generator=gen)
    w0 = torch.randn(args.vocab, args.hidden, device=args.device, dtype=dtype, generator=gen) * 0.02
    targets = torch.randint(0, args.vocab, (args.positions,), device=args.device, generator=gen)
    print("| head | positions | vocab | ms fwd+bwd |\n|---|---|---|---|")
    out, passes = {}, {False: [], True: []}
    for compiled in (False, True, False, True):
        ms, out[compiled] = timed(h0, w0, targets, compiled, args.iters)
        passes[compiled].append(ms)
        print(f"| {'compiled' if compiled else 'eager'} | {args.positions:,} | {args.vocab:,} | {ms:.1f} |")
    (v0, dh0, dw0), (v1, dh1, dw1) = out[False], out[True]
    print(f"\nmax |Δ value| {(v0 - v1).abs().max().item():.2e}; max |Δ dh| / max |dh| "
          f"{((dh0 - dh1).abs().max() / dh0.abs().max()).item():.2e}; max |Δ dW| / max |dW| "
          f"{((dw0 - dw1).abs().max() / dw0.abs().max()).item():.2e}")
    rows = result_rows(passes, args.positions, args.hidden, args.vocab, str(dtype).removeprefix("torch."))
    record_and_say("head-logprobs", rows, args.no_record, source_section=SECTION)


if __name__ == "__main__":
    main()
