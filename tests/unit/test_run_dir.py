"""Resuming into a run directory: a run made by an older k3post resumes (keys added since take
their defaults, keys removed since are dropped), while a changed recipe is refused by key path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from k3post.track.run_dir import RESOLVED, prepare_run_dir
from k3post.config.errors import UserError
from k3post.config.load import load_run_recipe
from k3post.track.atomic import mark_complete

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "smoke" / "tiny-vllm.yaml"  # has vllm sections for sampler and teacher


def write_checkpoint(path: Path, weights: bool = True) -> Path:
    """A checkpoint as the learner leaves it: weights, run_state.json, the COMPLETE marker."""
    path.mkdir(parents=True)
    if weights:
        save_file({"w": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    (path / "run_state.json").write_text('{"step": 1}')
    mark_complete(path)
    return path


def run_dir_with(tmp_path: Path, saved: dict) -> Path:
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir / "checkpoints" / "step-1")
    (run_dir / RESOLVED).write_text(yaml.safe_dump(saved))
    return run_dir


def as_an_older_k3post_saved_it(recipe) -> dict:
    saved = recipe.model_dump(mode="json")
    del saved["sampling"]["weight_transport"]  # added since
    saved["sampling"]["vllm"]["enable_sleep_mode"] = False  # removed since, in two places
    next(iter(saved["teachers"].values()))["vllm"]["enable_sleep_mode"] = False
    return saved


def test_a_run_of_an_older_k3post_resumes(tmp_path):
    recipe = load_run_recipe(RECIPE, [])
    run_dir = run_dir_with(tmp_path, as_an_older_k3post_saved_it(recipe))
    prepare_run_dir(recipe, run_dir, restart=False)  # no "different recipe" refusal
    assert "enable_sleep_mode" not in (run_dir / RESOLVED).read_text()


def test_a_changed_recipe_is_refused_by_key_but_more_steps_are_fine(tmp_path):
    recipe = load_run_recipe(RECIPE, [])
    saved = as_an_older_k3post_saved_it(recipe)
    run_dir = run_dir_with(tmp_path, saved)
    with pytest.raises(UserError, match=r"changed: optim\.lr\)"):
        prepare_run_dir(load_run_recipe(RECIPE, ["optim.lr=0.5"]), run_dir, restart=False)
    prepare_run_dir(load_run_recipe(RECIPE, ["train.steps=50"]), run_dir, restart=False)
