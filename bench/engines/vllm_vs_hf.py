"""Rollout and teacher-scoring engines side by side: HF transformers vs vLLM, same model, same
batch, same machine load (the engines alternate, repeat by repeat), plus the weight-sync time
of each vLLM transport.

    .venv/bin/python bench/engines/vllm_vs_hf.py                       # SmolLM2-135M, 8 prompts x 64 tokens
    .venv/bin/python bench/engines/vllm_vs_hf.py --batch 16 --tokens 32 --repeats 3

Sampling tokens/s counts generated tokens (up to each row's stop). Scoring tokens/s counts the
completion tokens scored (the prompt is in the same forward). Sync is the learner's full
weights applied to the engine (in-process transport, and the checkpoint-directory transport).
vLLM runs fp32 and eager on CPUs (bf16 is slow without AVX-512 BF16; compiling takes minutes).

The tokens/s, their ratios, the parity gaps, the engines' start and the syncs are appended to
bench/results/rollout-engines.jsonl (`results.record`); `--no-record` leaves the file alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from decimal import Decimal
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "Rollout and scoring engines: HF vs vLLM (`bench/engines/vllm_vs_hf.py`)"


def result_rows(batch: int, tokens: int, rates: dict, gaps: tuple[float, float], init: tuple[float, float],
                sync: dict[str, float]) -> list[dict]:
    """Rows as the run prints them: `rates` maps "sample hf", "sample vllm", "score hf", "score vllm"
    to the median tokens/s; `gaps` the teacher's and the sampler's max |Δ logprob| against HF;
    `init` the HF and vLLM engines' start seconds; `sync` the vLLM weight-sync seconds by transport."""
    head = f"SmolLM2-135M fp32, {batch} prompts × {tokens} new tokens"
    what = {"sample": "sampling, generated tokens/s", "score": "teacher scoring, completion tokens/s"}
    rows = []
    for phase, name in what.items():
        hf, vllm = rates[f"{phase} hf"], rates[f"{phase} vllm"]
        rows += [{"metric": f"{head}: HF {name}", "value": rounded(hf, 1), "unit": "tokens/s"},
                 {"metric": f"{head}: vLLM {name}", "value": rounded(vllm, 1), "unit": "tokens/s"},
                 {"metric": f"{head}: vLLM against HF, {name}", "value": rounded(vllm / hf, 2), "unit": "×",
                  "ratio_to": "HF"}]
    rows += [{"metric": f"{head}: max |Δ logprob| vLLM vs HF, teacher scores", "value": Decimal(f"{gaps[0]:.1e}"),
              "unit": "nats"},
             {"metric": f"{head}: max |Δ logprob| vLLM vs HF, the sampler's recorded logprobs",
              "value": Decimal(f"{gaps[1]:.1e}"), "unit": "nats"},
             {"metric": f"{head}: engine start, HF sampler + teacher", "value": rounded(init[0], 1), "unit": "s"},
             {"metric": f"{head}: engine start, vLLM sampler + teacher", "value": rounded(init[1], 1), "unit": "s"}]
    rows += [{"metric": f"{head}: weight sync into vLLM, `{how}`", "value": rounded(seconds, 2), "unit": "s"}
             for how, seconds in sync.items()]
    return rows


