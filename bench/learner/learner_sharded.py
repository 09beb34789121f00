"""The sharded learner (FSDP2): throughput, equality with one process, and GPU memory/time.

CPU (the record; CPU scaling is not a target): the same OPD steps on the one-process learner,
on one FSDP rank and on 2 gloo ranks (torch.multiprocessing, no Ray), printed as a table with
tokens/s and the largest differences from the one-process run.

    .venv/bin/python bench/learner/learner_sharded.py                  # CPU, a ~10M-parameter Llama

GPU (one H200; one rank is still the FSDP code path): a student of a given shape (`--shape`:
Qwen2-7B dimensions with the real 152,064-token vocabulary, a 1.36B Llama, the OPD benchmark's
0.40B Qwen2; random weights built straight into the shards) through the learners of
`--learners` (today's one-process pure-bf16 learner, one FSDP2 rank in bf16-mixed, with
activation checkpointing), for no reference / copy reference / grad-buffer reference: peak GiB,
step time, tokens/s, MFU = 6·N·tokens / step time / 790e12 (recomputation not counted).

    python bench/learner/learner_sharded.py --device cuda --shape qwen2-7b --rows 4 --seq 1024 --micro 2
    python bench/learner/learner_sharded.py --device cuda --shape llama-1.3b --rows 8 --seq 2048 --micro 2 \
        --learners unsharded-bf16,sharded-bf16-mixed --references none [--compile]

Several GPUs: `--ranks N` spawns N NCCL ranks, one GPU each, each with `--rows` rows
(the same per-rank batch as one rank: weak scaling); peak GiB and host RSS are the largest rank's.

    python bench/learner/learner_sharded.py --device cuda --ranks 2 --shape llama-1.3b --rows 8 --seq 2048 --micro 8 \
        --learners sharded-bf16-mixed+ac --references none --compile
    python bench/learner/learner_sharded.py --device cuda --ranks 2 --shape qwen2.5-14b --rows 2 --seq 1024 --micro 1 \
        --learners sharded-bf16-mixed+ac --references none,grad_buffer --gap 1.5

A GPU run records its rows at the end (`results.record`; the rows they replace marked "current":
false): a run of `--references none` appends each learner's MFU, peak memory and step time to
bench/results/learner-sharded-h200.jsonl; a run with a reference (copy, grad_buffer) appends every
row, with the ratios to no reference and to the copy, to bench/results/reference-cost.jsonl.
`--label` ("process 1") tells apart runs of one command; `--no-record` leaves the files alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*

from k3post.algo.objectives import SampledTokenPG  # noqa: E402
from k3post.config.learner_schema import LearnerSpec  # noqa: E402
from k3post.config.schema import ModelSpec, OptimSpec, ReferenceSpec, TinyModelSpec  # noqa: E402
from k3post.engine.learner.learner import Learner, LearnerConfig  # noqa: E402
from k3post.engine.sharded.rank import RankSpec, destroy_group, peak_host_rss_gib  # noqa: E402
from k3post.types import TrainBatch  # noqa: E402

from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

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


def timed_steps(lrn, batches, gap_s: float = 0.0) -> tuple[list[dict], float]:
    """The summed time of the learner steps after one warm-up step. `gap_s`: idle seconds before
    each step (not timed), standing in for the sampling and scoring between two learner steps of
    an OPD run, which the grad-buffer reference's host-to-device copy overlaps."""
    lrn.train_step(batches[0])  # warm-up (not timed)
    cuda = torch.cuda.is_available()
    metrics, total = [], 0.0
    for b in batches[1:]:
        if gap_s:
            time.sleep(gap_s)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics.append(lrn.train_step(b))
        if cuda:  # this stream only: a copy the step left running on a side stream belongs to the gap
            torch.cuda.current_stream().synchronize()
        total += time.perf_counter() - start
    return metrics, total


def _cpu_rank(rank: int, world: int, port: int, batches, micro: int, threads: int, out: str) -> None:
    from k3post.engine.sharded.sharded_learner import ShardedLearner

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
    from k3post.model.loading.load import load_tokenizer  # noqa: PLC0415

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


