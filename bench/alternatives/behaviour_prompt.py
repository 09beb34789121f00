"""Which system prompt does SmolLM2-135M-Instruct measurably follow? (the OPD benchmark's behaviour teacher)

For each candidate (a system prompt and the rule-based score of k3post/algo/text_metrics.py that
checks it), the model answers the same held-out chat prompts with the prompt and without it
(its template's default system prompt), one sample each at temperature 1, and the score's rate
is printed with a Wilson interval over prompts. A behaviour teacher needs a large gap with
intervals that do not overlap.

    .venv/bin/python bench/alternatives/behaviour_prompt.py                # 32 prompts x 48 tokens per arm
    .venv/bin/python bench/alternatives/behaviour_prompt.py --prompts 64 --show 3
    .venv/bin/python bench/alternatives/behaviour_prompt.py --teacher recipes/teachers/smollm2-style.yaml --score brief
                                              # a teacher file's (long) system prompt, scored by one rule

Each candidate's rates with and without its system prompt are appended to
bench/results/behaviour-prompt.jsonl (`results.record`); `--no-record` leaves the file alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3post.algo.eval_metrics import rate_estimate
from k3post.algo.text_metrics import behaviour_score
from k3post.config.schema import ModelSpec, TeacherSpec
from k3post.data.eval_sets import builtin_eval_set
from k3post.engine.common import quiet_libraries
from k3post.types import Prompt, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = ("OPD against off-policy distillation and TRL GKD at equal wall-clock "
           "(`bench/alternatives/opd_vs_alternatives.py`)")

CANDIDATES = (
    ("answer_prefix", "Always begin your reply with the word 'Answer:' and then answer in one sentence."),
    ("numbered_list", "Always answer as a numbered list of short points: 1., 2., 3."),
    ("brief", "You are a terse assistant. Reply with one short sentence only, never more than ten words."),
)


def sample_texts(model, system_prompt: str | None, prompts: list[Prompt], max_new_tokens: int, batch: int
                 ) -> list[str]:
    """One sample per prompt from the model behind `system_prompt` (None: its template's default)."""
    model.spec = model.spec.model_copy(update={"system_prompt": system_prompt})
    texts = []
    for b in range(0, len(prompts), batch):
        texts += model.sample(prompts[b:b + batch], SamplingParams(max_new_tokens, 1.0, 1.0, seed=b)).texts
    return texts


def result_rows(rates: dict[str, tuple], prompts: int, max_new_tokens: int, teacher: str | None = None) -> list[dict]:
    """`rates`: score name -> (with, without), each a rate_estimate (value, low, high); two
    decimals, as the table, the 95% Wilson interval in the notes. With `teacher` (a teacher file's
    system prompt) the rows name the file: they are not the built-in candidate's."""
    head = f"SmolLM2-135M-Instruct, {prompts} held-out chat prompts × {max_new_tokens} new tokens"
    if teacher:
        head += f", the system prompt of {teacher}"
    rows = []
    for name, pair in rates.items():
        for arm, r in zip(("with", "without"), pair):
            rows.append({"metric": f"{head}: `{name}` rate {arm} its system prompt", "value": rounded(r.value, 2),
                         "unit": "rate", "notes": f"95% interval [{r.low:.2f}, {r.high:.2f}]"})
    return rows


def main() -> int:
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--show", type=int, default=2, help="samples printed per arm")
    parser.add_argument("--only", default="", help="comma-separated score names")
    add_no_record(parser)
    parser.add_argument("--teacher", help="score this teacher YAML's system prompt instead of the built-in candidates")
    parser.add_argument("--score", default="brief", help="with --teacher: the behaviour score that checks it")
    args = parser.parse_args()
    candidates = CANDIDATES
    if args.teacher:
        from k3post.config.load import load_recipe  # noqa: PLC0415

        candidates = ((args.score, load_recipe(args.teacher).system_prompt),)
    rows = builtin_eval_set("heldout-chat")[:args.prompts]
    prompts = [Prompt(r["id"], "chat", "t", (("user", r["prompt"]),)) for r in rows]
    from k3post.engine.evaluation.eval_model import HFEvalModel  # noqa: PLC0415

    model = HFEvalModel("smollm2", TeacherSpec(model=ModelSpec(builtin="smollm2-135m-instruct")))
    baseline = sample_texts(model, None, prompts, args.max_new_tokens, 16)
    print("| score | system prompt | rate with [95% CI] | rate without [95% CI] | n |\n|---|---|---|---|---|")
    shown, rates = [], {}
    for name, system in candidates:
        if args.only and name not in args.only.split(","):
            continue
        texts = sample_texts(model, system, prompts, args.max_new_tokens, 16)
        with_ = rate_estimate([behaviour_score(name, t) for t in texts])
        without = rate_estimate([behaviour_score(name, t) for t in baseline])
        shown_system = system if len(system) < 200 else f"{args.teacher} ({len(system.split())} words)"
        print(f"| {name} | {shown_system} | {with_.value:.2f} [{with_.low:.2f}, {with_.high:.2f}] | "
              f"{without.value:.2f} [{without.low:.2f}, {without.high:.2f}] | {len(texts)} |", flush=True)
        shown += [(name, "with", t) for t in texts[:args.show]]
        rates[name] = (with_, without)
    shown += [("-", "without", t) for t in baseline[:args.show]]
    for name, arm, text in shown:
        print(f"\n[{name} {arm}] {text!r}")
    record_and_say("behaviour-prompt", result_rows(rates, len(prompts), args.max_new_tokens, args.teacher),
                   args.no_record, source_section=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
