"""Distilling across tokenizers, arm against arm, at equal steps: the split modes, the dense loss on
the mapped support, and the other route (the student moved onto the teachers' tokenizer).

Every arm is `k3post run` of a recipe with overrides, one after another on the same machine; the
table is the held-out per-byte KLs (the metric that means the same for any tokenizer pair) at each
evaluation, with the training seconds spent to get there (the sum of `time/step_s`: sampling,
scoring, learning, weight sync; start-up and evaluations excluded) and, since the machine's cores
all work on a step, the CPU-seconds that bounds (training seconds × cores).

    uniform      recipes/bench/cross-tokenizer-arms.yaml (the default split): the shipped recipe
                 recipes/distill/cross-tokenizer.yaml as it was until 2026-12-05, the base of every
                 arm below. Its student had the tied transplant head until 2026-12-05 and
                 `head: chain` since: the rows of the arms measured before (all but *-chain and
                 mixed-family) are the tied head's
    uniform-tied the recipe with `head: tied` (to re-measure those arms' student)
    broadcast    the same, cross_tokenizer.split=broadcast for both teachers
    one_to_one   the same, cross_tokenizer.split=one_to_one
    dense        the same, loss topk_reverse k=64 on the mapped support (1:1 chunks), the
                 sampled-token loss on every other position
    dense_forward  the same with topk_forward (the teacher's top-64 mapped, forward KL)
    dense_jsd    the same with topk_jsd (beta 0.5)
    answers      uniform, and the teachers also answer 4 of the 8 prompts a step, learned by
                 likelihood (loss.teacher_answers: the forward KL's gradient)
    answers8     the same with all 8 prompts answered
    answers-c2-lr4  answers with their likelihood weighted 2 (`coef`), the learning rate 4e-4
    other-route  recipes/bench/transplant-back-opd.yaml: the same 12k student transplanted onto
                 SmolLM2's tokenizer, distilled on the same-tokenizer path (sampled-token)
    uniform-chain, answers-chain
                 uniform and answers with `head: chain` set explicitly (the student's own head
                 keeping SmolLM2's next-token probabilities: docs/transplant.md)
    uniform-chain-lr4  uniform-chain at the learning rate 4e-4
    dense-chain, dense-forward-chain
                 dense and dense_forward on the recipe's student (`head: chain`)
    dense-prefix-chain  dense-chain on the prefix projection (`cross_tokenizer.dense_support: prefix`)
    dense-prefix-chain-lr4  the same at the learning rate 4e-4
    dense-forward-prefix-chain  dense-forward-chain on the prefix projection
    dense-prefix-answers-chain  dense-prefix-chain with the teachers answering 4 prompts a step
    dense-prefix-answers-half-chain  dense-prefix-answers-chain with the answers weighted 0.5 (`coef`)
    dense-prefix-answers-tied, dense-prefix-answers-half-tied, dense-prefix-answers-3q-tied
                 dense-prefix-answers-chain on the tied head (`head: tied`, the transplant's
                 default), the answers weighted 1, 0.5 and 0.75; the first, at 40 steps, is the
                 shipped recipe since 2026-12-05 (tests/unit/test_cross_tokenizer_recipe.py)
    dense-forward-prefix-answers-tied  the same (4 answers) with `topk_forward` k 64 on the prefix support
    dense512-prefix-answers-chain  dense-prefix-answers-chain with k = 512: the tail bin the student
                 may fill with any tokens shrinks from the teacher's mass outside its top 64 to outside 512
    mixed-family recipes/distill/mixed-family.yaml: the pruned SmolLM2 student (its own
                 tokenizer), a same-tokenizer chat teacher and a 16k-BPE math teacher; also
                 records the math teacher's alignment figures (align/*/math)
    mixed-family-math-half  the same with the math teacher's term weighted 0.5 (its `loss.coef`)

    .venv/bin/python bench/teachers/cross_tokenizer_arms.py [--arms uniform broadcast ...] [--steps 28] [--eval-prompts 16]
        [--out runs/bench-cross-tokenizer] [--plot docs/figures/cross-tokenizer.png] [--reuse] [--no-record]

At the end each arm's final evaluation (reverse and forward KL per byte for each teacher, and the
training seconds) is appended to bench/results/cross-tokenizer.jsonl with `results.record` (date,
commit, machine and command filled in; the rows it replaces marked "current": false); then
`.venv/bin/python bench/render_tables.py` puts them into docs/benchmarks.md's current figures.
`--no-record` leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import record_and_say  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CROSS = "recipes/bench/cross-tokenizer-arms.yaml"  # recipes/distill/cross-tokenizer.yaml until 2026-12-05
BOTH = ("chat", "math")


def each_teacher(setting: str) -> list[str]:
    """One override per teacher: `teachers.<t>.<setting>`."""
    return [f"teachers.{t}.{setting}" for t in BOTH]


REVERSE_64 = each_teacher("loss={kind: topk_reverse, k: 64}")
REVERSE_512 = each_teacher("loss={kind: topk_reverse, k: 512}")
FORWARD_64 = each_teacher("loss={kind: topk_forward, k: 64}")
PREFIX = each_teacher("cross_tokenizer.dense_support=prefix")
TIED = ["student.transplant.head=tied"]


def answers(coef: float = 1.0) -> list[str]:
    """The teachers answer 4 of the step's 8 prompts, their likelihood weighted `coef`."""
    return [f"loss.teacher_answers={{prompts_per_step: 4, coef: {coef}}}"]