SHAPES = {
    # Qwen2-7B dimensions with the real 152,064-token vocabulary (7.6B parameters at 28 layers).
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4),
    # A 1.36B Llama-style student (the MFU shape: sequence 2,048).
    "llama-1.3b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=16),
    # Qwen2.5-14B dimensions (14.8B parameters): the student that does not fit one GPU.
    "qwen2.5-14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8),
    # The OPD benchmark's 0.40B student (bench/opd/opd_step_gpu.py: 24 layers, d 896, vocab 49,152).
    "qwen2-0.4b": dict(vocab_size=49152, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2),
    # The same dimensions with Qwen2.5-0.5B's real 151,936-token vocabulary (untied head: 0.63B).
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
}


def hf_config(shape: str, layers: int | None):
    from transformers import Qwen2Config  # noqa: PLC0415

    dims = dict(SHAPES[shape])
    if layers:
        dims["num_hidden_layers"] = layers
    return Qwen2Config(**dims, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False)


def _random_sharded_loader(hf_config):
    """Stands in for load_sharded_model: the student built on the meta device and each rank's
    shards filled with random values (std 0.02): no file, no full model anywhere."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from k3post.model.training.sharded_load import parameters_on_meta  # noqa: PLC0415
    from k3post.model.loading.tiny import build_tiny_tokenizer  # noqa: PLC0415

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


def _random_loader(hf_config):
    """Stands in for load_model in today's one-process learner: the same random student in bf16."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from k3post.model.loading.tiny import build_tiny_tokenizer  # noqa: PLC0415

    def load(spec):
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
        return model, build_tiny_tokenizer()

    return load


# --learners: which learner computes, and how. "unsharded-bf16" is today's one-process pure-bf16
# learner; "sharded-..." is one FSDP2 rank (NCCL) in bf16-mixed, with activation checkpointing (+ac).
LEARNERS = ("unsharded-bf16", "sharded-bf16-mixed", "sharded-bf16-mixed+ac")


def make_gpu_learner(kind: str, cfg, rank):
    """`kind`: a LEARNERS name, optionally with experiment suffixes: +fused (fused AdamW),
    +keep (parameters stay gathered between forward and backward: reshard_after_forward off),
    +model (learner.shard_unit: model - the whole model one FSDP unit), +eagerhead (with --compile:
    the blocks compiled, the head's chunks eager - the learner before the head was compiled too),
    +dtensorclip / +dtensoradam (the grad clip / AdamW through DTensor's ops, as the learner did
    before; it now runs both on the plain local shards)."""
    import k3post.engine.learner.learner as one  # noqa: PLC0415
    import k3post.engine.sharded.sharded_learner as sl  # noqa: PLC0415
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    if kind.startswith("unsharded-bf16"):
        lrn = one.Learner(cfg)
    else:
        spec = LearnerSpec(precision="bf16-mixed", activation_checkpointing="+ac" in kind,
                           shard_unit="model" if "+model" in kind else "block")
        lrn = sl.ShardedLearner(cfg, rank, spec)
        if "+keep" in kind:
            for module in lrn.root.modules():
                if isinstance(module, FSDPModule):
                    module.set_reshard_after_forward(False)
    if "+eagerhead" in kind:
        lrn.config = dataclasses.replace(lrn.config, compile=False)
    if "+dtensorclip" in kind:  # the grad clip through DTensor's ops (the learner's earlier clip)
        from k3post.model.training.fsdp import clip_grad_norm_dtensor  # noqa: PLC0415

        lrn._clip_grad_norm = lambda: clip_grad_norm_dtensor(lrn.params, lrn.optim_spec.grad_clip)
    if "+dtensoradam" in kind:  # torch's AdamW over the DTensors (the learner's earlier optimizer)
        from k3post.engine.learner.learner_base import make_optimizer  # noqa: PLC0415

        lrn.optimizer, lrn.scheduler = make_optimizer(lrn.params, cfg.optim, cfg.total_steps)
    if "+fused" in kind:
        optim = cfg.optim
        lrn.optimizer = torch.optim.AdamW(lrn.params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay,
                                          fused=True)
    return lrn


