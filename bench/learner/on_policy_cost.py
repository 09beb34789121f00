"""What `sampling.on_policy: bitwise` costs: one step's sampling and the learner's log π forward +
backward, with the mode off and on, on a recipe's shapes, on a CPU or a GPU (docs/on-policy.md).

    .venv/bin/python bench/learner/on_policy_cost.py recipes/smoke/tiny.yaml --repeats 5
    .venv/bin/python bench/learner/on_policy_cost.py recipes/quickstart.yaml --repeats 1
    .venv/bin/python bench/learner/on_policy_cost.py recipes/quickstart.yaml --repeats 1 --qat
    .venv/bin/python bench/learner/on_policy_cost.py recipes/smoke/tiny.yaml --repeats 1 --profile /tmp/p.txt
    python3 bench/learner/on_policy_cost.py recipes/quickstart.yaml --device cuda student.dtype=bfloat16 \
        data.prompts_per_step=32 sampling.max_new_tokens=256 optim.micro_batch_size=32

For each mode: the recipe's student samples `data.prompts_per_step` prompts of its first source
(`sampling.*`, the HF sampler with a dynamic cache, exactly as a run does), then the learner's
policy forward of those rollouts, in `optim.micro_batch_size` micro-batches, with backward (the
part of a learner step the mode changes; the teachers, the loss terms and the optimizer are the
same in both modes and left out). `--qat`: under FP8 QAT with FP8 rollouts on its grid (the sampler
holds the learner's quantised Linears as e4m3 bytes and scales; the learner's pass is the QAT
forward with fake quantisation on). Prints the median seconds of `--repeats` runs and the largest
|log π − log μ| (0 in bitwise mode), and records the ratios to bench/results/on-policy-cost.jsonl
(`--no-record`: print only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.opd.opd_gpu_rows import ON_POLICY_SECTION  # noqa: E402  (GPU runs: the GPU section, beside opd_step_gpu.py's)
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

from k3post.config.load import load_run_recipe  # noqa: E402
from k3post.data.builtin_prompts import builtin_prompt_set  # noqa: E402
from k3post.engine.samplers.sampler import HFSampler  # noqa: E402
from k3post.model.loading.load import load_model  # noqa: E402
from k3post.model.quant.fp8_sync import fp8_payload  # noqa: E402
from k3post.model.quant.qat import prepare_fp8_qat  # noqa: E402
from k3post.model.training.weights import unique_state  # noqa: E402
from k3post.model.scoring.logprobs import completion_logprobs  # noqa: E402
from k3post.types import Prompt, Rollouts, SamplingParams  # noqa: E402


def prompts_of(recipe) -> list[Prompt]:
    source = recipe.data.sources[0]
    rows = builtin_prompt_set(source.prompts.removeprefix("builtin:"))[: recipe.data.prompts_per_step]
    return [Prompt(str(i), source.name, "", (("user", row["prompt"]),)) for i, row in enumerate(rows)]


def params_of(recipe) -> SamplingParams:
    """The recipe's sampling settings, seeded with its training seed."""
    sampling = recipe.sampling
    return SamplingParams(sampling.max_new_tokens, sampling.temperature, sampling.top_p, seed=recipe.train.seed)


def sides(recipe, mode: str, threads: int, device: str, qat: bool) -> tuple[HFSampler, torch.nn.Module]:
    """The sampler, and the model the learner's pass runs: the sampler's own, or (`qat`) a learner
    with FP8 QAT's fake-quantised Linears whose weights the sampler holds as e4m3 bytes and per-row
    scales (`sampling.weights: fp8`, fake quantisation from the first step), as a run syncs them."""
    sampler = HFSampler(recipe.student, num_threads=threads, device=device, on_policy=mode,
                        fp8_from_version=0 if qat else None)
    if not qat:
        return sampler, sampler.model
    learner, _ = load_model(recipe.student)
    layers = prepare_fp8_qat(learner)
    sampler.load_weights(fp8_payload(unique_state(learner), layers), 1)
    return sampler, learner.to(device)


def learner_pass(sampler: HFSampler, model: torch.nn.Module, rollouts: Rollouts, micro_batch: int, temperature: float,
                 bitwise: bool) -> float:
    """Forward + backward of log π over the rollouts in micro-batches; the largest gap to log μ."""
    pad_id, gap = sampler.tokenizer.pad_token_id, 0.0
    model.train()
    for start in range(0, len(rollouts.prompt_ids), micro_batch):
        rows = slice(start, start + micro_batch)
        mask_BT = rollouts.loss_mask_BT[rows]
        logprobs_BT = completion_logprobs(model, rollouts.prompt_ids[rows], rollouts.completion_ids_BT[rows],
                                          mask_BT, pad_id, temperature, bitwise=bitwise)
        logprobs_BT.sum().backward()
        gap = max(gap, float(((logprobs_BT.detach() - rollouts.sampler_logprobs_BT[rows]).abs() * mask_BT).max()))
    model.eval()
    model.zero_grad()
    return gap