def main() -> int:
    from k3post.config.schema import ModelSpec, TeacherSpec, VllmSpec  # noqa: PLC0415
    from k3post.data.builtin_prompts import builtin_prompt_set  # noqa: PLC0415
    from k3post.engine.common import quiet_libraries  # noqa: PLC0415
    from k3post.engine.samplers.sampler import HFSampler  # noqa: PLC0415
    from k3post.engine.teachers.teacher import TeacherScorer  # noqa: PLC0415
    from k3post.engine.vllm.vllm_engine import timed_sync  # noqa: PLC0415
    from k3post.engine.samplers.vllm_sampler import VLLMSampler  # noqa: PLC0415
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher  # noqa: PLC0415
    from k3post.model.scoring.logprobs import completion_logprobs  # noqa: PLC0415
    from k3post.model.training.weights import export_weights  # noqa: PLC0415
    from k3post.types import Prompt, SamplingParams  # noqa: PLC0415

    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    add_no_record(parser)
    args = parser.parse_args()

    spec = ModelSpec(builtin="smollm2-135m-instruct")
    engine = VllmSpec(dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_gib=1.0)
    rows = builtin_prompt_set("chat")[: args.batch]
    prompts = [Prompt(f"b{i}", "chat", "t", (("user", row["prompt"]),)) for i, row in enumerate(rows)]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, seed=0)

    started = time.perf_counter()
    hf_sampler, hf_teacher = HFSampler(spec), TeacherScorer("t", TeacherSpec(model=spec))
    hf_init = time.perf_counter() - started
    started = time.perf_counter()
    vllm_sampler = VLLMSampler(spec, engine)
    vllm_teacher = VLLMTeacher("t", TeacherSpec(model=spec, engine="vllm", vllm=engine))
    vllm_init = time.perf_counter() - started

    timings: dict[str, list[float]] = {}

    def timed(key: str, fn, tokens_of) -> None:
        begin = time.perf_counter()
        out = fn()
        timings.setdefault(key, []).append(tokens_of(out) / (time.perf_counter() - begin))

    rollouts = hf_sampler.sample(prompts, params)
    for _ in range(args.repeats):  # alternate, so both engines see the same load
        timed("sample hf", lambda: hf_sampler.sample(prompts, params), lambda r: r.num_tokens())
        timed("sample vllm", lambda: vllm_sampler.sample(prompts, params), lambda r: r.num_tokens())
        timed("score hf", lambda: hf_teacher.score(rollouts), lambda _: rollouts.num_tokens())
        timed("score vllm", lambda: vllm_teacher.score(rollouts), lambda _: rollouts.num_tokens())

    # Parity on the real model: the same token ids scored by both teachers, and the vLLM
    # sampler's recorded logprobs against HF's of the tokens it drew.
    mask = rollouts.loss_mask_BT.bool()
    teacher_gap = (vllm_teacher.score(rollouts) - hf_teacher.score(rollouts))[mask].abs().max().item()
    drawn = vllm_sampler.sample(prompts, params)
    hf_of_drawn = completion_logprobs(hf_sampler.model, drawn.prompt_ids, drawn.completion_ids_BT,
                                      drawn.loss_mask_BT, hf_sampler.tokenizer.pad_token_id, params.temperature)
    sampler_gap = (drawn.sampler_logprobs_BT - hf_of_drawn)[drawn.loss_mask_BT.bool()].abs().max().item()

    weights = export_weights(hf_sampler.model)
    sync = {how: statistics.median(timed_sync(vllm_sampler.llm, weights, how) for _ in range(args.repeats))
            for how in ("in_place", "checkpoint")}

    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}; model SmolLM2-135M fp32; batch {args.batch} x {args.tokens} new tokens; "
          f"median of {args.repeats}")
    print(f"engine init: hf {hf_init:.1f}s (sampler + teacher), vllm {vllm_init:.1f}s (sampler + teacher)\n")
    print(f"| {'phase':<8} | {'hf tok/s':>9} | {'vllm tok/s':>10} | {'vllm / hf':>9} |")
    print(f"|{'-' * 10}|{'-' * 11}|{'-' * 12}|{'-' * 11}|")
    for phase in ("sample", "score"):
        hf, vllm = statistics.median(timings[f"{phase} hf"]), statistics.median(timings[f"{phase} vllm"])
        print(f"| {phase:<8} | {hf:>9.1f} | {vllm:>10.1f} | {vllm / hf:>8.2f}x |")
    print(f"\nparity, max |Δ logprob| vs HF: teacher scores {teacher_gap:.1e}, sampler's recorded logprobs "
          f"{sampler_gap:.1e} ({int(mask.sum())} and {int(drawn.loss_mask_BT.sum())} tokens)")
    size_mb = sum(w.nbytes for w in weights.values()) / 2**20
    print(f"\nweight sync of {size_mb:.0f} MB into vLLM: in_place {sync['in_place']:.2f}s, "
          f"checkpoint {sync['checkpoint']:.2f}s")
    rates = {key: statistics.median(values) for key, values in timings.items()}
    record_and_say("rollout-engines", result_rows(args.batch, args.tokens, rates, (teacher_gap, sampler_gap),
                                                  (hf_init, vllm_init), sync), args.no_record, source_section=SECTION)
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from re-running this
    raise SystemExit(main())
