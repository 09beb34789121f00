"""The sharded learner (FSDP2): throughput, equality with one process, and GPU memory/time.

CPU (the record; CPU scaling is not a target): the same OPD steps on the one-process learner,
on one FSDP rank and on 2 gloo ranks (torch.multiprocessing, no Ray), printed as a table with
tokens/s and the largest differences from the one-process run.

    .venv/bin/python bench/learner_sharded.py                  # CPU, a ~10M-parameter Llama

GPU (one H200; one rank is still the FSDP code path): a Qwen2-7B-shaped student (hidden 3584,
28 layers, the real 152,064-token vocabulary; random weights built straight into the shards) in
bf16-mixed with activation checkpointing, for no reference / copy reference / grad-buffer
reference: peak GiB, step time, MFU = 6·N·tokens / step time / 790e12.

    python bench/learner_sharded.py --device cuda [--layers 28] [--seq 1024] [--rows 4] [--micro 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from k3post.algo.objectives import SampledTokenPG  # noqa: E402
from k3post.config.learner_schema import LearnerSpec  # noqa: E402
from k3post.config.schema import ModelSpec, OptimSpec, ReferenceSpec, TinyModelSpec  # noqa: E402
from k3post.engine.learner import Learner, LearnerConfig  # noqa: E402
from k3post.engine.rank import RankSpec, destroy_group, peak_host_rss_gib  # noqa: E402
from k3post.types import TrainBatch  # noqa: E402

H200_BF16_FLOPS = 790e12
CPU_SPEC = ModelSpec(tiny=TinyModelSpec(hidden_size=256, intermediate_size=768, num_layers=8, num_heads=8,
                                        num_kv_heads=8, seed=0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_batch(rows: int, prompt: int, completion: int, vocab: int, seed: int) -> TrainBatch:
    """Random token ids (the shapes are what is measured), random advantages, full masks."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, vocab, (rows, prompt), generator=g).tolist()
    ids = torch.randint(4, vocab, (rows, completion), generator=g)
    mask = torch.ones(rows, completion)
    return TrainBatch(prompts, ids, mask, -torch.rand(rows, completion, generator=g) * 3, torch.randn(rows, completion,
                                                                                                      generator=g))


def config(spec: ModelSpec, micro: int, device: str = "cpu", reference: str = "none", threads=None) -> LearnerConfig:
    ref = ReferenceSpec(kind=reference, kl_coef=0.05 if reference != "none" else 0.0)
    return LearnerConfig(student=spec, optim=OptimSpec(lr=1e-4, micro_batch_size=micro), objective=SampledTokenPG(),
                         reference=ref, total_steps=100, num_threads=threads, device=device)


def timed_steps(lrn, batches) -> tuple[list[dict], float]:
    lrn.train_step(batches[0])  # warm-up (not timed)
    start = time.perf_counter()
    metrics = [lrn.train_step(b) for b in batches[1:]]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return metrics, time.perf_counter() - start


def _cpu_rank(rank: int, world: int, port: int, batches, micro: int, threads: int, out: str) -> None:
    from k3post.engine.sharded_learner import ShardedLearner

    try:
        lrn = ShardedLearner(config(CPU_SPEC, micro, threads=threads), RankSpec(rank, world, "gloo", "127.0.0.1", port),
                             LearnerSpec(sharding="always", precision="fp32"))
        metrics, seconds = timed_steps(lrn, batches)
        weights = lrn.weights()
        if rank == 0:
            torch.save({"metrics": metrics, "seconds": seconds, "rss": peak_host_rss_gib(),
                        "weights": {k: torch.as_tensor(v) for k, v in weights.items()}}, out)
    finally:
        destroy_group()


