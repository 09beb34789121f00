"""Held-out evaluation of a distillation run: exact KLs over the full vocabulary.

For each teacher, on the held-out prompts routed to it:
- eval/kl/<teacher>  = exact reverse KL(student‖teacher), token-mean over the *student's*
  samples. What OPD minimises; alone it can be gamed by collapsing onto a few safe tokens.
- eval/fkl/<teacher> = exact forward KL(teacher‖student), token-mean over the *teacher's*
  samples (drawn once, same seed each time). It rises when the student drops the teacher's
  modes, so a run whose kl falls while fkl rises has collapsed rather than learned.
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
        reverse, forward = reverse.result(), forward.result()
        metrics[f"eval/kl/{name}"] = reverse["kl_sum"] / max(reverse["tokens"], 1.0)
        metrics[f"eval/fkl/{name}"] = forward["kl_sum"] / max(forward["tokens"], 1.0)
        metrics[f"eval/response_len/{name}"] = student.num_tokens() / len(student)
        for prompt, mine, ref in zip(prompts, student.texts, theirs.texts):
            rows.append({"prompt": prompt.as_chat()[-1]["content"], "source": prompt.source, "teacher": name,
                         "student": mine, "teacher_answer": ref})
    return metrics, rows
