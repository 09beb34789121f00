"""The static-cache sampler's decode step against the memory roofline (one GPU).

The student of bench/opd/opd_step_gpu.py (random-init Qwen2, 0.40B, bf16: hidden 896, 24 layers, 14
query heads over 2 kv heads, 49,152-token tied head), sampled by `StaticSampler` with the
compiled decode step (CUDA graphs), prompts of 40-100 tokens (bucket 128) and 256 new tokens.
A decode step's time is the median gap between CUDA events recorded as each step of a 256-token
call is launched (the forward, the token pick and the loop's bookkeeping: one iteration), so each
batch size compiles one shape (on a CPU smoke run: (t(256) − t(16)) / 240). Variants, each on its
own copy of the model, side by side in one process:

    sdpa         transformers' SDPA attention (with the cache's mask it repeats every layer's
                 keys and values over the query heads of their group: repeat_kv)
    grouped      model/generation/grouped_decode_attention.py: the group's query heads attend the cache as
                 it lies (no copy)
    fp8-sdpa,    the same attention with the weights an FP8 rollout sampler holds after an FP8
    fp8-grouped  weight sync (`sampling.weights: fp8`; model/quant/fp8_linear.py): each quantised
                 Linear as e4m3 bytes + per-row scales, multiplied by `torch._scaled_mm` (real
                 FP8 GEMMs, per-token activation scales) on a GPU of compute capability >= 8.9,
                 q/k/v and gate/up stacked into one FP8 GEMM each with the input quantised
                 once; embeddings, norms and the tied head stay bf16
    NAME+autotune  the variant NAME with the decode step compiled in torch.compile's
                 "max-autotune" mode (CUDA graphs, and Inductor's GEMM templates timed against
                 cuBLAS for each shape) instead of "reduce-overhead"
    NAME+eager-pick  the variant NAME laid out as before 2026-12-06: the forward alone is the
                 CUDA graph and the token pick (softmax, the exponential race, the logprob
                 gather) runs eagerly after it, op by op from Python
    NAME+unfused  the variant NAME with q/k/v and gate/up as the model's separate GEMMs (as
                 before 2026-12-06, bf16 and FP8 weights alike), not one GEMM per group
                 (model/generation/fused_projections.py, model/quant/fp8_linear.py)
    NAME+efficient, NAME+math  the variant NAME with its decode step's attention restricted to
                 PyTorch's memory-efficient SDPA kernel, or to the math backend (GEMMs and a
                 softmax, which Inductor compiles), instead of the kernel PyTorch picks (cuDNN on
                 an H100 or H200)

`--speculate 1,2,3` also times the static engine's speculative rounds (model/generation/fast_speculation.py,
grouped attention with the verify block's 4D masks) with a fresh MTP head drafting K tokens: a
round's time against the grouped decode step's is the acceptance length at which speculation
breaks even. The random-init
student and head make the measured acceptance meaningless; only the costs are figures.

The roofline is the time to read the weights once plus the caches' live part at the HBM
bandwidth measured on the lent H200 (4.3 TB/s; ../shared/REFERENCE.md §1.7), with each variant's
own weight bytes (an fp8 variant's: 1 byte per quantised weight + its scales); `--profile` prints
the top GPU kernels of one 256-token call per variant at batch 32.

    python bench/sampling/decode_step_gpu.py [--batches 1,8,32,128] [--variants sdpa,grouped,fp8-grouped] [--profile]
        [--new-tokens 256] [--results DIR] [--commit SHA]

`--device cpu --small` is a smoke run of the script (tiny shapes; its times are not GPU figures
and are never recorded).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*

HBM_BYTES_PER_S = 4.3e12
PROFILED_TOKENS = 256  # the timed calls' length: the profile reuses their compiled shape
SHAPE = dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
             num_key_value_heads=2)
SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2)


def student(device: str, small: bool):
    import torch  # noqa: PLC0415
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    config = Qwen2Config(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa",
                         **(SMALL if small else SHAPE))
    torch.manual_seed(1)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    return model.eval()


# A variant's suffix (at most one) and what its metric's label says of it.
SUFFIXES = {"+autotune": ", compiled with max-autotune", "+eager-pick": ", pick outside the graph",
            "+unfused": ", projections unfused", "+efficient": ", memory-efficient SDPA kernel",
            "+math": ", SDPA as GEMMs and a softmax"}


def split_variant(v: str) -> tuple[str, str]:
    """(`fp8-grouped+unfused` →) the base variant and its suffix ("" for none)."""
    suffix = next((s for s in SUFFIXES if v.endswith(s)), "")
    return v.removesuffix(suffix), suffix


def variant(model, name: str, compile: bool):
    """A StaticSampler over a copy of `model`: `name` is an attention (sdpa, grouped), prefixed with
    fp8- for the weights an FP8 sync leaves in the sampler, and optionally one of SUFFIXES."""
    import torch  # noqa: PLC0415

    from k3post.model.generation.fast_sampling import StaticSampler  # noqa: PLC0415
    from k3post.model.generation.fused_projections import step_compile_options  # noqa: PLC0415

    torch._dynamo.reset()  # the variants share the decode step's code: each compiles afresh
    model = copy.deepcopy(model)
    name, suffix = split_variant(name)
    autotune, eager_pick, unfused, efficient, math = (suffix == s for s in SUFFIXES)
    attention = name.removeprefix("fp8-")
    if name.startswith("fp8-"):
        from k3post.model.quant.fp8_linear import Fp8Linear, hold_own_weights_in_fp8  # noqa: PLC0415

        hold_own_weights_in_fp8(model)  # stacks the FP8 groups, as a sampler's FP8 weight sync does
        if unfused:
            for m in model.modules():
                if isinstance(m, Fp8Linear):
                    m.unstack()
    # No stop id the random student can draw: every call decodes all its steps.
    # Unfused: the sampler is made uncompiled (compiling fuses the projections), then compiled here.
    sampler = StaticSampler(model, pad_id=2, stop_ids=[-1], compile=compile and not unfused, min_bucket=128,
                            grouped_attention=attention == "grouped")
    assert (model.config._attn_implementation != "sdpa") == (attention == "grouped")
    options = step_compile_options()
    if unfused and compile:
        sampler.compiled = True
        sampler._step = torch.compile(sampler._step_eager, dynamic=False, options=options)
    if autotune and compile:
        sampler._step = torch.compile(sampler._step_eager, dynamic=False, options={**options, "max_autotune": True})
    if eager_pick:
        from k3post.model.generation.fast_sampling import pick_tokens  # noqa: PLC0415

        decode = (torch.compile(sampler._decode_eager, dynamic=False, options=options) if compile
                  else sampler._decode_eager)
        sampler._step = lambda tokens, positions, mask, cache, params, greedy: pick_tokens(
            decode(tokens, positions, mask, cache), params, greedy)
    if efficient or math:
        in_backend(sampler, "EFFICIENT_ATTENTION" if efficient else "MATH")
    return sampler


def in_backend(sampler, backend: str) -> None:
    """The sampler's decode step traced (and run) with SDPA restricted to one backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    step = sampler._step

    def restricted(*args):
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return step(*args)

    sampler._step = restricted


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: the parameters (a tied head once) and FP8 scales."""
    scales = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("weight_scale"))
    return sum(p.numel() * p.element_size() for p in model.parameters()) + scales


def prompts(batch: int, seed: int) -> list[list[int]]:
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(40, 101))] for _ in range(batch)]


def timed_call(sampler, batch: int, new_tokens: int, sync) -> float:
    sync()
    start = time.perf_counter()
    one_call(sampler, batch, new_tokens)
    sync()
    return time.perf_counter() - start


def one_call(sampler, batch: int, new_tokens: int):
    from k3post.types import SamplingParams  # noqa: PLC0415

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    return sampler.sample(prompts(batch, new_tokens), params)


def repeated_share(sampler, batch: int, new_tokens: int) -> float:
    """The share of steps that draw the token the row drew one step before. The random student's
    next-token distributions are close to uniform over 49,152 tokens, so it is ~0 when every step
    draws fresh noise; a CUDA graph replaying the same random numbers makes each row's smallest
    exponential clock win again and again (a share near 1)."""
    ids = one_call(sampler, batch, new_tokens).completion_ids_BT
    return float((ids[:, 1:] == ids[:, :-1]).float().mean())


def step_ms(sampler, batch: int, rounds: int, sync, new_tokens: int = 256) -> tuple[float, float | None]:
    """One decode-loop iteration in ms: on a GPU from CUDA events (one compiled shape per batch),
    elsewhere from the difference of two call lengths; and, on a GPU, the host's ms per iteration."""
    import torch  # noqa: PLC0415

    if torch.cuda.is_available() and sampler.device.type == "cuda":
        return step_ms_by_events(sampler, batch, rounds, sync, new_tokens)
    for n in (16, new_tokens, 16, new_tokens):
        timed_call(sampler, batch, n, sync)
    diffs = [(timed_call(sampler, batch, new_tokens, sync) - timed_call(sampler, batch, 16, sync))
             / (new_tokens - 16) for _ in range(rounds)]
    return 1e3 * statistics.median(diffs), None


