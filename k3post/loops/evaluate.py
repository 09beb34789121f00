"""Held-out evaluation of a distillation run: exact KLs over the full vocabulary.

For each teacher, on the held-out prompts routed to it (a teacher with another tokenizer than
the student's has no per-token KL: only the per-byte ones):
- eval/kl/<teacher>  = exact reverse KL(student‖teacher), token-mean over the *student's*
  samples. What OPD minimises; alone it can be gamed by collapsing onto a few safe tokens.
- eval/fkl/<teacher> = exact forward KL(teacher‖student), token-mean over the *teacher's*
  samples (drawn once, same seed each time). It rises when the student drops the teacher's
  modes, so a run whose kl falls while fkl rises has collapsed rather than learned.
- eval/kl_per_byte/<teacher>, eval/fkl_per_byte/<teacher> = the same two directions at the
  sequence level, per byte of text: E_y[log π_S(y) − log π_T(y)] / bytes(y) (and its forward
  counterpart on the teacher's samples), each side the log-probability of the text under its own
  tokenization. It means the same for every tokenizer pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3post.loops.protocols import SamplerGroup, TeacherGroup
from k3post.loops.routing import rows_by_teacher
from k3post.types import Prompt, Rollouts, SamplingParams


@dataclass
class HeldOut:
    prompts: list[Prompt]
    params: SamplingParams
    teacher_samples: dict[str, Rollouts] = field(default_factory=dict)  # drawn on first use


def _by_teacher(prompts: list[Prompt]) -> dict[str, list[Prompt]]:
    return {name: [prompts[i] for i in rows] for name, rows in rows_by_teacher(prompts).items()}


def evaluate(samplers: SamplerGroup, teachers: dict[str, TeacherGroup], heldout: HeldOut
             ) -> tuple[dict[str, float], list[dict]]:
    """Metrics and one sample row per held-out prompt (the student's answer, and the teacher's)."""
    metrics: dict[str, float] = {}
    rows: list[dict] = []
    for name, prompts in _by_teacher(heldout.prompts).items():
        teacher = teachers[name]
        student = samplers.sample(prompts, heldout.params)
        if name not in heldout.teacher_samples:
            heldout.teacher_samples[name] = teacher.sample(prompts, heldout.params)
        theirs = heldout.teacher_samples[name]
        # Both sides at temperature 1: the KL between the models themselves, whatever the
        # sampling temperature of the held-out answers.
        reverse = teacher.exact_kl(student, samplers.full_logprobs(student, 1.0), "reverse")
        forward = teacher.exact_kl(theirs, samplers.full_logprobs(theirs, 1.0), "forward")
        metrics.update(kl_metrics(name, reverse.result(), forward.result()))
        metrics[f"eval/response_len/{name}"] = student.num_tokens() / len(student)
        for prompt, mine, ref in zip(prompts, student.texts, theirs.texts):
            rows.append({"prompt": prompt.as_chat()[-1]["content"], "source": prompt.source, "teacher": name,
                         "student": mine, "teacher_answer": ref})
    return metrics, rows


def kl_metrics(teacher: str, reverse: dict[str, float], forward: dict[str, float]) -> dict[str, float]:
    """The held-out KLs of one teacher from its `exact_kl` answers: per token (a teacher with the
    student's vocabulary) and per byte of text (every teacher: the sequence-level log-ratio
    Σ_y (log π_S(y) − log π_T(y)) over Σ_y bytes(y), which means the same for any two tokenizers)."""
    out = {}
    for prefix, answer in (("kl", reverse), ("fkl", forward)):
        if "kl_sum" in answer:
            out[f"eval/{prefix}/{teacher}"] = answer["kl_sum"] / max(answer["tokens"], 1.0)
        if "bytes" in answer:
            out[f"eval/{prefix}_per_byte/{teacher}"] = answer["seq_logratio_sum"] / max(answer["bytes"], 1.0)
    return out


class RisingHeldOut:
    """Warns when a held-out loss rises over consecutive evaluations.

    OPD lowers the held-out reverse KL (`eval/kl/<teacher>`) of a student it helps; SFT lowers
    the held-out NLL (`eval/nll`). When one goes up at `rises` evaluations in a row, the run is
    making the student worse, most often because the learning rate is too high for how close the
    student already is (docs/recipes.md, "Learning rate": 2e-4 repairs a pruned SmolLM2 from
    KL 0.9, and drove an unpruned one from KL 0.075 up by 88%). It warns once per streak.
    """

    WATCHED = ("eval/kl/", "eval/kl_per_byte/", "eval/nll")

    def __init__(self, rises: int = 2):
        self.rises = rises
        self.values: dict[str, list[tuple[int, float]]] = {}
        self.streak: dict[str, int] = {}  # rises in a row, per metric

    def check(self, step: int, metrics: dict[str, float], say) -> list[str]:
        """Record this evaluation's values; `say` a warning for each that has just risen `rises`
        times in a row (once per streak). Returns the warned keys."""
        warned = []
        for key, value in metrics.items():
            if not key.startswith(self.WATCHED) or value is None:
                continue
            seen = self.values.setdefault(key, [])
            rose = bool(seen) and float(value) > seen[-1][1]
            seen.append((step, float(value)))
            self.streak[key] = self.streak.get(key, 0) + 1 if rose else 0
            if self.streak[key] == self.rises:
                trail = " → ".join(f"{v:.4g} (step {s})" for s, v in seen[-(self.rises + 1):])
                say(f"warning: held-out {key} rose at {self.rises} evaluations in a row: {trail}. The run is making "
                    f"the student worse on held-out prompts; a learning rate too high for this student is the usual "
                    f"cause (lower optim.lr; docs/recipes.md, 'Learning rate').")
                warned.append(key)
        return warned
