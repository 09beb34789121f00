"""recipes/distill/cross-tokenizer.yaml is the run its recorded figures come from: the arm
`dense-prefix-answers-tied` of bench/teachers/cross_tokenizer_arms.py, at the steps, evaluations and
checkpoints it was measured with, resolves to the same recipe (descriptions aside)."""

from __future__ import annotations

import importlib
from pathlib import Path

from k3post.config.load import load_run_recipe

REPO = Path(__file__).resolve().parents[2]
MEASURED_WITH = ["train.steps=40", "train.eval_every=8", "train.checkpoint_every=40", "eval.prompts_per_source=16"]


def arms_module():
    return importlib.import_module("bench.teachers.cross_tokenizer_arms")


def without_descriptions(recipe) -> dict:
    data = recipe.model_dump()
    data.pop("description")
    for teacher in data["teachers"].values():
        teacher.pop("description")
    return data


def test_the_shipped_recipe_is_the_measured_arm():
    base, overrides = arms_module().ARMS["dense-prefix-answers-tied"]
    arm = load_run_recipe(REPO / base, [*overrides, *MEASURED_WITH])
    shipped = load_run_recipe(REPO / "recipes/distill/cross-tokenizer.yaml")
    assert without_descriptions(shipped) == without_descriptions(arm)
    assert shipped.teachers["chat"].loss.kind == "topk_reverse" and shipped.loss.teacher_answers.coef == 1.0