def step_ms_by_events(sampler, batch: int, rounds: int, sync, new_tokens: int) -> tuple[float, float]:
    """The median gap between CUDA events recorded as each decode step is launched (forward, pick
    and bookkeeping), over `rounds` calls of new_tokens after two warm-up calls; and the median
    gap between the host's launches (a host gap as long as the GPU's: the step waits on Python)."""
    import torch  # noqa: PLC0415

    decode, events, host = sampler._step, [], []

    def marked(*args):
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
        host.append(time.perf_counter())
        return decode(*args)

    for _ in range(2):
        timed_call(sampler, batch, new_tokens, sync)
    gaps, host_gaps = [], []
    sampler._step = marked
    try:
        for _ in range(rounds):
            events.clear()
            host.clear()
            timed_call(sampler, batch, new_tokens, sync)
            gaps += [a.elapsed_time(b) for a, b in zip(events[:-1], events[1:])]
            host_gaps += [1e3 * (b - a) for a, b in zip(host[:-1], host[1:])]
    finally:
        sampler._step = decode
    return statistics.median(gaps), statistics.median(host_gaps)


def round_ms(model, K: int, batch: int, rounds: int, sync, compile: bool, new_tokens: int = 256,
             profile: bool = False) -> tuple[float, float]:
    """(ms per speculative round, acceptance length) of the static engine drafting K tokens with a
    fresh MTP head: the median over `rounds` calls of t(new_tokens) / rounds (one compiled shape;
    the prefill, a few ms, is counted in); `profile` prints where a round's time goes."""
    from k3post.model.generation.draft_head import MtpHead  # noqa: PLC0415
    from k3post.model.generation.fast_sampling import StaticSampler  # noqa: PLC0415
    from k3post.model.generation.fast_speculation import StaticSpeculativeDecoder  # noqa: PLC0415
    from k3post.types import SamplingParams  # noqa: PLC0415

    decoder = StaticSpeculativeDecoder(StaticSampler(model, pad_id=2, stop_ids=[-1], compile=compile, min_bucket=128,
                                                     grouped_attention=True), MtpHead(model, 0).eval(), K)

    def call(n: int) -> tuple[float, int, float]:
        sync()
        start = time.perf_counter()
        _, stats = decoder.sample(prompts(batch, n), SamplingParams(max_new_tokens=n, temperature=1.0, seed=0))
        sync()
        return time.perf_counter() - start, stats.rounds, stats.acceptance_length

    for _ in range(2):
        call(new_tokens)
    found = [call(new_tokens) for _ in range(rounds)]
    if profile:
        profile_rounds(lambda: call(new_tokens)[1])
    return 1e3 * statistics.median(f[0] / f[1] for f in found), statistics.median(f[2] for f in found)


