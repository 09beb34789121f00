"""A fleet of sleeping teachers on one GPU takes turns (loops/routing.py: score_for_learner with
`in_turn`): each is asked only once the one before it has answered, each once per step for all
its rows; teachers that do not sleep are all asked before any answer is awaited."""

from __future__ import annotations

import torch

from k3post.config.schema import ModelSpec, ResourceSpec, TeacherSpec, TinyModelSpec, VllmSpec
from k3post.loops.routing import score_for_learner, teachers_in_turn
from k3post.types import Prompt, Rollouts


class Answer:
    def __init__(self, log: list, name: str, value: torch.Tensor):
        self.log, self.name, self.value = log, name, value

    def result(self) -> torch.Tensor:
        self.log.append(("answer", self.name))
        return self.value


class ScriptedTeacher:
    """Scores each row with its teacher's number; logs when it is asked and when it is awaited."""

    def __init__(self, log: list, name: str, number: float):
        self.log, self.name, self.number = log, name, number

    def score(self, rollouts: Rollouts) -> Answer:
        self.log.append(("ask", self.name, len(rollouts)))
        return Answer(self.log, self.name, torch.full(rollouts.completion_ids_BT.shape, self.number))


def rollouts(teachers: list[str]) -> Rollouts:
    prompts = [Prompt(str(i), "s", name, (("user", "hi"),)) for i, name in enumerate(teachers)]
    B = len(prompts)
    return Rollouts(prompts, [[1]] * B, torch.ones(B, 3, dtype=torch.long), torch.ones(B, 3), torch.zeros(B, 3))


def run(in_turn: frozenset[str]) -> tuple[list, torch.Tensor]:
    log: list = []
    teachers = {name: ScriptedTeacher(log, name, number) for name, number in (("a", 1.0), ("b", 2.0), ("c", 3.0))}
    batch = rollouts(["a", "b", "a", "c", "b", "a"])  # interleaved rows: each teacher still asked once
    scoring = {name: ("score", ()) for name in teachers}
    out, _, _, _ = score_for_learner(teachers, scoring, batch, in_turn)
    return log, out[:, 0]


def test_sleeping_teachers_are_asked_one_after_another_once_each():
    log, scores = run(frozenset({"a", "b", "c"}))
    assert log[:5] == [("ask", "a", 3), ("answer", "a"), ("ask", "b", 2), ("answer", "b"), ("ask", "c", 1)]
    assert scores.tolist() == [1.0, 2.0, 1.0, 3.0, 2.0, 1.0]


def test_resident_teachers_are_all_asked_before_any_answer():
    log, scores = run(frozenset())
    assert [entry[0] for entry in log] == ["ask"] * 3 + ["answer"] * 3
    assert scores.tolist() == [1.0, 2.0, 1.0, 3.0, 2.0, 1.0]


def test_a_resident_teacher_does_not_wait_for_a_sleeping_one():
    log, _ = run(frozenset({"a", "c"}))
    assert log.index(("ask", "b", 2)) < log.index(("answer", "a"))  # b is asked while a scores
    assert log.index(("answer", "a")) < log.index(("ask", "c", 1))  # c only once a is done


def test_the_teachers_in_turn_are_the_sleeping_vllm_ones():
    model, gpu = ModelSpec(tiny=TinyModelSpec()), ResourceSpec(num_gpus=0.3)
    teachers = {"hf": TeacherSpec(model=model),
                "awake": TeacherSpec(model=model, engine="vllm", resources=gpu),
                "asleep": TeacherSpec(model=model, engine="vllm", vllm=VllmSpec(sleep=True), resources=gpu)}
    assert teachers_in_turn(teachers) == {"asleep"}
