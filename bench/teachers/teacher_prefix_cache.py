"""The HF teacher's scoring phase with and without its prompt-prefix cache, side by side in one run.

Per (system prompt length, sampling.n): one `TeacherScorer` scores the same rollouts twice —
"today" (teacher `prefix_cache: false`: every row's whole prompt through the decoder) and
"cached" (the system prompt and the template's fixed head encoded once for the run, each
distinct prompt once per batch, completions scored as continuations: engine/teachers/teacher_prefix.py).
`--attention` picks how the cached arms attend the shared prefix (model/scoring/prefix_scoring.py:
PREFIX_ATTENTION): `split` once for all rows (model/scoring/shared_prefix_attention.py), `concat` expanded
in front of every row's keys, `auto` (the default) split on a CPU and concat elsewhere; a second
and third name add cached arms, side by side (on a GPU: `--attention concat split`).
It prints the median teacher-phase seconds of both, their ratio, the prompt tokens the decoder
ran in each, the largest |Δ| between the two scores (the cache is exact: fp32 ≤ 1e-5), and, for
n > 1, the prompt tokens the HF sampler's prefill runs with and without its group prefill.

Rollouts: `--prompts` distinct chat prompts, each repeated n times (a group per prompt), with
`--new-tokens` random completion tokens per row (scoring cost does not depend on what the tokens
are). The system prompt is a style guide cut to the asked number of tokens.

    python bench/teachers/teacher_prefix_cache.py                                  # CPU: SmolLM2-135M teacher
    python bench/teachers/teacher_prefix_cache.py --cases 1024:1 0:4 --repeats 1 --threads 2   # the CPU targets only
    python bench/teachers/teacher_prefix_cache.py --device cuda --gpu-shapes --tokenizer .gpu-tokenizer \\
        --prompts 32 --new-tokens 256 --cases 2048:1 0:4 2048:4          # H200: 1.39B teacher, bf16
    python bench/teachers/teacher_prefix_cache.py --device cuda --gpu-shapes --tokenizer .gpu-tokenizer \
        --prompts 32 --new-tokens 256 --cases 2048:1 2048:4 --attention concat split   # H200: both formulations

`--profile` prints, per case, the top GPU kernels (or CPU ops) of one more call of the last arm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*

from bench.teachers.prefix_cases import SECTION, system_prompt  # noqa: E402

QUESTIONS = ["What is the boiling point of water at high altitude, and why?", "Name three prime numbers above 50.",
             "Explain what a hash table is.", "How do vaccines train the immune system?",
             "Summarise the causes of the French Revolution.", "What does a compiler do?",
             "Why is the sky blue?", "Give a short definition of entropy.", "How do tides work?",
             "What is the difference between RAM and disk storage?", "How does a bicycle stay upright?",
             "What is photosynthesis?"]


def gpu_teacher(tokenizer_dir: Path, root: Path) -> "ModelSpec":
    """The random-init 1.39B Qwen2 teacher of bench/opd/opd_step_gpu.py (bf16), saved once."""
    from bench.opd.opd_step_gpu import SHAPES, save_random_model  # noqa: PLC0415
    from k3post.config.schema import ModelSpec  # noqa: PLC0415

    path, _ = save_random_model("teacher", SHAPES["teacher"], tokenizer_dir, root, "cpu")
    return ModelSpec(path=str(path), dtype="bfloat16")


def rollouts_for(tokenizer, prompts: int, n: int, new_tokens: int):
    """`prompts` distinct prompts × n rows each, with random completions (a few end early)."""
    import torch  # noqa: PLC0415

    from k3post.model.generation.sampling import render_prompts  # noqa: PLC0415
    from k3post.types import Prompt, Rollouts  # noqa: PLC0415

    chats = [Prompt(f"p{i}", "bench", "t", (("user", QUESTIONS[i % len(QUESTIONS)] + f" ({i})"),))
             for i in range(prompts)]
    rows = [p for p in chats for _ in range(n)]
    g = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(100, 40000, (len(rows), new_tokens), generator=g)
    lengths_B = torch.randint(new_tokens // 2, new_tokens + 1, (len(rows),), generator=g)
    mask_BT = (torch.arange(new_tokens)[None, :] < lengths_B[:, None]).float()
    student_ids = render_prompts(tokenizer, rows)
    return Rollouts(rows, student_ids, ids_BT * mask_BT.long(), mask_BT, torch.zeros_like(mask_BT))


def timed_scores(scorer, rollouts, repeats: int, warmup: bool = True) -> tuple[float, "torch.Tensor", dict]:
    """The median wall time of `score` over `repeats` runs after one warm-up (unless not
    `warmup`), its last scores and counts."""
    import torch  # noqa: PLC0415

    if warmup:
        scorer.score(rollouts)
    scorer.prefix_counts()
    times = []
    for _ in range(repeats):
        if scorer.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        scores = scorer.score(rollouts)
        times.append(time.perf_counter() - started)
    counts = scorer.prefix_counts()
    return statistics.median(times), scores, {k: v / repeats for k, v in counts.items()}


def sampler_prefill(model, tokenizer, rollouts) -> tuple[int, int]:
    """Prompt tokens the HF sampler's prefill runs for these rows: grouped, and every row whole."""
    import torch  # noqa: PLC0415

    from k3post.model.generation.sampling import group_prefill  # noqa: PLC0415

    P = max(len(p) for p in rollouts.prompt_ids)
    ids = torch.full((len(rollouts.prompt_ids), P), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(rollouts.prompt_ids):
        ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        _, grouped = group_prefill(model, ids, mask)
    return grouped, ids.numel()


def arms(attention: list[str]) -> list[tuple[str, bool, str | None]]:
    """(name, prefix cache on, how the shared prefix is attended) of each arm: today, then the
    cache per attention formulation (model/scoring/prefix_scoring.py: PREFIX_ATTENTION); the first is "cached"."""
    return [("today", False, None)] + [("cached" if i == 0 else f"cached, {mode} attention", True, mode)
                                       for i, mode in enumerate(attention)]


def measure(scorer, tokenizer, spec, sys_tokens: int, n: int, args) -> dict:
    """One row of the table: today vs cached for this system prompt length and n."""
    from k3post.engine.teachers.teacher_prefix import TeacherPrefix  # noqa: PLC0415
    from k3post.model.scoring import prefix_scoring  # noqa: PLC0415

    system = system_prompt(tokenizer, sys_tokens)
    scorer.spec = spec.model_copy(update={"system_prompt": system})
    rollouts = rollouts_for(tokenizer, args.prompts, n, args.new_tokens)
    out = {"system_tokens": sys_tokens, "n": n, "rows": len(rollouts.prompt_ids)}
    for arm, enabled, attention in arms(args.attention):
        prefix_scoring.PREFIX_ATTENTION = attention or "auto"
        scorer.prefix = TeacherPrefix("bench", scorer.model, scorer.tokenizer, enabled, system)
        repeats = args.repeats if enabled or args.today_repeats is None else args.today_repeats
        seconds, scores, counts = timed_scores(scorer, rollouts, repeats, warmup=repeats > 1)
        out[arm] = {"seconds": seconds, "encoded": counts["prompt_tokens_encoded"],
                    "prompt_tokens": counts["prompt_tokens"], "scores": scores,
                    "max_abs_diff": float((out["today"]["scores"] - scores).abs().max()) if enabled else 0.0}
    out["max_abs_diff"] = out["cached"]["max_abs_diff"]
    if args.profile:
        # the scorer is left as the last arm set it up
        print_profile(scorer, rollouts, f"{sys_tokens}-token system prompt, n = {n}, {arms(args.attention)[-1][0]}")
    if n > 1:
        out["sampler_prefill"] = sampler_prefill(scorer.model, tokenizer, rollouts)
    return out


def print_profile(scorer, rollouts, what: str, top: int = 12) -> None:
    """The top kernels (self time) of one `score` call, as torch's profiler counts them."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cuda = scorer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        scorer.score(rollouts)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"\nprofile of one call, {what}:")
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=70), flush=True)


def print_table(rows: list[dict], where: str) -> None:
    print(f"\nteacher phase (TeacherScorer.score), {where}")
    print("| system tokens | n | rows | today s | cached s | speed-up | prompt tokens encoded today → cached "
          "| max abs diff | sampler prefill tokens whole → grouped |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for r in rows:
        t, c = r["today"], r["cached"]
        prefill = (f"{r['sampler_prefill'][1]:,} → {r['sampler_prefill'][0]:,}" if "sampler_prefill" in r else "-")
        print(f"| {r['system_tokens']} | {r['n']} | {r['rows']} | {t['seconds']:.3f} | {c['seconds']:.3f} | "
              f"{t['seconds'] / c['seconds']:.2f}× | {t['encoded']:,.0f} → {c['encoded']:,.0f} "
              f"(÷{t['encoded'] / max(c['encoded'], 1):.1f}) | {r['max_abs_diff']:.1e} | {prefill} |")
    for r in rows:
        for arm in [a for a in r if a.startswith("cached, ")]:
            print(f"  {r['system_tokens']}-token system prompt, n = {r['n']}: {arm}: {r[arm]['seconds']:.3f} s, "
                  f"{r['today']['seconds'] / r[arm]['seconds']:.2f}× today, max abs diff {r[arm]['max_abs_diff']:.1e}")


def result_rows(rows: list[dict], where: str) -> list[dict]:
    out = []
    for r in rows:
        label = f"{where}, {r['system_tokens']}-token system prompt, n = {r['n']}, {r['rows']} rows"
        t, c = r["today"], r["cached"]
        out += [{"metric": f"teacher phase today, {label}", "value": round(t["seconds"], 4), "unit": "s"},
                {"metric": f"teacher phase cached, {label}", "value": round(c["seconds"], 4), "unit": "s"},
                {"metric": f"teacher phase speed-up, {label}", "value": round(t["seconds"] / c["seconds"], 2),
                 "unit": "×", "ratio_to": "teacher phase today"},
                {"metric": f"teacher prompt tokens encoded today / cached, {label}",
                 "value": round(t["encoded"] / max(c["encoded"], 1), 2), "unit": "×",
                 "notes": f"{t['encoded']:.0f} -> {c['encoded']:.0f}; max |diff| {r['max_abs_diff']:.1e}"}]
        for arm in [a for a in r if a.startswith("cached, ")]:
            out.append({"metric": f"teacher phase {arm}, {label}", "value": round(r[arm]["seconds"], 4), "unit": "s",
                        "notes": f"max |diff| {r[arm]['max_abs_diff']:.1e}"})
        if "sampler_prefill" in r:
            whole, grouped = r["sampler_prefill"][1], r["sampler_prefill"][0]
            out.append({"metric": f"sampler prefill tokens whole / grouped, {label}",
                        "value": round(whole / grouped, 2), "unit": "×", "notes": f"{whole} -> {grouped}"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gpu-shapes", action="store_true", help="the random-init 1.39B teacher of opd_step_gpu.py")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory for --gpu-shapes (SmolLM2's)")
    parser.add_argument("--system-tokens", type=int, nargs="+", default=[0, 256, 1024, 4096])
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--cases", nargs="+", metavar="TOKENS:N",
                        help="only these (system tokens, n) pairs instead of the grid, e.g. 1024:1 0:4")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--today-repeats", type=int, default=None,
                        help="timed runs of the uncached arm (default: --repeats); 1 also skips its warm-up "
                             "(for long prompts, where one uncached pass takes minutes on a CPU)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attention", nargs="+", choices=["auto", "split", "concat"], default=["auto"],
                        help="how the cached arms attend the shared prefix: split (once for all rows, merged by "
                             "log-sum-exp), concat (expanded in front of every row's keys), auto (the default: "
                             "split on a CPU, concat elsewhere); the first is the 'cached' arm")
    parser.add_argument("--no-record", action="store_true", help="do not append the rows to bench/results")
    parser.add_argument("--profile", action="store_true", help="profile one more call of each case's last arm")
    args = parser.parse_args()
    if args.gpu_shapes and args.tokenizer is None:
        parser.error("--gpu-shapes needs --tokenizer (a directory with SmolLM2's tokenizer files)")

    from k3post.config.schema import ModelSpec, ResourceSpec, TeacherSpec  # noqa: PLC0415
    from k3post.engine.teachers.teacher import TeacherScorer  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        model = (gpu_teacher(args.tokenizer, Path(tmp)) if args.gpu_shapes
                 else ModelSpec(builtin="smollm2-135m-instruct"))
        gpus = 1 if args.device == "cuda" else 0
        spec = TeacherSpec(model=model, resources=ResourceSpec(num_gpus=gpus))
        scorer = TeacherScorer("bench", spec, args.threads)
        where = ("1.39B random-init Qwen2 teacher, bf16" if args.gpu_shapes else "SmolLM2-135M teacher, fp32") + \
            f", {args.device}, {args.prompts} prompts × n, {args.new_tokens} new tokens"
        cases = ([tuple(int(x) for x in c.split(":")) for c in args.cases] if args.cases
                 else [(s, n) for s in args.system_tokens for n in args.n])
        scorer.score(rollouts_for(scorer.tokenizer, 2, 1, 8))  # the process's first forward, untimed
        rows = [measure(scorer, scorer.tokenizer, spec, s, n, args) for s, n in cases]
    print_table(rows, where)
    if not args.no_record:
        from bench.results import record  # noqa: PLC0415

        written = record("teacher-prefix-cache", result_rows(rows, where), source_section=SECTION)
        print(f"appended {len(written)} rows to bench/results/teacher-prefix-cache.jsonl; "
              "re-render the docs with .venv/bin/python bench/render_tables.py")


if __name__ == "__main__":
    sys.exit(main())
