"""Does on-policy distillation pay? OPD vs off-policy distillation vs TRL GKD at equal wall-clock.

Every arm trains the same student from the same teacher on the same prompts for the same
wall-clock budget on this machine (bench/alternatives/bench_arms.py: what the clock counts), leaves checkpoints
at the same fractions of it, and every checkpoint - plus the untrained student - is scored by the
evaluation harness (`k3post eval`, docs/eval.md) on held-out prompts: exact reverse and forward KL
to the teacher, mean completion length, distinct-2 and repetition rate (the `text` task), and the
task's own score, all with the harness's intervals.

Tasks (`--task`): behaviour (the terse teacher, recipes/bench/behaviour-opd.yaml; held-out chat
prompts; score: the `brief` rate) and math (the math-tutor teacher, recipes/bench/math-tutor-opd.yaml;
the held-out arithmetic set `builtin:arith`; score: pass@1 of the math verifier on the answers).

Arms: opd-sampled (sampled-token reverse KL), opd-full (exact full-vocabulary reverse KL), opd-topk
(top-k reverse KL with the tail bucket, k = 64), sft (SFT on the teacher's own samples through k3post's
SFT path), mixture (the SFT arm's first checkpoint, then opd-full), trl-b1 / trl-b0.5 (TRL
GKDTrainer, λ = 1, β = 1 and 0.5; skipped with a note when trl is not installed).

    .venv/bin/python bench/alternatives/opd_vs_alternatives.py --short     # ~1 min per arm + eval: ~15 min here
    .venv/bin/python bench/alternatives/opd_vs_alternatives.py --full      # 4 min per arm + eval: ~45 min on an idle 2-core machine
    .venv/bin/python bench/alternatives/opd_vs_alternatives.py --full --task math   # the same on the math-tutor task
    .venv/bin/python bench/alternatives/opd_vs_alternatives.py --smoke     # tiny random models, seconds (the test)
    ... --arms opd-full,sft --budget 120 --out runs/bench/x --docs   # --docs: tables + plots into docs/

Writes <out>/results.md (tables, samples), <out>/results.json, one PNG per figure, and the eval
report (<out>/eval/report.md); the untrained student's and each arm's last checkpoint's held-out
KLs and task scores are appended to bench/results/opd-vs-alternatives.jsonl (`results.record`;
not for --smoke; `--no-record` leaves the file alone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.alternatives.bench_arms import Budget, Checkpoint, run_mixture, run_opd, run_sft, write_recipe  # noqa: E402
from bench.alternatives.bench_report import task_suffix, value, write_results  # noqa: E402
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = ("OPD against off-policy distillation and TRL GKD at equal wall-clock "
           "(`bench/alternatives/opd_vs_alternatives.py`)")

ARMS = ("opd-sampled", "opd-full", "opd-topk", "sft", "mixture", "trl-b1", "trl-b0.5")
DEFAULT_ARMS = "opd-sampled,opd-full,sft,mixture,trl-b1,trl-b0.5"  # opd-topk on request: on this CPU full_vocab is exact and cheap
LOSS_OF = {"opd-sampled": ("sampled_token", None), "opd-full": ("full_vocab", None), "opd-topk": ("full_vocab", 64)}


def with_loss(recipe_path: Path, arm: str, overrides: list[str]):
    """The task recipe with the arm's loss: `loss.kind`, or every teacher's own top-k reverse loss."""
    from k3post.config.load import load_run_recipe  # noqa: PLC0415
    from k3post.config.loss_schema import TeacherLossSpec  # noqa: PLC0415

    kind, k = LOSS_OF[arm]
    recipe = load_run_recipe(recipe_path, [*overrides, f"loss.kind={kind}"])
    if k is None:
        return recipe
    teachers = {n: t.model_copy(update={"loss": TeacherLossSpec(kind="topk_reverse", k=k)})
                for n, t in recipe.teachers.items()}
    return recipe.model_copy(update={"teachers": teachers})


TASKS = {  # what each task trains on (its recipe) and how its held-out prompts are scored
    "behaviour": dict(recipe="recipes/bench/behaviour-opd.yaml", prompts="builtin:heldout-chat", score="brief",
                      verifier=None),
    "math": dict(recipe="recipes/bench/math-tutor-opd.yaml", prompts="builtin:arith", score=None, verifier="math"),
}
PRESETS = {  # budget s per arm, checkpoint marks, eval prompts, SFT teacher samples (smoke: its own tiny recipe)
    "smoke": dict(recipe="recipes/bench/smoke-task.yaml", budget=2.0, marks=(0.5, 1.0), prompts=4, examples=8,
                  arms="opd-full,sft", max_new_tokens=8),
    "short": dict(budget=60.0, marks=(0.5, 1.0), prompts=16, examples=48, arms=DEFAULT_ARMS, max_new_tokens=48),
    "full": dict(budget=240.0, marks=(0.25, 0.5, 1.0), prompts=32, examples=160, arms=DEFAULT_ARMS,
                 max_new_tokens=48),
}


def task_scores(task: dict) -> list[str]:
    """The metric names of the task's own scores: its behaviour score, pass@1 of its verifier."""
    scores = [task["score"]] if task["score"] else []
    return scores + (["pass@1"] if task["verifier"] else [])


