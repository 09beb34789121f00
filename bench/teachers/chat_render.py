"""Rendering prompts through a chat template with a long system prompt: every row tokenized whole
against the shared head tokenized once (model/scoring/chat_render.py), side by side in one run.

A teacher with its own system prompt renders every batch it scores (and the teachers' answers)
from the rows' messages; so does a sampler with `sampling.system_prompt`. With the prompt-prefix
cache the model no longer runs the system prompt for every row, but tokenizing it for every row
is still there, on the engine's CPU. Per system prompt length: the median seconds of
`render_prompts` (each row's rendering tokenized whole, as before) and of `ChatRenderer` (the head
once per system prompt, each row's own part in one batched call) for the same rows; the ids are
checked equal.

    .venv/bin/python bench/teachers/chat_render.py                       # 32 rows, 0 / 256 / 1,024 / 2,048 / 4,096 tokens
    .venv/bin/python bench/teachers/chat_render.py --rows 8 --system-tokens 1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*

from bench.results import add_no_record, record_and_say  # noqa: E402
from bench.teachers.cross_tokenizer_cost import median_seconds  # noqa: E402
from bench.teachers.prefix_cases import system_prompt  # noqa: E402

SECTION = "Rendering prompts with a long system prompt (`bench/teachers/chat_render.py`)"


def measure(tokenizer, rows: int, system_tokens: int, repeats: int) -> dict:
    from bench.teachers.teacher_prefix_cache import rollouts_for  # noqa: PLC0415

    from k3post.model.scoring.chat_render import ChatRenderer  # noqa: PLC0415
    from k3post.model.generation.sampling import render_prompts  # noqa: PLC0415

    system = system_prompt(tokenizer, system_tokens)
    prompts = rollouts_for(tokenizer, rows, 1, 4).prompts
    renderer = ChatRenderer(tokenizer)
    whole = render_prompts(tokenizer, prompts, system)
    if renderer(prompts, system) != whole:  # also the warm-up: the first call builds the head
        raise SystemExit(f"the ids differ at a {system_tokens}-token system prompt")
    return {"system_tokens": system_tokens, "rows": rows, "prompt_tokens": sum(map(len, whole)) / rows,
            "whole": median_seconds(lambda: render_prompts(tokenizer, prompts, system), repeats),
            "head_once": median_seconds(lambda: renderer(prompts, system), repeats)}


def result_rows(measured: list[dict]) -> list[dict]:
    out = []
    for m in measured:
        label = f"SmolLM2 tokenizer, {m['rows']} rows, {m['system_tokens']}-token system prompt"
        out += [{"metric": f"render, every row whole, {label}", "value": round(m["whole"] * 1e3, 2), "unit": "ms"},
                {"metric": f"render, head tokenized once, {label}", "value": round(m["head_once"] * 1e3, 2),
                 "unit": "ms"},
                {"metric": f"render speed-up, {label}", "value": round(m["whole"] / m["head_once"], 1), "unit": "×",
                 "ratio_to": "render, every row whole"}]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, nargs="+", default=[0, 256, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    add_no_record(parser)
    args = parser.parse_args()

    from k3post.config.schema import ModelSpec  # noqa: PLC0415
    from k3post.model.loading.load import load_tokenizer  # noqa: PLC0415

    tokenizer = load_tokenizer(ModelSpec(builtin="smollm2-135m-instruct"))
    measured = [measure(tokenizer, args.rows, s, args.repeats) for s in args.system_tokens]
    print(f"\nprompts through SmolLM2's chat template, {args.rows} rows, median of {args.repeats}")
    print("| system tokens | prompt tokens a row | every row whole ms | head once ms | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    for m in measured:
        print(f"| {m['system_tokens']} | {m['prompt_tokens']:.0f} | {m['whole'] * 1e3:.2f} | "
              f"{m['head_once'] * 1e3:.2f} | {m['whole'] / m['head_once']:.1f}× |")
    record_and_say("chat-render", result_rows(measured), args.no_record, source_section=SECTION)


if __name__ == "__main__":
    sys.exit(main())
