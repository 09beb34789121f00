"""A Kimi Linear student's training step on one GPU: the fla Triton kernels vs the PyTorch fallback.

transformers binds each KDA op (chunk/recurrent KDA, short convolutions) once, when its Kimi
module is imported: the `fla` package's kernels if `fla.ops.kda` imports, else the pure-PyTorch
reference. So the two variants are two processes, one with `fla-core` on the path and one
without; `kernel_report` (k3post/model/loading/kimi.py) prints what each one got.

The model is the shape of recipes/distill/kimi-student.yaml (hidden 576, 8 layers: 6 KDA + 2
MLA, 8 experts top-2 + 1 shared, vocabulary 49152), random weights, bf16 parameters with an
AdamW step. A step = forward + token-mean cross-entropy on random tokens + backward +
optimizer step over a B x L batch; the median of --steps timed steps after --warmup is printed,
with the loss of the first step (the same seed in both processes, so the two losses also check
that the kernels and the fallback compute the same function up to bf16 rounding).

    python bench/demos/kimi_step_gpu.py                      # whatever this process can import
    PYTHONPATH=/path/to/fla-core:$PYTHONPATH python bench/demos/kimi_step_gpu.py

The step time and peak memory, named by the kernels the process got, are appended to
bench/results/kimi-step-gpu.jsonl (`results.record`); `--no-record` leaves the file alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*

import torch  # noqa: E402
from transformers import KimiLinearForCausalLM  # noqa: E402

from k3post.config.schema import KimiSpec, ModelSpec  # noqa: E402
from k3post.model.loading.kimi import kernel_report, kimi_config  # noqa: E402
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "Kimi Linear student vs dense, and MoE balance (`recipes/distill/kimi-demo*.yaml`)"


def result_rows(out: dict) -> list[dict]:
    """The step time (3 decimals, as docs/kimi.md's table), tokens/s and peak memory of one process,
    named by where its KDA ops ran: fla's Triton kernels if any, else the PyTorch fallback."""
    kernels = "fla Triton kernels" if out["fla_kernels"] else "PyTorch fallback"
    head = (f"Kimi Linear student ({out['params_M']}M), {out['batch']} × {out['length']} tokens, bf16, "
            f"fwd + bwd + AdamW, KDA on the {kernels}")
    return [{"metric": f"{head}: step time, median", "value": rounded(out["step_s_median"], 3), "unit": "s"},
            {"metric": f"{head}: tokens/s", "value": out["tokens_per_s"], "unit": "tokens/s"},
            {"metric": f"{head}: peak memory", "value": rounded(out["peak_mem_GiB"], 1), "unit": "GiB"}]


class _Vocab:
    """What kimi_config reads from a tokenizer: its length and special ids (SmolLM2's)."""

    def __init__(self, size: int):
        self.size, self.pad_token_id, self.bos_token_id, self.eos_token_id = size, 2, 1, 2

    def __len__(self) -> int:
        return self.size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    add_no_record(parser)
    args = parser.parse_args()

    spec = KimiSpec(tokenizer_from=ModelSpec(builtin="smollm2-135m-instruct"), hidden_size=576, num_layers=8,
                    full_attention_every=4, intermediate_size=1024, linear_num_heads=4, linear_head_dim=64,
                    num_attention_heads=4, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                    v_head_dim=64, num_experts=8, experts_per_token=2, num_shared_experts=1,
                    moe_intermediate_size=128, first_k_dense=1)
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(kimi_config(spec, _Vocab(49152))).to(args.device, torch.bfloat16).train()
    report = kernel_report(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 49152, (args.batch, args.length), generator=g).to(args.device)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    out = {"kda_ops": report["kda_ops"], "fla_kernels": report["fla_kernels"],
           "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
           "batch": args.batch, "length": args.length, "step_s_median": round(median, 4),
           "step_s_all": [round(t, 4) for t in times],
           "tokens_per_s": round(args.batch * args.length / median), "first_loss": round(losses[0], 4),
           "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2), "torch": torch.__version__}
    print(json.dumps(out))
    record_and_say("kimi-step-gpu", result_rows(out), args.no_record, source_section=SECTION)


if __name__ == "__main__":
    main()