def result_rows(task: str, budget_s: float, clock: str, kept: list[Checkpoint], records: list[dict],
                scores: list[str]) -> list[dict]:
    """The table at equal budget as rows: for the untrained student and each arm's last checkpoint,
    held-out reverse and forward KL and the task's scores (3 decimals, as the table), the interval
    and the checkpoint's seconds · steps · tokens in the notes."""
    head = f"{task} task, {budget_s:.0f} {'wall-clock' if clock == 'wall' else 'CPU'} s per arm"
    last = {c.arm: c for c in kept}  # kept is in training order: the last of each arm wins
    models = [("untrained student", "initial", None)] + [(arm, f"{c.arm}@{c.step}", c) for arm, c in last.items()]
    metrics = [("reverse_kl", "held-out reverse KL", "nats/token"), ("forward_kl", "held-out forward KL", "nats/token"),
               *((score, score, "rate") for score in scores)]
    rows = []
    for label, model, c in models:
        where = "" if c is None else f"; at {c.seconds:.0f} s, step {c.step}, {c.tokens:.0f} tokens"
        for key, name, unit in metrics:
            r = value(records, model, key)
            if r is not None:
                rows.append({"metric": f"{head}: {label}, {name}", "value": rounded(r["value"], 3), "unit": unit,
                             "notes": f"95% interval [{r['ci_low']:.3f}, {r['ci_high']:.3f}]{where}"})
    return rows


def train_arms(arms: list[str], recipe_path: Path, out: Path, budget: Budget, examples: int,
               overrides: list[str], say=print) -> tuple[list[Checkpoint], list[str]]:
    from k3post.config.load import load_run_recipe  # noqa: PLC0415

    kept, notes, sft = [], [], None
    recipe = load_run_recipe(recipe_path, overrides)
    for arm in arms:
        say(f"[bench] training {arm} for {budget.seconds:.0f}s")
        if arm in LOSS_OF:
            kept += run_opd(arm, with_loss(recipe_path, arm, overrides), out, budget)
        elif arm == "sft":
            sft = run_sft(arm, recipe, out, budget, examples)
            kept += sft
        elif arm == "mixture":
            sft = sft or run_sft("sft", recipe, out, budget, examples)
            kept += run_mixture(arm, with_loss(recipe_path, "opd-full", overrides), out, budget, sft)
        elif arm.startswith("trl-"):
            from bench.alternatives.bench_trl import run_trl, trl_available  # noqa: PLC0415

            if not trl_available():
                notes.append(f"{arm}: skipped, trl is not installed (the optional `bench` extra)")
                continue
            kept += run_trl(arm, recipe, out, budget, float(arm.removeprefix("trl-b")))
        else:
            raise SystemExit(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    return kept, notes


def eval_recipe(recipe_path: Path, kept: list[Checkpoint], prompts: int, max_new_tokens: int, task: dict) -> dict:
    """One `k3post eval` recipe over the untrained student and every checkpoint, against the teacher."""
    from k3post.config.load import load_run_recipe  # noqa: PLC0415

    recipe = load_run_recipe(recipe_path)
    name, teacher = next(iter(recipe.teachers.items()))
    students = {"initial": {"model": recipe.student.model_dump(mode="json", exclude_none=True)}}
    students.update({f"{c.arm}@{c.step}": {"model": {"path": str(c.path.resolve())}} for c in kept})
    tasks = [{"name": "kl", "kind": "kl", "prompts": task["prompts"], "limit": prompts},
             {"name": "style", "kind": "text", "prompts": task["prompts"], "limit": prompts, "score": task["score"]}]
    if task["verifier"]:
        tasks.append({"name": "answers", "kind": "generation", "data": task["prompts"], "limit": prompts,
                      "verifier": task["verifier"]})
    return {"kind": "eval", "description": "OPD benchmark: every arm's checkpoints vs the teacher",
            "students": students, "teachers": {name: teacher.model_dump(mode="json", exclude_none=True)},
            "tasks": tasks, "sampling": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "batch_size": 16},
            "seed": 0}