def measure(recipe, mode: str, repeats: int, threads: int, device: str, qat: bool) -> dict[str, float]:
    sampler, learner = sides(recipe, mode, threads, device, qat)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sampling, params = recipe.sampling, params_of(recipe)
    prompts = prompts_of(recipe)
    sample_s, learn_s, gap, tokens = [], [], 0.0, 0
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        rollouts = sampler.sample(prompts, params)
        sync()
        sample_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        gap = max(gap, learner_pass(sampler, learner, rollouts, recipe.optim.micro_batch_size, sampling.temperature,
                                    mode == "bitwise"))
        sync()
        learn_s.append(time.perf_counter() - start)
        tokens = int(rollouts.loss_mask_BT.sum())
    return {"sample_s": statistics.median(sample_s), "learner_s": statistics.median(learn_s), "max_gap": gap,
            "tokens": tokens}


def profile_learner(recipe, threads: int, device: str, path: Path, qat: bool) -> None:
    """One more bitwise learner pass (after a warm-up pass) under torch.profiler: the operators by
    their own time (CUDA time on a GPU), with their call counts, written to `path`. Where the
    mode's learner cost goes: arithmetic, or the launches of its many small calls."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cuda = device.startswith("cuda")
    sampler, learner = sides(recipe, "bitwise", threads, device, qat)
    sampling = recipe.sampling
    rollouts = sampler.sample(prompts_of(recipe), params_of(recipe))
    learner_pass(sampler, learner, rollouts, recipe.optim.micro_batch_size, sampling.temperature, True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        learner_pass(sampler, learner, rollouts, recipe.optim.micro_batch_size, sampling.temperature, True)
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=40)
    calls = sum(e.count for e in events)
    path.write_text(f"bitwise learner pass, {calls} profiled events (nested calls counted too)\n{table}\n",
                    encoding="utf-8")
    print(f"profile of one bitwise learner pass ({calls} profiled events) written to {path}")


SECTION = "Bitwise on-policy on a CPU: what the batch-invariant mode costs (`bench/learner/on_policy_cost.py`)"


def result_rows(rows: dict[str, dict], name: str) -> list[dict]:
    """bench/results rows of a run (`measure`'s dicts for "off" and "bitwise") on recipe `name`."""
    off, on = rows["off"], rows["bitwise"]
    head = f"{name}, sampling.on_policy: bitwise"
    return [{"metric": f"{head}: sampling time against off", "value": rounded(on["sample_s"] / off["sample_s"], 1),
             "unit": "×", "ratio_to": f"off ({off['sample_s']:.2f} s)"},
            {"metric": f"{head}: learner log π forward + backward against off",
             "value": rounded(on["learner_s"] / off["learner_s"], 1), "unit": "×",
             "ratio_to": f"off ({off['learner_s']:.2f} s)"},
            {"metric": f"{name}: largest |log π − log μ| with the mode off", "value": float(f"{off['max_gap']:.3g}"),
             "unit": "nats"},
            {"metric": f"{head}: largest |log π − log μ|", "value": on["max_gap"], "unit": "nats"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as `k3post run` takes them")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the sampler and the learner's pass on the GPU")
    parser.add_argument("--profile", type=Path, help="also write a torch.profiler table of one bitwise learner pass here")
    parser.add_argument("--qat", action="store_true",
                        help="FP8 QAT with FP8 rollouts on its grid: a fake-quantised learner, an FP8 sampler")
    add_no_record(parser)
    args = parser.parse_args()
    recipe = load_run_recipe(args.recipe, args.overrides)
    if args.profile:
        profile_learner(recipe, args.threads, args.device, args.profile, args.qat)
    rows = {mode: measure(recipe, mode, args.repeats, args.threads, args.device, args.qat) for mode in ("off", "bitwise")}
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{args.threads} threads"
    print(f"{args.recipe}: {recipe.data.prompts_per_step} prompts x {recipe.sampling.max_new_tokens} new tokens, "
          f"micro-batch {recipe.optim.micro_batch_size}, {where}, median of {args.repeats}")
    print("| mode | sampling (s) | learner log π fwd+bwd (s) | tokens | max abs(log π − log μ) |")
    print("|---|---|---|---|---|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['sample_s']:.2f} | {row['learner_s']:.2f} | {row['tokens']} | {row['max_gap']:.3g} |")
    off, on = rows["off"], rows["bitwise"]
    print(f"bitwise / off: sampling x{on['sample_s'] / off['sample_s']:.1f}, "
          f"learner x{on['learner_s'] / off['learner_s']:.1f}")
    name = (f"{Path(args.recipe).stem} ({recipe.data.prompts_per_step} prompts × {recipe.sampling.max_new_tokens} "
            f"tokens{', ' + recipe.student.dtype if args.device.startswith('cuda') else ''}"
            f"{', FP8 QAT, FP8 rollouts' if args.qat else ''})")
    record_and_say("on-policy-cost", result_rows(rows, name), args.no_record,
                   source_section=ON_POLICY_SECTION if args.device.startswith("cuda") else SECTION)


if __name__ == "__main__":
    main()