def profile_step(lrn, batch) -> None:
    """The top CUDA kernels and CPU ops of one step (after the timed ones)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        lrn.train_step(batch)
        torch.cuda.synchronize()
    for key in ("self_cuda_time_total", "self_cpu_time_total", "cpu_time_total"):
        print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=70))
    # The host's Python side (FSDP hooks, DTensor dispatch, compiled-graph guards) by own time.
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    profiler = cProfile.Profile()
    profiler.runcall(lambda: (lrn.train_step(batch), torch.cuda.synchronize()))
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


def gpu_bench(args) -> None:
    """`--ranks N` NCCL ranks (one GPU each), spawned from this process (one included: the same path);
    rank 0 leaves its measurements in a file, which this process records."""
    import json  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        args.measured = str(Path(tmp) / "measured.json")
        mp.spawn(_gpu_rank, args=(args, free_port()), nprocs=args.ranks)
        measured = json.loads(Path(args.measured).read_text()) if Path(args.measured).is_file() else []
    gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ")
    for subject, rows in result_rows(measured, args).items():
        notes = (f"{args.steps} timed steps after a warm-up step" + (f", {args.gap} s idle before each" if args.gap else "")
                 + f"; {args.ranks} × {gpu}")
        record_and_say(subject, [{**r, "notes": notes} for r in rows], args.no_record, source_section=GPU_SECTION)


GPU_SECTION = ("Sharded learner on one H200: MFU, memory, the reference in the sharded gradient buffers "
               "(`bench/learner/learner_sharded.py --device cuda`)")


def shape_name(shape: str, layers: int, params: int) -> str:
    """The student as the recorded metrics name it, e.g. "5.29B student (Qwen2-7B dims, 18 layers)"."""
    billions = f"{params / 1e9:.2f}B"
    return {"qwen2-7b": f"{billions} student (Qwen2-7B dims, {layers} layers)",
            "qwen2.5-14b": f"{billions} student (Qwen2.5-14B dims, {layers} layers)",
            "llama-1.3b": f"{billions} Llama student",
            "qwen2-0.4b": f"{billions} student (OPD benchmark shape, 49,152 vocabulary)",
            "qwen2.5-0.5b": "Qwen2.5-0.5B dims (151,936 vocabulary)"}[shape]


def learner_name(kind: str, compiled: bool, ranks: int = 1) -> str:
    """A --learners entry as the recorded metrics name it, e.g. "sharded bf16-mixed, model unit, compiled"."""
    base, *suffixes = kind.split("+")
    text = {"unsharded-bf16": "unsharded bf16", "sharded-bf16-mixed": "sharded bf16-mixed"}[base]
    text += "".join({"ac": " + AC", "fused": " + fused AdamW"}.get(x, "") for x in suffixes)
    text += "".join({"model": ", model unit", "keep": ", kept gathered", "eagerhead": ", eager head",
                     "dtensorclip": ", DTensor clip", "dtensoradam": ", DTensor AdamW"}.get(x, "") for x in suffixes)
    return text + (", compiled" if compiled else "") + (f", {ranks} ranks" if ranks > 1 else "")


def _tail(*parts) -> str:
    parts = [p for p in parts if p]
    return f" ({'; '.join(parts)})" if parts else ""


def result_rows(measured: list[dict], args) -> dict[str, list[dict]]:
    """bench/results rows by subject from rank 0's measurements (each: kind, reference, params,
    peak_gib, step_s, mfu, scratch_elements, largest_shard). Without a reference in the run:
    learner-sharded-h200, each learner's MFU (%, 1 decimal), peak GiB (1) and step seconds (3).
    With one: reference-cost, each reference's peak and step time, and per learner the ratios to
    no reference and to the copy (same process)."""
    if not measured:
        return {}
    refs = {m["reference"] for m in measured}
    out = []
    for kind in dict.fromkeys(m["kind"] for m in measured):
        mine = {m["reference"]: m for m in measured if m["kind"] == kind}
        any_ = next(iter(mine.values()))
        head = (f"{shape_name(args.shape, args.layers or SHAPES[args.shape]['num_hidden_layers'], any_['params'])}, "
                f"{args.rows} × {args.seq:,} tokens, {learner_name(kind, args.compile, args.ranks)}")
        if refs == {"none"}:
            m = mine["none"]
            out += [{"metric": f"{head}: MFU", "value": rounded(100 * m["mfu"], 1), "unit": "%"},
                    {"metric": f"{head}: peak memory", "value": rounded(m["peak_gib"], 1), "unit": "GiB"},
                    {"metric": f"{head}: step time", "value": rounded(m["step_s"], 3), "unit": "s"}]
            continue
        out += reference_rows(head, mine, args.label)
    return {"learner-sharded-h200" if refs == {"none"} else "reference-cost": out}


def reference_rows(head: str, mine: dict[str, dict], label: str | None) -> list[dict]:
    """One learner's rows of a run with references: peak memory and step time of each, the
    grad-buffer reference's scratch named (64 MiB, or the largest shard), and the ratios."""
    out, none, copy = [], mine.get("none"), mine.get("copy")
    for ref, m in mine.items():
        scratch = scratch_short = None
        if ref == "grad_buffer":
            whole = m["scratch_elements"] >= m["largest_shard"]
            size = min(m["scratch_elements"], m["largest_shard"]) * 4  # fp32 elements
            scratch_short = "scratch the largest shard" if whole else f"{size / 2**20:.0f} MiB scratch"
            scratch = f"scratch the largest shard, {size / 2**30:.2f} GiB" if whole else scratch_short
        name = "no reference" if ref == "none" else f"{ref} reference"
        out += [{"metric": f"{head}: {name}, peak memory{_tail(scratch, label)}", "value": rounded(m["peak_gib"], 1),
                 "unit": "GiB"},
                {"metric": f"{head}: {name}, step time{_tail(scratch_short, label)}", "value": rounded(m["step_s"], 3),
                 "unit": "s"}]
        if none is not None and ref != "none":
            out.append({"metric": f"{head}: {name}, step time against no reference{_tail(label)}", "unit": "×",
                        "value": rounded(m["step_s"] / none["step_s"], 2), "ratio_to": "no reference, same process"})
            if ref == "grad_buffer" and scratch_short != "scratch the largest shard":
                out.append({"metric": f"peak GPU memory of the grad_buffer reference against none: {head}, {scratch_short}"
                                      + (f" ({label})" if label else ""),
                            "value": rounded(m["peak_gib"] / none["peak_gib"], 3), "unit": "×",
                            "ratio_to": f"no reference ({none['peak_gib']:.1f} GiB)"})
            else:
                out.append({"metric": f"{head}: {name}, peak memory against no reference{_tail(scratch_short, label)}",
                            "value": rounded(m["peak_gib"] / none["peak_gib"], 3), "unit": "×",
                            "ratio_to": f"no reference ({none['peak_gib']:.1f} GiB)"})
        if copy is not None and ref == "grad_buffer":
            out.append({"metric": f"{head}: grad_buffer reference, step time against the copy reference's{_tail(label)}",
                        "value": rounded(m["step_s"] / copy["step_s"], 2), "unit": "×",
                        "ratio_to": "copy reference, same process"})
    return out


