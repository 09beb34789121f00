"""The evaluation harness on scripted fake models: its pass@k and KL numbers equal what brute force
and closed forms say they must be, and bad input costs only its own rows of the report."""

from __future__ import annotations

import json
import math
from itertools import combinations

import pytest
import torch

from k3post.config.eval_schema import EvalRecipe
from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, TeacherSpec
from k3post.engine.evaluation.eval_model import reference_examples
from k3post.loops.eval_harness import run_evaluation
from k3post.loops.eval_plan import ModelEntry
from k3post.types import Rollouts

V = 5


def boosted(a: float) -> torch.Tensor:
    logits = torch.zeros(V)
    logits[0] = a
    return torch.log_softmax(logits, dim=-1)


class FakeModel:
    """Answers prompt `uid` correctly on its first correct[uid] samples; fixed next-token distribution."""

    def __init__(self, correct: dict[str, int], logprobs_V: torch.Tensor, length: int = 3):
        self.correct, self.seen, self.logprobs_V, self.length = correct, {}, logprobs_V, length

    def sample(self, prompts, params):
        texts = []
        for p in prompts:
            i = self.seen.get(p.uid, 0)
            self.seen[p.uid] = i + 1
            texts.append(p.uid.split("-")[-1] if i < self.correct.get(p.uid, 0) else "wrong")
        # Completion lengths 1..length, so masked positions exist and must not count.
        mask = torch.tensor([[1.0 if t <= b % self.length else 0.0 for t in range(self.length)]
                             for b in range(len(prompts))])
        zeros = torch.zeros_like(mask)
        return Rollouts(list(prompts), [[0]] * len(prompts), zeros.long(), mask, zeros, texts)

    def score_full(self, rollouts):
        B, T = rollouts.loss_mask_BT.shape
        return self.logprobs_V.expand(B, T, V).clone()

    def score(self, rollouts):
        return torch.full(rollouts.loss_mask_BT.shape, -1.0)

    def encode_examples(self, examples, max_tokens):
        mask = torch.ones(len(examples), 2)
        return Rollouts(list(examples), [[0]] * len(examples), mask.long(), mask, mask * 0)

    def vocab_fingerprint(self):
        return V, "template"


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def recipe(tasks, batch_size=3) -> EvalRecipe:
    return EvalRecipe.model_validate({
        "kind": "eval", "students": {"s": {"model": {"tiny": {}}}, "broken": {"model": {"path": "/nonexistent"}}},
        "teachers": {"t": {"model": {"tiny": {}}}}, "tasks": tasks, "sampling": {"batch_size": batch_size}})


def entries():
    tiny = TeacherSpec(model=ModelSpec(tiny={}))
    return [ModelEntry("s", "student", tiny, "s"), ModelEntry("broken", "student", tiny, "broken"),
            ModelEntry("t", "teacher", tiny, "t")]


def brute_force(n, c, k):
    subsets = list(combinations([True] * c + [False] * (n - c), k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_and_kl_numbers_through_the_harness(tmp_path):
    rows = write_rows(tmp_path / "qa.jsonl", [{"id": f"q-{i}", "prompt": f"say {i}", "answer": str(i)} for i in range(5)])
    correct = {"q-0": 0, "q-1": 1, "q-2": 2, "q-3": 3, "q-4": 4}
    student, teacher = boosted(0.0), boosted(2.0)  # uniform student, teacher ∝ (e², 1, 1, 1, 1)
    models = {"s": FakeModel(correct, student), "t": FakeModel({}, teacher)}

    def open_model(entry):
        if entry.name == "broken":
            raise UserError("model path /nonexistent: expected a Hugging Face model directory with config.json")
        return models[entry.name]

    tasks = [{"name": "qa", "kind": "generation", "data": str(rows), "verifier": "exact", "samples": 4, "k": [1, 2, 4]},
             {"name": "kl", "kind": "kl", "prompts": str(rows)}]
    results = run_evaluation(recipe(tasks), entries(), open_model, tmp_path, reference_examples)

    got = {(r["model"], r["metric"]): r for r in results.records}
    for k in (1, 2, 4):
        expected = sum(brute_force(4, c, k) for c in correct.values()) / 5
        r = got[("s", f"pass@{k}")]
        assert r["value"] == pytest.approx(expected) and r["n"] == 5 and r["ci_low"] <= r["value"] <= r["ci_high"]
    assert got[("t", "pass@1")]["value"] == 0.0  # the teacher fake never answers right
    Z = math.exp(2.0) + V - 1
    reverse = -math.log(V) + math.log(Z) - 2.0 / V  # KL(uniform ‖ teacher), the same at every token
    forward = float((teacher.exp() * (teacher - student)).sum())
    assert got[("s", "reverse_kl")]["value"] == pytest.approx(reverse, rel=1e-5)
    assert got[("s", "forward_kl")]["value"] == pytest.approx(forward, rel=1e-5)
    assert got[("s", "reverse_kl")]["teacher"] == "t" and got[("s", "reverse_kl")]["tokens"] > 0
    assert ("t", "reverse_kl") not in got  # teachers are not scored against themselves
    assert results.failures == [{"model": "broken", "task": None, "error": (
        "model path /nonexistent: expected a Hugging Face model directory with config.json")}]


def test_a_row_without_its_answer_fails_that_task_only(tmp_path):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}, {"prompt": "c"}]
    bad = write_rows(tmp_path / "bad.jsonl", rows)
    good = write_rows(tmp_path / "good.jsonl", rows[:2])
    models = {"s": FakeModel({}, boosted(0.0)), "t": FakeModel({}, boosted(1.0))}
    tasks = [{"name": "bad", "kind": "generation", "data": str(bad), "verifier": "exact"},
             {"name": "good", "kind": "generation", "data": str(good), "verifier": "exact"},
             {"name": "ref", "kind": "nll", "data": str(good), "completion_field": "missing"}]
    results = run_evaluation(recipe(tasks), entries()[::2], lambda e: models[e.name], tmp_path, reference_examples)
    failures = {f["task"]: f["error"] for f in results.failures}
    assert str(bad) in failures["bad"] and "row 2" in failures["bad"] and "'answer'" in failures["bad"]
    assert "good.jsonl: row 0" in failures["ref"] and "'missing'" in failures["ref"]
    assert {(r["model"], r["task"]) for r in results.records} == {("s", "good"), ("t", "good")}


def test_a_gold_answer_under_another_name_reaches_the_verifier(tmp_path):
    rows = write_rows(tmp_path / "g.jsonl", [{"id": f"g-{i}", "prompt": "?", "gold": str(i)} for i in range(3)])
    models = {"s": FakeModel({"g-0": 1, "g-1": 1, "g-2": 0}, boosted(0.0))}
    tasks = [{"name": "g", "kind": "generation", "data": str(rows), "verifier": "exact", "answer_field": "gold"}]
    results = run_evaluation(recipe(tasks), entries()[:1], lambda e: models[e.name], tmp_path, reference_examples)
    assert results.failures == [] and results.records[0]["value"] == pytest.approx(2 / 3)
