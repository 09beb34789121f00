"""Rollout and teacher-scoring engines side by side: HF transformers vs vLLM, same model, same
batch, same machine load (the engines alternate, repeat by repeat), plus the weight-sync time
of each vLLM transport.

    .venv/bin/python bench/vllm_vs_hf.py                       # SmolLM2-135M, 8 prompts x 64 tokens
    .venv/bin/python bench/vllm_vs_hf.py --batch 16 --tokens 32 --repeats 3

Sampling tokens/s counts generated tokens (up to each row's stop). Scoring tokens/s counts the
completion tokens scored (the prompt is in the same forward). Sync is the learner's full
weights applied to the engine (in-process transport, and the checkpoint-directory transport).
vLLM runs fp32 and eager on CPUs (bf16 is slow without AVX-512 BF16; compiling takes minutes).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def main() -> int:
    from k3post.config.schema import ModelSpec, TeacherSpec, VllmSpec  # noqa: PLC0415
    from k3post.data.builtin_prompts import builtin_prompt_set  # noqa: PLC0415
    from k3post.engine.common import quiet_libraries  # noqa: PLC0415
    from k3post.engine.sampler import HFSampler  # noqa: PLC0415
    from k3post.engine.teacher import TeacherScorer  # noqa: PLC0415
    from k3post.engine.vllm_engine import timed_sync  # noqa: PLC0415
    from k3post.engine.vllm_sampler import VLLMSampler  # noqa: PLC0415
    from k3post.engine.vllm_teacher import VLLMTeacher  # noqa: PLC0415
    from k3post.model.logprobs import completion_logprobs  # noqa: PLC0415
    from k3post.model.weights import export_weights  # noqa: PLC0415
    from k3post.types import Prompt, SamplingParams  # noqa: PLC0415

    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
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
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from re-running this
    raise SystemExit(main())
