"""The arms of bench/alternatives/opd_vs_alternatives.py: each trains the task's student for a wall-clock budget
and leaves HF checkpoints at the same fractions of it, with the seconds and generated tokens spent.

The clock counts training work only (sampling, teacher scoring or generation, learner steps, weight
sync); model loading and checkpoint writing are outside it, for every arm alike. An arm stops at the
first step boundary past each mark, so checkpoints land a fraction of a step after the mark.

- `opd`: k3post's distillation loop (`build_distill_run` + `distill_step`, in process) with the
  recipe's loss (an arm overrides `loss.kind`);
- `sft`: sequence-level KD through k3post's SFT path - the teacher (with its system prompt) answers
  training prompts, the answers are written as an SFT dataset (`teacher_samples.jsonl`) and
  `build_sft_run` + `sft_step` train on them; the teacher's generation is on the arm's clock;
- `mixture`: the SFT arm's checkpoint at the middle mark, then OPD for the rest of the budget;
- `trl`: TRL's GKDTrainer (λ = 1: every step on the student's own samples), β from the arm's name;
  its teacher sees the teacher's system prompt (`SystemPromptTeacher`), as k3post's does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from k3post.config.load import load_run_recipe


@dataclass
class Checkpoint:
    arm: str
    path: Path
    seconds: float  # training wall-clock when it was taken
    tokens: float  # generated tokens trained on so far (student samples; teacher samples for SFT)
    step: int


@dataclass(frozen=True)
class Budget:
    seconds: float
    marks: tuple[float, ...]  # fractions of `seconds` where checkpoints are taken, increasing, last 1.0


class Clock:
    """Seconds of training work only (`pause()` around loading and checkpoint writes): wall-clock,
    or with `Clock.now = time.process_time` the CPU seconds of this process (all its threads) -
    the fairer budget on a machine other jobs share, where an arm's wall-clock depends on them."""

    now = staticmethod(time.perf_counter)

    def __init__(self, offset: float = 0.0):
        self.offset, self.started = offset, self.now()

    def elapsed(self) -> float:
        return self.offset + self.now() - self.started

    def pause(self):
        return _Paused(self)


class _Paused:
    def __init__(self, clock: Clock):
        self.clock = clock

    def __enter__(self):
        self.t = self.clock.now()

    def __exit__(self, *exc):
        self.clock.started += self.clock.now() - self.t