ARMS = {
    "uniform": (CROSS, []),
    "broadcast": (CROSS, each_teacher("cross_tokenizer.split=broadcast")),
    "one_to_one": (CROSS, each_teacher("cross_tokenizer.split=one_to_one")),
    "dense": (CROSS, REVERSE_64),
    "dense_forward": (CROSS, FORWARD_64),
    "dense_jsd": (CROSS, each_teacher("loss={kind: topk_jsd, k: 64}")),
    "answers": (CROSS, ["loss.teacher_answers={prompts_per_step: 4}"]),
    "answers8": (CROSS, ["loss.teacher_answers={prompts_per_step: 8}"]),
    "answers-c2-lr4": (CROSS, ["loss.teacher_answers={prompts_per_step: 4, coef: 2}", "optim.lr=4e-4"]),
    "other-route": ("recipes/bench/transplant-back-opd.yaml", []),
    "uniform-tied": (CROSS, TIED),
    "uniform-chain": (CROSS, ["student.transplant.head=chain"]),
    "answers-chain": (CROSS, ["student.transplant.head=chain", "loss.teacher_answers={prompts_per_step: 4}"]),
    "uniform-chain-lr4": (CROSS, ["student.transplant.head=chain", "optim.lr=4e-4"]),
    "dense-chain": (CROSS, REVERSE_64),
    "dense-forward-chain": (CROSS, FORWARD_64),
    "dense-prefix-chain": (CROSS, REVERSE_64 + PREFIX),
    "dense-prefix-chain-lr4": (CROSS, REVERSE_64 + PREFIX + ["optim.lr=4e-4"]),
    "dense-forward-prefix-chain": (CROSS, FORWARD_64 + PREFIX),
    "dense-prefix-answers-chain": (CROSS, REVERSE_64 + PREFIX + answers()),
    "dense-prefix-answers-half-chain": (CROSS, REVERSE_64 + PREFIX + answers(0.5)),
    "dense-prefix-answers-tied": (CROSS, TIED + REVERSE_64 + PREFIX + answers()),
    "dense-prefix-answers-half-tied": (CROSS, TIED + REVERSE_64 + PREFIX + answers(0.5)),
    "dense-prefix-answers-3q-tied": (CROSS, TIED + REVERSE_64 + PREFIX + answers(0.75)),
    "dense-forward-prefix-answers-tied": (CROSS, TIED + FORWARD_64 + PREFIX + answers()),
    "dense512-prefix-answers-chain": (CROSS, REVERSE_512 + PREFIX + answers()),
    "mixed-family": ("recipes/distill/mixed-family.yaml", []),
    "mixed-family-math-half": ("recipes/distill/mixed-family.yaml",
                               ["teachers.math.loss={kind: sampled_token, coef: 0.5}"]),
}
# The arms measured on the recipe's student until 2026-12-05 (the tied head) share its step-0
# figures; every other arm's student or teachers differ, so its step 0 is its own and is recorded.
TIED_START = ("uniform", "broadcast", "one_to_one", "dense", "dense_forward", "dense_jsd", "answers", "answers8",
              "answers-c2-lr4")
OWN_START = tuple(arm for arm in ARMS if arm not in TIED_START)
ALIGN = {"one_to_one": ("share of 1:1 chunks", "fraction"), "chunk_tokens": ("mean chunk length", "student tokens"),
         "signal": ("share of student tokens with a signal", "fraction")}


def read(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def run_arm(name: str, out: Path, steps: int, every: int, reuse: bool, eval_prompts: int | None) -> list[dict]:
    recipe, overrides = ARMS[name]
    overrides = overrides + ([f"eval.prompts_per_source={eval_prompts}"] if eval_prompts else [])
    run_dir = out / name
    if reuse and read(run_dir) and read(run_dir)[-1]["step"] == steps:
        print(f"{name}: reusing the finished run in {run_dir}", flush=True)
        return read(run_dir)
    command = [str(REPO / ".venv" / "bin" / "k3post"), "run", recipe, f"train.steps={steps}",
               f"train.eval_every={every}", f"train.checkpoint_every={steps}", *overrides, "--run-dir", str(run_dir),
               "--restart"]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, cwd=REPO, check=True)
    return read(run_dir)


