"""What the cross-tokenizer path costs a teacher per step, against the direct path, side by side.

The SmolLM2-135M-Instruct teacher scores the same batch (the quickstart's shape: 8 prompts, the
teacher's own answers of up to 48 tokens as the completions) three ways, in one process:

    direct       TeacherScorer.score on the student's ids (same tokenizer: today's path)
    cross-same   CrossTokenizerTeacher with `mode: always` on the same tokenizer (the text path's
                 whole cost: bytes, re-tokenization, alignment, projection, on identical ids)
    cross-12k    CrossTokenizerTeacher for a student transplanted onto a 12,000-token BPE (the
                 completions re-tokenized with the student's tokenizer first)

Per arm: the median step time of scoring over `--repeats`, the part of it spent reading the text
(re-tokenizing and aligning: `TextReader.teacher_view`), and the bytes of the answer the driver gets
([B, T] logprobs, the same for every arm: the teacher's ids never leave its actor).

    .venv/bin/python bench/teachers/cross_tokenizer_cost.py [--repeats 5] [--json out.json] [--no-record]

At the end each arm's score time, the part spent reading the text, its ratio to the direct arm and
the bytes to the driver are appended to bench/results/cross-tokenizer-cost.jsonl (`results.record`;
the rows they replace marked "current": false); `--no-record` leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = ("Distilling across tokenizers "
           "(`bench/teachers/cross_tokenizer_arms.py`, `bench/teachers/cross_tokenizer_cost.py`)")
ARM_NAMES = {"direct": "direct (same tokenizer)", "cross-same": "cross path on the same tokenizer (`mode: always`)",
             "cross-12k": "cross path, 12k-token student"}


def result_rows(results: list[dict]) -> list[dict]:
    """bench/results rows of the arms (the first is the direct one): score time and the time reading
    the text (3 decimals, s), the score time against direct (2 decimals), the bytes to the driver."""
    base, rows = results[0]["score_s"], []
    for r in results:
        name = ARM_NAMES[r["arm"]]
        if r["arm"] == "direct":
            rows.append({"metric": f"{name}: teacher score time for the quickstart's batch",
                         "value": rounded(r["score_s"], 3), "unit": "s"})
        else:
            rows += [{"metric": f"{name}: score time", "value": rounded(r["score_s"], 3), "unit": "s"},
                     {"metric": f"{name}: reading the text", "value": rounded(r["read_text_s"], 3), "unit": "s"},
                     {"metric": f"{name}: score time against direct", "value": rounded(r["score_s"] / base, 2),
                      "unit": "×", "ratio_to": "direct"}]
        rows.append({"metric": f"{name}: bytes to the driver", "value": r["driver_bytes"], "unit": "bytes"})
    return rows


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def student_rollouts(tokenizer, prompts, texts, end_id):
    """The teacher's answers as a student with `tokenizer` would have sampled them."""
    import torch  # noqa: PLC0415

    from k3post.model.generation.sampling import render_prompts  # noqa: PLC0415
    from k3post.types import Rollouts  # noqa: PLC0415

    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [end_id] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    return Rollouts(prompts, render_prompts(tokenizer, prompts), ids, mask, -torch.rand(ids.shape) * mask, texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    add_no_record(parser)
    args = parser.parse_args()

    import torch  # noqa: PLC0415

    from k3post.config.model_schema import TransplantSpec  # noqa: PLC0415
    from k3post.config.schema import ModelSpec, TeacherSpec  # noqa: PLC0415
    from k3post.data.builtin_prompts import builtin_prompt_set  # noqa: PLC0415
    from k3post.engine.teachers.cross_teacher import CrossTokenizerTeacher  # noqa: PLC0415
    from k3post.engine.teachers.teacher import TeacherScorer  # noqa: PLC0415
    from k3post.types import Prompt, SamplingParams, tensor_bytes  # noqa: PLC0415

    torch.set_num_threads(2)
    smol = ModelSpec(builtin="smollm2-135m-instruct")
    transplanted = ModelSpec(transplant=TransplantSpec(base=smol, vocab_size=12000))
    spec = TeacherSpec(model=smol, cross_tokenizer={"mode": "always"})
    direct = TeacherScorer("chat", spec)
    rows = builtin_prompt_set("chat")[:4] + builtin_prompt_set("math")[:4]
    prompts = [Prompt(str(i), "s", "chat", (("user", r["prompt"]),)) for i, r in enumerate(rows)]
    answers = direct.sample(prompts, SamplingParams(max_new_tokens=48, seed=0))
    arms = {"direct": (direct, smol), "cross-same": (CrossTokenizerTeacher("chat", spec, smol), smol),
            "cross-12k": (CrossTokenizerTeacher("chat", spec, transplanted), transplanted)}
    results = []
    for name, (engine, student) in arms.items():
        tokenizer = engine.tokenizer if name == "direct" else engine.reader.student.tokenizer
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        batch = student_rollouts(tokenizer, prompts, answers.texts, end)
        engine.score(batch)  # warm-up
        total = median_seconds(lambda: engine.score(batch), args.repeats)
        reading = 0.0 if name == "direct" else median_seconds(lambda: engine.reader.teacher_view(batch), args.repeats)
        results.append({"arm": name, "student_tokens": batch.num_tokens(), "score_s": total, "read_text_s": reading,
                         "driver_bytes": tensor_bytes(engine.score(batch))})
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rows": results}, indent=2))
    rows = [{**r, "notes": f"median of {args.repeats}, same process"} for r in result_rows(results)]
    record_and_say("cross-tokenizer-cost", rows, args.no_record, source_section=SECTION)


def print_table(results: list[dict]) -> None:
    base = results[0]["score_s"]
    print(f"\n| arm | student tokens | score s (median) | reading the text s | × direct | driver bytes |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['arm']} | {r['student_tokens']} | {r['score_s']:.3f} | {r['read_text_s']:.4f} | "
              f"{r['score_s'] / base:.2f} | {r['driver_bytes']:,} |")


if __name__ == "__main__":
    main()