def profile_rounds(call) -> None:
    """The top GPU kernels and host ops of one speculative call, per round, and why any compiled step
    left its CUDA graph (Inductor's skip and re-record counters)."""
    import torch  # noqa: PLC0415
    from torch._dynamo.utils import counters  # noqa: PLC0415
    from torch.profiler import ProfilerActivity  # noqa: PLC0415

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rounds = call()
    events = prof.key_averages()
    for kind, key in (("GPU", "self_device_time_total"), ("host", "self_cpu_time_total")):
        top = sorted(events, key=lambda e: -getattr(e, key))[:12]
        print(f"top {kind} time, µs per round over {rounds} rounds:")
        for e in top:
            print(f"  {getattr(e, key) / rounds:8.1f}  {e.count / rounds:6.1f} calls  {e.key[:80]}")
    print(f"inductor counters: { {k: v for k, v in counters['inductor'].items() if 'cudagraph' in k} }; "
          f"recompiles {dict(counters['recompiles'])}", flush=True)


def roofline_ms(model, batch: int) -> float:
    """Weights once (a tied head once) + the keys and values a step reads (prompt bucket + half the
    new tokens on average), at HBM bandwidth."""
    c = model.config
    weights = weight_bytes(model)
    head_dim = c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * batch * c.num_key_value_heads * (128 + 128) * head_dim * 2
    return 1e3 * (weights + kv) / HBM_BYTES_PER_S