def _gpu_rank(rank_id: int, args, port: int) -> None:
    """Every learner × reference of the command on this rank; rank 0 prints the rows (peak GiB
    and host RSS: the largest over the ranks). Each rank gets `--rows` rows: the per-rank batch is
    the same at any `--ranks`, so tokens/s compare as weak scaling."""
    import torch.distributed as dist  # noqa: PLC0415

    import k3post.engine.learner.learner as one  # noqa: PLC0415
    import k3post.engine.sharded.sharded_learner as sl  # noqa: PLC0415
    from k3post.engine.sharded import sharded_reference  # noqa: PLC0415
    from k3post.engine.sharded.rank import init_group  # noqa: PLC0415

    if args.scratch_elements is not None:  # a spawned rank: set it here, not in the parent
        sharded_reference.SCRATCH_ELEMENTS = args.scratch_elements
    config_hf = hf_config(args.shape, args.layers)
    sl.load_sharded_model, one.load_model = _random_sharded_loader(config_hf), _random_loader(config_hf)
    rank = RankSpec(rank_id, args.ranks, "nccl", "127.0.0.1", port, local_rank=rank_id)
    init_group(rank)
    spec = ModelSpec(tiny=TinyModelSpec(), dtype="bfloat16")  # only its dtype (the samplers') is read
    prompt, rows = 64, args.rows * args.ranks
    batches = [random_batch(rows, prompt, args.seq - prompt, config_hf.vocab_size, s) for s in range(args.steps + 1)]
    tokens = rows * args.seq
    say = print if rank_id == 0 else (lambda *a, **k: None)
    gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ")
    say(f"\n{gpu} x {args.ranks}, {args.shape}-shaped student ({config_hf.num_hidden_layers} layers, vocab "
        f"{config_hf.vocab_size:,}), {args.rows} x {args.seq} tokens per rank per step, micro-batch {args.micro}, "
        f"compile {args.compile}, reference swap scratch {sharded_reference.SCRATCH_ELEMENTS:,} elements at most\n",
        flush=True)
    say("| learner | ranks | reference | params (B) | peak GiB per rank | step s | tokens/s | MFU | host RSS GiB per rank |")
    say("|---|---|---|---|---|---|---|---|---|")
    measured = []
    for kind in args.learners.split(","):
        for reference in args.references.split(","):
            gc.collect()  # FSDP's hooks tie modules in cycles: free the last learner before measuring the next
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            cfg = dataclasses.replace(config(spec, args.micro, "cuda", reference), total_steps=1000,
                                      compile=args.compile)
            try:
                lrn = make_gpu_learner(kind, cfg, rank)
                n = sum(p.numel() for p in lrn.params)  # a DTensor counts its global elements
                _, seconds = timed_steps(lrn, batches, args.gap)
            except torch.OutOfMemoryError as err:
                say(f"| {kind} | {args.ranks} | {reference} | - | out of memory | - | - | - | "
                    f"({str(err).splitlines()[0][:60]}) |", flush=True)
                lrn = None
                continue
            step = seconds / args.steps
            if args.profile and rank_id == 0:
                profile_step(lrn, batches[0])
            peaks = [None] * args.ranks
            dist.all_gather_object(peaks, (torch.cuda.max_memory_allocated() / 2**30, peak_host_rss_gib()))
            mfu = 6 * n * tokens / step / (H200_BF16_FLOPS * args.ranks)
            say(f"| {kind} | {args.ranks} | {reference} | {n / 1e9:.2f} | {max(p for p, _ in peaks):.1f} | {step:.3f} | "
                f"{tokens / step:,.0f} | {mfu:.1%} | {max(r for _, r in peaks):.1f} |", flush=True)
            measured.append({"kind": kind, "reference": reference, "params": n, "peak_gib": max(p for p, _ in peaks),
                             "step_s": step, "mfu": mfu, "scratch_elements": sharded_reference.SCRATCH_ELEMENTS,
                             "largest_shard": max((p.to_local() if hasattr(p, "to_local") else p).numel()
                                                  for p in lrn.params)})
            lrn = None
    if rank_id == 0:
        import json  # noqa: PLC0415

        Path(args.measured).write_text(json.dumps(measured))
    destroy_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--completion", type=int, default=64, help="CPU: completion tokens per row")
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024, help="GPU: tokens per row (prompt 64 + completion)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b", help="GPU: the student's shape")
    parser.add_argument("--layers", type=int, default=None, help="GPU: override the shape's layer count")
    parser.add_argument("--learners", default="sharded-bf16-mixed+ac", help=f"GPU: comma-separated of {LEARNERS}")
    parser.add_argument("--compile", action="store_true", help="GPU: torch.compile the decoder blocks")
    parser.add_argument("--profile", action="store_true", help="GPU: profile one more step of each learner")
    parser.add_argument("--gap", type=float, default=0.0, help="GPU: untimed idle seconds before each step")
    parser.add_argument("--references", default="none,copy,grad_buffer")
    parser.add_argument("--ranks", type=int, default=1, help="GPU: NCCL learner ranks, one GPU each (spawned)")
    parser.add_argument("--scratch-elements", type=int, default=None,
                        help="the grad-buffer reference's swap scratch (elements; default engine/sharded/sharded_reference.py's;"
                             " a huge value gives the largest shard's size: the one-piece swap measured against)")
    parser.add_argument("--label", default=None, help="GPU: a run label in the recorded metrics, e.g. 'process 1'")
    add_no_record(parser)
    args = parser.parse_args()
    if args.ranks > 1 and "unsharded" in args.learners:
        parser.error("--ranks > 1 runs sharded learners only (unsharded-bf16 is one process)")
    if args.device == "cpu":
        cpu_bench(args)
    else:
        gpu_bench(args)


if __name__ == "__main__":
    main()