def rows_of(name: str, metrics: list[dict]) -> list[dict]:
    """One row per evaluation: the per-byte KLs of both teachers and the training seconds so far."""
    rows, seconds = [], 0.0
    for m in metrics:
        seconds += m.get("time/step_s") or 0.0
        if f"eval/kl_per_byte/{BOTH[0]}" in m:
            rows.append({"arm": name, "step": m["step"], "train_s": seconds,
                         **{k.removeprefix("eval/"): m[k] for k in m if "_per_byte/" in k}})
    aligned = [m for m in metrics if any(k.startswith("align/") for k in m)]
    if rows and aligned:  # the training steps' alignment figures, averaged over the run
        rows[-1]["align"] = {k: sum(m[k] for m in aligned if k in m) / sum(k in m for m in aligned)
                             for k in dict.fromkeys(k for m in aligned for k in m if k.startswith("align/"))}
    return rows


SECTION = ("Distilling across tokenizers "
           "(`bench/teachers/cross_tokenizer_arms.py`, `bench/teachers/cross_tokenizer_cost.py`)")


def result_rows(rows: list[dict]) -> list[dict]:
    """bench/results rows for each arm's final evaluation: the per-byte KLs as the table prints them
    (3 decimals) and the training seconds (whole seconds)."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        last = mine[-1]
        for at in ([mine[0]] if arm in OWN_START and mine[0] is not last else []) + [last]:
            for key, kind in (("kl", "reverse"), ("fkl", "forward")):
                for teacher in BOTH:
                    out.append({"metric": f"arm `{arm}`: held-out {kind} KL per byte, {teacher} teacher, step {at['step']}",
                                "value": Decimal(f"{at[f'{key}_per_byte/{teacher}']:.3f}"), "unit": "nats/byte"})
        for key, value in last.get("align", {}).items():
            _, what, teacher = key.split("/")
            if what in ALIGN:
                out.append({"metric": f"arm `{arm}`: {ALIGN[what][0]}, {teacher} teacher, training steps",
                            "value": Decimal(f"{value:.3f}"), "unit": ALIGN[what][1]})
        out.append({"metric": f"arm `{arm}`: training seconds to step {last['step']}", "value": int(f"{last['train_s']:.0f}"),
                    "unit": "s"})
    return out


def print_table(rows: list[dict], cores: int) -> None:
    start = {r["arm"]: r for r in rows if r["step"] == 0}
    heads = [f"{d}_per_byte/{t}" for d in ("kl", "fkl") for t in BOTH]
    print("\n| arm | step | training s | ≤ CPU-s | " + " | ".join(heads) + " |")
    print("|---|---|---|---|" + "---|" * len(heads))
    for r in rows:
        first = start[r["arm"]]
        cells = [f"{r[h]:.3f} ({(r[h] / first[h] - 1) * 100:+.0f}%)" for h in heads]
        print(f"| {r['arm']} | {r['step']} | {r['train_s']:.0f} | {r['train_s'] * cores:.0f} | " + " | ".join(cells) + " |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for row, (metric, name) in enumerate((("kl", "reverse"), ("fkl", "forward"))):
        for ax, teacher in zip(axes[row], BOTH):
            for arm in dict.fromkeys(r["arm"] for r in rows):
                mine = [r for r in rows if r["arm"] == arm]
                ax.plot([r["train_s"] for r in mine], [r[f"{metric}_per_byte/{teacher}"] for r in mine], marker="o",
                        label=arm)
            ax.set(title=f"held-out {name} KL per byte, teacher '{teacher}'", xlabel="training seconds",
                   ylabel="nats / byte")
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--eval-every", type=int, default=7)
    parser.add_argument("--eval-prompts", type=int, default=None,
                        help="held-out prompts per source at each evaluation (eval.prompts_per_source; default the "
                             "recipe's 8: one sample each, so ±0.03 between evaluations is noise)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-cross-tokenizer")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true", help="take an arm whose run directory has finished as it is")
    parser.add_argument("--no-record", action="store_true", help="do not append the final rows to bench/results")
    args = parser.parse_args()
    rows = []
    for name in args.arms:
        rows += rows_of(name, run_arm(name, args.out, args.steps, args.eval_every, args.reuse, args.eval_prompts))
    (args.out / "rows.json").write_text(json.dumps(rows, indent=2))
    print_table(rows, os.cpu_count() or 1)
    if args.plot:
        plot(rows, args.plot)
    record_and_say("cross-tokenizer", result_rows(rows), args.no_record, source_section=SECTION)


if __name__ == "__main__":
    sys.exit(main())