def profile(sampler, batch: int) -> tuple[list[tuple[str, int, float]], list[tuple[str, str, int, float]]]:
    """The top kernels of one PROFILED_TOKENS-token call as (kernel, calls, total µs), and the host-side
    fills and copies launched outside the compiled graph as (op, input shapes, calls, GPU µs):
    what runs inside a CUDA graph replay has no host-side op, so a kernel of the first list that
    is absent from the second comes from inside the graph."""
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity  # noqa: PLC0415

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                                with_stack=True) as prof:
        timed_call(sampler, batch, PROFILED_TOKENS, torch.cuda.synchronize)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.self_device_time_total)
    kernels = [(e.key[:70], e.count, e.self_device_time_total) for e in events[:14]]
    host = [e for e in prof.key_averages(group_by_input_shape=True)
            if e.key in ("aten::fill_", "aten::zero_", "aten::copy_", "aten::index_put_", "aten::full")]
    host.sort(key=lambda e: -e.device_time_total)
    stacks = [e for e in prof.key_averages(group_by_stack_n=12) if e.key in ("aten::fill_", "aten::zero_")]
    stacks.sort(key=lambda e: -e.device_time_total)
    for e in stacks[:4]:  # where the fills come from: the Python frames that launched them
        print(f"fill launched {e.count} times, {e.device_time_total / PROFILED_TOKENS:.1f} GPU µs/step, from:")
        print("    " + "\n    ".join(e.stack[:12]), flush=True)
    return kernels, [(e.key, str(e.input_shapes)[:60], e.count, e.device_time_total) for e in host[:10]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--variants", default="sdpa,grouped")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--speculate", default="", help="draft lengths K to time speculative rounds for, e.g. 1,2,3")
    parser.add_argument("--small", action="store_true", help="tiny shapes on the CPU (a smoke run of this script)")
    parser.add_argument("--results", type=Path, default=None, help="append the rows to DIR/decode-step-gpu.jsonl")
    parser.add_argument("--commit", default="auto")
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    cuda = args.device == "cuda"
    if args.results is not None and (not cuda or args.small):
        parser.error("--results records GPU figures of the benchmark's student; a CPU or --small run is a smoke run")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    base = student(args.device, args.small)
    batches = [int(b) for b in args.batches.split(",")]
    table, roof = {}, {}
    for name in args.variants.split(","):
        sampler = variant(base, name, compile=cuda)
        for batch in batches:
            roof[name, batch] = roofline_ms(sampler.model, batch)  # the variant's own weight bytes
            table[name, batch], host_ms = step_ms(sampler, batch, args.rounds, sync, args.new_tokens)
            host = f" (host {host_ms:.3f} ms)" if host_ms is not None else ""
            repeats = 100 * repeated_share(sampler, batch, args.new_tokens)
            print(f"{name} batch {batch}: {table[name, batch]:.3f} ms per decode step{host}; "
                  f"{repeats:.1f}% of draws repeat the row's last token", flush=True)
        if cuda:  # a graph that broke or skipped its CUDA graph replays op by op from Python
            from torch._dynamo.utils import counters  # noqa: PLC0415

            print(f"{name}: graph breaks {dict(counters['graph_break'])}, "
                  f"inductor {dict(counters['inductor'])}", flush=True)
        if args.results is not None:  # each variant's rows as soon as they exist
            save({key: ms for key, ms in table.items() if key[0] == name}, roof, args)
        if args.profile and cuda:
            print_profile(name, *profile(sampler, 32))
        del sampler
    print_table(table, roof, batches, args.variants.split(","))
    if args.speculate:
        speculation(base, table, batches, [int(k) for k in args.speculate.split(",")], args, sync, cuda)
    return 0