def write_recipe(data: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_opd(arm: str, recipe, out: Path, budget: Budget, clock: Clock | None = None,
            marks: tuple[float, ...] | None = None) -> list[Checkpoint]:
    """k3post OPD (a loaded distill recipe) in process until each mark; a checkpoint (HF format) at each."""
    from k3post.launch.distill import build_distill_run  # noqa: PLC0415
    from k3post.launch.in_process import InProcessBackend  # noqa: PLC0415
    from k3post.loops.distill import distill_step  # noqa: PLC0415

    run = build_distill_run(recipe, out / arm, InProcessBackend())
    run.say = lambda _: None
    run.weight_sync.push(0)
    clock, tokens, step, kept = clock or Clock(), 0.0, 0, []
    for mark in marks or budget.marks:
        while step == 0 or clock.elapsed() < mark * budget.seconds:  # every arm takes a step
            step += 1
            tokens += distill_step(run, step)["train/tokens"]
        if kept and kept[-1].step == step:
            continue  # one step went past several marks
        with clock.pause():
            kept.append(Checkpoint(arm, Path(run.learner.save_checkpoint(str(out / arm / f"step-{step}"), {})),
                                   clock.elapsed(), tokens, step))
    return kept


def teacher_samples(recipe, n: int, out: Path, clock: Clock, batch: int = 8) -> Path:
    """The task teacher's answers to the first `n` training prompts, as SFT rows (prompt, completion)."""
    from k3post.data.sources import load_prompt_rows  # noqa: PLC0415
    from k3post.engine.evaluation.eval_model import HFEvalModel  # noqa: PLC0415
    from k3post.types import Prompt, SamplingParams  # noqa: PLC0415

    name, spec = next(iter(recipe.teachers.items()))
    source = recipe.data.sources[0]
    rows = load_prompt_rows(source.prompts, Path.cwd())[source.heldout:][:n]  # past the loop's held-out rows
    prompts = [Prompt(r["id"], source.name, name, tuple(tuple(m) for m in r["messages"])) for r in rows]
    with clock.pause():  # loading is off the clock for every arm
        teacher = HFEvalModel(name, spec)
    s = recipe.sampling
    path = out / "teacher_samples.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for b in range(0, len(prompts), batch):
            texts = teacher.sample(prompts[b:b + batch], SamplingParams(s.max_new_tokens, s.temperature, 1.0,
                                                                        seed=recipe.train.seed + b)).texts
            for prompt, text in zip(prompts[b:b + batch], texts):
                f.write(json.dumps({"id": prompt.uid, "prompt": prompt.messages[-1][1], "completion": text}) + "\n")
    return path


def sft_recipe(recipe, examples: Path) -> dict:
    """An SFT recipe with the distillation recipe's student, optimiser and batch, on `examples`."""
    return {"kind": "sft", "description": "SFT on the teacher's samples (sequence-level KD, OPD benchmark)",
            "student": recipe.student.model_dump(mode="json", exclude_none=True),
            "data": {"sources": [{"name": "teacher", "examples": str(examples.resolve()),
                                  "completion_field": "completion", "heldout": 0}],
                     "examples_per_step": recipe.data.prompts_per_step,
                     "max_completion_tokens": recipe.sampling.max_new_tokens},
            "optim": recipe.optim.model_dump(mode="json"),
            "train": {"steps": recipe.train.steps, "eval_every": 0, "checkpoint_every": 0, "seed": recipe.train.seed},
            "resources": {"learner": {"num_cpus": 1}}}


def run_sft(arm: str, recipe, out: Path, budget: Budget, examples: int) -> list[Checkpoint]:
    """Sequence-level KD: teacher samples (on the clock), then k3post SFT on them until each mark."""
    from k3post.launch.in_process import InProcessBackend  # noqa: PLC0415
    from k3post.launch.sft import build_sft_run  # noqa: PLC0415
    from k3post.loops.sft import sft_step  # noqa: PLC0415

    clock = Clock()
    samples = teacher_samples(recipe, examples, out / arm, clock)
    with clock.pause():
        path = write_recipe(sft_recipe(recipe, samples), out / arm / "sft.yaml")
        run = build_sft_run(load_run_recipe(path), out / arm, InProcessBackend())
    tokens, step, kept = 0.0, 0, []
    for mark in budget.marks:
        while step == 0 or clock.elapsed() < mark * budget.seconds:  # every arm takes a step
            step += 1
            tokens += sft_step(run, step)["train/tokens"]
        if kept and kept[-1].step == step:
            continue
        with clock.pause():
            kept.append(Checkpoint(arm, Path(run.learner.save_checkpoint(str(out / arm / f"step-{step}"), {})),
                                   clock.elapsed(), tokens, step))
    return kept


def run_mixture(arm: str, recipe, out: Path, budget: Budget, sft_kept: list[Checkpoint]) -> list[Checkpoint]:
    """The SFT arm's first checkpoint (its first mark), then OPD (`recipe`'s loss) to the end."""
    from k3post.config.schema import ModelSpec  # noqa: PLC0415

    first = sft_kept[0]
    with_sft = [Checkpoint(arm, c.path, c.seconds, c.tokens, c.step) for c in sft_kept[:1]]
    recipe = recipe.model_copy(update={"student": ModelSpec(path=str(first.path.resolve()))})
    later = tuple(m for m in budget.marks if m * budget.seconds > first.seconds)
    opd = run_opd(arm, recipe, out, budget, Clock(first.seconds), later)
    return with_sft + [Checkpoint(arm, c.path, c.seconds, first.tokens + c.tokens, first.step + c.step) for c in opd]
