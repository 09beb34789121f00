"""Sequence-level distillation beside OPD (`loss.teacher_answers`, config/schema.py).

OPD lowers the reverse KL(π_S‖π_T) on the student's own samples. A student far from its
teachers (a new vocabulary, a pruned model) can meet them on its own samples and still give their
answers little probability: the forward KL(π_T‖π_S) on the teachers' samples stays high. Its
gradient is

    ∇ E_{y∼π_T}[log π_T(y) − log π_S(y)] = −E_{y∼π_T}[∇ log π_S(y)],

the likelihood of the teachers' answers. So each step `prompts_per_step` distinct prompts,
taken from the teachers in turn, are also answered by their own teachers (routed as the OPD rows are), and the learner
adds `coef` × the answers' token-mean NLL to the same optimizer step (engine/learner/learner_base.py,
`_answer_gradients`). With teachers and samplers on GPUs the answers are asked for at the step's start
(`TeacherGroup.answer`): the teachers generate them while the student samples, when they would
otherwise be idle. On CPUs they are asked after the sampling (the engines would share the cores). A teacher of another tokenizer answers in the student's tokens already
(its `sample`: the text re-tokenized by the student, engine/teachers/text_reading.py), so this works for
every teacher the loop has.
"""

from __future__ import annotations

from itertools import zip_longest

from k3post.loops.protocols import TeacherGroup
from k3post.loops.routing import rows_by_teacher
from k3post.types import Prompt, SamplingParams, TrainBatch, concat_rollouts


def answer_prompts(prompts: list[Prompt], count: int) -> list[Prompt]:
    """`count` of the step's prompts, each once (a step repeats a prompt sampling.n times), taken
    from the teachers in turn: every teacher answers its share, so no teacher's answers pull the
    one student alone (a step's prompts may come grouped by source)."""
    by_teacher: dict[str, list[Prompt]] = {}
    seen: set[str] = set()
    for prompt in prompts:
        if prompt.uid not in seen:
            seen.add(prompt.uid)
            by_teacher.setdefault(prompt.teacher, []).append(prompt)
    turns = [p for group in zip_longest(*by_teacher.values()) for p in group if p is not None]
    return turns[:count]


class PendingAnswers:
    """The teachers' answers to some prompts, asked of every teacher at once (each its own rows),
    awaited as learner rows: the prompt in the student's view, the answer in the student's tokens,
    each token weighted `coef` (in `advantages_BT`)."""

    def __init__(self, teachers: dict[str, TeacherGroup], prompts: list[Prompt], params: SamplingParams,
                 coef: float):
        self.coef = coef
        self.prompt_uids = {p.uid for p in prompts}
        self.parts = [teachers[name].answer([prompts[i] for i in rows], params)
                      for name, rows in rows_by_teacher(prompts).items()]

    def result(self) -> TrainBatch:
        answers = concat_rollouts([p.result() for p in self.parts], pad_id=0)  # padding lies past every mask
        return TrainBatch(answers.prompt_ids, answers.completion_ids_BT, answers.loss_mask_BT,
                          answers.sampler_logprobs_BT, self.coef * answers.loss_mask_BT)