def speculation(base, table: dict, batches: list[int], ks: list[int], args, sync, cuda: bool) -> None:
    """Each K's round time beside the decode step (the measured grouped one, else the first variant's),
    each row recorded as soon as it is measured (a call's time limit keeps what it has)."""
    import torch  # noqa: PLC0415

    for batch in batches:
        step = table.get(("grouped", batch), next(ms for (v, b), ms in table.items() if b == batch))
        for K in ks:
            torch._dynamo.reset()
            ms, length = round_ms(copy.deepcopy(base), K, batch, args.rounds, sync, cuda, args.new_tokens,
                                  args.profile and cuda)
            print(f"speculative round K={K} batch {batch}: {ms:.3f} ms = {ms / step:.2f} decode steps "
                  f"(random head's acceptance length {length:.2f}, not a figure)", flush=True)
            if args.results is not None:
                from bench.results import record  # noqa: PLC0415

                row = {"metric": f"speculative round, K = {K}, batch {batch}", "value": round(ms, 3), "unit": "ms",
                       "notes": f"breaks even at acceptance length {ms / step:.2f} (decode step {step:.3f} ms)"}
                record("decode-step-gpu", [row], args.results / "decode-step-gpu.jsonl", commit_=args.commit,
                       source_section="The sampler's decode step against the roofline "
                                      "(`bench/sampling/decode_step_gpu.py`)")


def print_profile(name: str, kernels: list, host: list) -> None:
    print(f"\ntop GPU kernels, {name}, batch 32, one call of {PROFILED_TOKENS} new tokens (µs per decode step = total / {PROFILED_TOKENS}):")
    for kernel, calls, total in kernels:
        print(f"  {total / PROFILED_TOKENS:8.1f} µs/step  {calls:6d} calls  {kernel}")
    print("host-side fills and copies (outside the compiled graph), the same call:")
    for op, shapes, calls, total in host:
        print(f"  {total / PROFILED_TOKENS:8.1f} µs/step  {calls:6d} calls  {op} {shapes}")


def print_table(table: dict, roof: dict, batches: list[int], variants: list[str]) -> None:
    """Per batch, each variant's time, its roofline (its own weight bytes) and the share of it."""
    print("\n| batch | " + " | ".join(f"{v} ms (roofline ms, % of it)" for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for batch in batches:
        cells = [f"{table[v, batch]:.3f} ({roof[v, batch]:.3f}, {100 * roof[v, batch] / table[v, batch]:.0f}%)"
                 for v in variants]
        print(f"| {batch} | " + " | ".join(cells) + " |")


def label(v: str) -> str:
    """`grouped` → "grouped attention"; `fp8-grouped` → "grouped attention, FP8 weights";
    `grouped+autotune` → "grouped attention, compiled with max-autotune"."""
    base, suffix = split_variant(v)
    return (f"{base.removeprefix('fp8-')} attention" + (", FP8 weights" if base.startswith("fp8-") else "")
            + SUFFIXES.get(suffix, ""))


def save(table: dict, roof: dict, args) -> None:
    from bench.results import record  # noqa: PLC0415

    rows = [{"metric": f"decode step, {label(v)}, batch {b}", "value": round(ms, 3), "unit": "ms",
             "notes": f"{100 * roof[v, b] / ms:.0f}% of the HBM roofline ({roof[v, b]:.3f} ms)"}
            for (v, b), ms in table.items()]
    record("decode-step-gpu", rows, args.results / "decode-step-gpu.jsonl", commit_=args.commit,
           source_section="The sampler's decode step against the roofline "
                          "(`bench/sampling/decode_step_gpu.py`)")


if __name__ == "__main__":
    sys.exit(main())
