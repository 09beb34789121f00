"""Text statistics that catch collapse (distinct-n, repetition) and the behaviour scores, by hand
counts; and the eval harness's `text` task on a scripted model."""

from __future__ import annotations

import typing

import pytest
import torch

from k3post.algo.text_metrics import (BEHAVIOUR_SCORES, answer_prefix, behaviour_score, brief, distinct_n, ngram_counts,
                                      numbered_list, repetition_rate)
from k3post.config.eval_schema import EvalRecipe, TextTask
from k3post.config.schema import ModelSpec, TeacherSpec
from k3post.engine.evaluation.eval_model import reference_examples
from k3post.loops.eval_harness import run_evaluation
from k3post.loops.eval_plan import ModelEntry
from k3post.types import Rollouts


def test_ngram_counts_by_hand():
    assert ngram_counts("a b a b", 2) == (2, 3)  # (a b), (b a), (a b)
    assert ngram_counts("one", 2) == (0, 0)
    assert ngram_counts("x y z w x y z w", 4) == (4, 5)


def test_collapse_has_low_distinct_and_high_repetition():
    collapsed = ["a\nb\na\nb\na\nb\na\nb\na\nb"]
    fluent = ["The sky looks blue because air scatters short wavelengths of sunlight more than long ones."]
    assert distinct_n(fluent) == 1.0 and repetition_rate(fluent) == 0.0
    assert distinct_n(collapsed) == pytest.approx(2 / 9)
    assert repetition_rate(collapsed) == pytest.approx(5 / 7)  # 7 four-grams, 2 distinct
    assert distinct_n([]) == 1.0 and repetition_rate(["too short"]) == 0.0


def test_pooled_over_completions():
    texts = ["a b a b", "c d e"]  # bigrams: 2 of 3 distinct, 2 of 2 distinct
    assert distinct_n(texts) == pytest.approx(4 / 5)


@pytest.mark.parametrize("text,expected", [
    ("Answer: the sky is blue.", 1.0), ("  answer : yes", 1.0), ("**Answer:** 42", 1.0),
    ("The answer: 42", 0.0), ("Answers: many", 0.0), ("", 0.0)])
def test_answer_prefix(text, expected):
    assert answer_prefix(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("1. Eat.\n2. Sleep.", 1.0), ("Tips:\n 1) wake up\n 2) stretch", 1.0), ("**1.** a\n**2.** b", 1.0),
    ("1. Only one item", 0.0), ("I have 1. and 2. here", 0.0), ("2. b\n3. c", 0.0)])
def test_numbered_list(text, expected):
    assert numbered_list(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("Drink water first.", 1.0), (" ".join(["w"] * 20), 1.0), (" ".join(["w"] * 21), 0.0), ("", 1.0),
    ("one\ntwo  three", 1.0)])
def test_brief_counts_at_most_twenty_words(text, expected):
    assert brief(text) == expected


def test_behaviour_score_names_match_the_eval_schema():
    allowed = set(typing.get_args(typing.get_args(TextTask.model_fields["score"].annotation)[0]))
    assert allowed == set(BEHAVIOUR_SCORES)
    with pytest.raises(ValueError, match="unknown behaviour score"):
        behaviour_score("nope", "x")


class ScriptedModel:
    """Returns the given texts in order, each with the given number of completion tokens."""

    def __init__(self, texts, lengths):
        self.texts, self.lengths, self.i = texts, lengths, 0

    def sample(self, prompts, params):
        texts = self.texts[self.i:self.i + len(prompts)]
        lengths = self.lengths[self.i:self.i + len(prompts)]
        self.i += len(prompts)
        mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(max(lengths))] for n in lengths])
        return Rollouts(list(prompts), [[0]] * len(prompts), mask.long(), mask, mask * 0, texts)


def test_text_task_through_the_harness(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"id": "p-{i}", "prompt": "q{i}"}}\n' for i in range(4)))
    texts = ["Answer: blue sky today", "a a a a a a", "Answer: yes it is", "no"]
    recipe = EvalRecipe.model_validate({
        "kind": "eval", "students": {"s": {"model": {"tiny": {}}}},
        "tasks": [{"name": "style", "kind": "text", "prompts": str(path), "score": "answer_prefix"}],
        "sampling": {"batch_size": 3}})
    entry = ModelEntry("s", "student", TeacherSpec(model=ModelSpec(tiny={})), "s")
    results = run_evaluation(recipe, [entry], lambda e: ScriptedModel(texts, [4, 6, 5, 1]), tmp_path,
                             reference_examples)
    got = {r["metric"]: r for r in results.records}
    assert got["length"]["value"] == pytest.approx(4.0) and got["length"]["n"] == 4
    assert got["answer_prefix"]["value"] == pytest.approx(0.5)
    assert got["answer_prefix"]["ci_low"] < 0.5 < got["answer_prefix"]["ci_high"]
    assert got["distinct_2"]["value"] == pytest.approx(distinct_n(texts))
    assert got["repetition_4"]["value"] == pytest.approx(repetition_rate(texts))
    # four-grams: 1 + 3 (1 distinct: 2 repeated) + 1 + 0
    assert got["repetition_4"]["value"] == pytest.approx(2 / 5)
    assert {s["completion"] for s in results.samples} == set(texts)