def cpu_bench(args) -> None:
    from k3post.model.load import load_tokenizer  # noqa: PLC0415

    vocab = len(load_tokenizer(CPU_SPEC))
    batches = [random_batch(args.rows, 16, args.completion, vocab, s) for s in range(args.steps + 1)]
    tokens = args.rows * args.completion * args.steps
    single = Learner(config(CPU_SPEC, args.micro, threads=2))
    base_metrics, base_seconds = timed_steps(single, batches)
    base_w = {k: torch.as_tensor(v) for k, v in single.weights().items()}
    params = sum(v.numel() for v in base_w.values())
    rows = [("one process (today)", 1, base_seconds, 0.0, 0.0, 0.0)]
    with tempfile.TemporaryDirectory() as tmp:
        for world, threads in ((1, 2), (2, 1)):
            out = str(Path(tmp) / f"w{world}.pt")
            mp.spawn(_cpu_rank, args=(world, free_port(), batches, args.micro, threads, out), nprocs=world)
            r = torch.load(out, weights_only=False)
            dloss = max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(r["metrics"], base_metrics))
            dnorm = max(abs(a["train/grad_norm"] - b["train/grad_norm"]) for a, b in zip(r["metrics"], base_metrics))
            dw = max(float((r["weights"][k] - base_w[k]).abs().max()) for k in base_w)
            rows.append((f"FSDP2, {world} gloo rank{'s' if world > 1 else ''}", world, r["seconds"], dloss, dnorm, dw))
    print(f"\nCPU, {params / 1e6:.1f}M-parameter Llama (fp32), {args.steps} OPD steps of {args.rows} x "
          f"{args.completion} completion tokens, micro-batch {args.micro}; 2 threads in all per run\n")
    print("| learner | ranks | tokens/s | max abs diff loss | max abs diff grad norm | max abs diff weights |")
    print("|---|---|---|---|---|---|")
    for name, world, seconds, dloss, dnorm, dw in rows:
        print(f"| {name} | {world} | {tokens / seconds:,.0f} | {dloss:.1e} | {dnorm:.1e} | {dw:.1e} |")


def qwen2_7b_like(layers: int):
    from transformers import Qwen2Config  # noqa: PLC0415

    return Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                       rope_theta=1e6, tie_word_embeddings=False)


def _random_sharded_loader(hf_config):
    """Stands in for load_sharded_model: the student built on the meta device and each rank's
    shards filled with random values (std 0.02): no file, no full model anywhere."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from k3post.model.sharded_load import parameters_on_meta  # noqa: PLC0415
    from k3post.model.tiny import build_tiny_tokenizer  # noqa: PLC0415

    def load(spec, dtype, device, rank, world_size, prepare, shard):
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        prepare(model)
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        root = shard(model)
        root.to_empty(device=device)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
            for p in root.parameters():
                p.to_local().normal_(0.0, 0.02)
        return root.eval(), build_tiny_tokenizer()

    return load


def gpu_bench(args) -> None:
    import k3post.engine.sharded_learner as sl  # noqa: PLC0415
    from k3post.engine.rank import init_group  # noqa: PLC0415

    hf_config = qwen2_7b_like(args.layers)
    sl.load_sharded_model = _random_sharded_loader(hf_config)
    rank = RankSpec(0, 1, "nccl", "127.0.0.1", free_port())
    init_group(rank)
    spec = ModelSpec(tiny=TinyModelSpec(), dtype="bfloat16")  # only its dtype (the samplers') is read
    prompt = 64
    batches = [random_batch(args.rows, prompt, args.seq - prompt, hf_config.vocab_size, s) for s in range(args.steps + 1)]
    tokens = args.rows * args.seq
    print(f"\nH200, Qwen2-7B-shaped student ({args.layers} layers, vocab 152,064), bf16-mixed, activation "
          f"checkpointing, {args.rows} x {args.seq} tokens per step, micro-batch {args.micro}\n")
    print("| reference | params (B) | peak GiB | step s | MFU | host RSS GiB |")
    print("|---|---|---|---|---|---|")
    for reference in args.references.split(","):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cfg = dataclasses.replace(config(spec, args.micro, "cuda", reference), total_steps=1000)
        lrn = sl.ShardedLearner(cfg, rank, LearnerSpec(precision="bf16-mixed", activation_checkpointing=True))
        n = sum(p.numel() for p in lrn.params)
        _, seconds = timed_steps(lrn, batches)
        step = seconds / args.steps
        peak = torch.cuda.max_memory_allocated() / 2**30
        mfu = 6 * n * tokens / step / H200_BF16_FLOPS
        print(f"| {reference} | {n / 1e9:.2f} | {peak:.1f} | {step:.3f} | {mfu:.1%} | {peak_host_rss_gib():.1f} |",
              flush=True)
        del lrn
    destroy_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--completion", type=int, default=64, help="CPU: completion tokens per row")
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024, help="GPU: tokens per row (prompt 64 + completion)")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--references", default="none,copy,grad_buffer")
    args = parser.parse_args()
    if args.device == "cpu":
        cpu_bench(args)
    else:
        args.rows = 4 if args.rows == 8 else args.rows
        gpu_bench(args)


if __name__ == "__main__":
    main()