def evaluate(recipe_path: Path, kept: list[Checkpoint], out: Path, prompts: int, max_new_tokens: int,
             task: dict) -> tuple[list[dict], list[dict]]:
    """Run the harness; its records and kept samples."""
    from k3post.cli.eval import run_eval  # noqa: PLC0415

    path = write_recipe(eval_recipe(recipe_path, kept, prompts, max_new_tokens, task), out / "eval.yaml")
    run_eval(path, [], out / "eval")
    report = json.loads((out / "eval" / "report.json").read_text())
    samples_path = out / "eval" / "samples.jsonl"
    samples = [json.loads(line) for line in samples_path.read_text().splitlines()] if samples_path.exists() else []
    return report["records"], samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    for name in PRESETS:
        mode.add_argument(f"--{name}", dest="preset", action="store_const", const=name)
    parser.add_argument("--task", choices=tuple(TASKS), default="behaviour",
                        help="behaviour: the terse teacher on chat prompts; math: the math-tutor teacher, "
                             "scored on its answers")
    parser.add_argument("--arms", help="comma-separated, from: " + ", ".join(ARMS))
    parser.add_argument("--budget", type=float, help="training seconds per arm")
    parser.add_argument("--recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="a dotted recipe override for every arm, e.g. --set optim.lr=5e-4 (repeatable)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="budget in wall-clock seconds, or CPU seconds of this process (a shared machine)")
    parser.add_argument("--docs", action="store_true", help="write the tables and plots into docs/opd-benchmark.md")
    add_no_record(parser)
    args = parser.parse_args(argv)
    preset, task = dict(PRESETS[args.preset or "short"]), TASKS[args.task]
    recipe_path = Path(args.recipe or preset.get("recipe", task["recipe"]))
    out = Path(args.out or f"runs/bench/opd-vs-alternatives-{args.preset or 'short'}{task_suffix(args.task)}")
    budget = Budget(args.budget or preset["budget"], preset["marks"])
    from k3post.engine.common import quiet_libraries  # noqa: PLC0415

    quiet_libraries()
    if args.clock == "cpu":
        import time  # noqa: PLC0415

        from bench.alternatives.bench_arms import Clock  # noqa: PLC0415

        Clock.now = staticmethod(time.process_time)
    kept, notes = train_arms((args.arms or preset["arms"]).split(","), recipe_path, out, budget, preset["examples"],
                              args.overrides)
    (out / "checkpoints.json").write_text(json.dumps([{**asdict(c), "path": str(c.path)} for c in kept], indent=1))
    records, samples = evaluate(recipe_path, kept, out, preset["prompts"], preset["max_new_tokens"], task)
    write_results(out, kept, records, samples, notes, budget, task_scores(task), args.clock,
                  docs=args.task if args.docs else None)
    print((out / "results.md").read_text())
    if args.preset != "smoke":
        record_and_say("opd-vs-alternatives", result_rows(args.task, budget.seconds, args.clock, kept, records,
                                                          task_scores(task)), args.no_record, source_section=SECTION)
    return 0


def restart_with_k3post_allocator() -> None:
    """Start this script again with the host-allocator settings every k3post Ray actor gets
    (k3post/engine/host_memory.py; glibc reads them only when a process starts). The arms run
    in this one process, so every arm - TRL's included - runs under them."""
    if "GLIBC_TUNABLES" not in os.environ:
        from k3post.engine.host_memory import allocator_env  # noqa: PLC0415

        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **allocator_env()})


if __name__ == "__main__":
    restart_with_k3post_allocator()
    sys.exit(main())
