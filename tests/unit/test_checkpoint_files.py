"""A resume trusts no checkpoint it has not checked, in every layout the learner writes: the
one-process learner's (HF export + dcp/ + trainer_state.pt), LoRA's (adapter + optimizer in
trainer_state.pt), and checkpoints written before the COMPLETE manifest (format checks only).
The sharded group's layout is checked in test_sharded_learner.py, on the checkpoints its runs
write. Each damage is made to a real checkpoint, and the check must name the damaged file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from k3post.config.errors import UserError
from k3post.config.schema import LoraSpec, ModelSpec, OptimSpec, TinyModelSpec
from k3post.config.load import load_run_recipe
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.loops.common import resume
from k3post.track.checkpoint_files import COMPLETE, checkpoint_problem, manifest_of
from k3post.track.run_dir import RESOLVED, prepare_run_dir
from tests.unit.test_learner import make_batch

REPO = Path(__file__).resolve().parents[2]


def learner(spec, lora: int = 0) -> Learner:
    return Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-3, micro_batch_size=4), total_steps=10,
                                 num_threads=2, lora=LoraSpec(rank=lora)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One trained step, saved in each layout; the pre-manifest one is the full layout with the
    COMPLETE marker an earlier k3post wrote."""
    spec = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3))
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for layout, lora in (("full", 0), ("lora", 4)):
        lrn = learner(spec, lora)
        lrn.train_step(make_batch(spec, seed=1))
        out[layout] = Path(lrn.save_checkpoint(str(root / layout / "step-1"), {"step": 1, "data": {}}))
    shutil.copytree(out["full"], root / "old" / "step-1")
    (root / "old" / "step-1" / COMPLETE).write_text("complete\n")
    out["old"] = root / "old" / "step-1"
    return out


def copy_of(saved: dict, layout: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved[layout], tmp_path / layout / "step-1"))


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", ["full", "lora", "old"])
def test_a_whole_checkpoint_passes(saved, layout):
    assert checkpoint_problem(saved[layout]) is None


@pytest.mark.parametrize("layout", ["full", "lora"])
def test_every_file_is_in_the_manifest_and_each_damage_to_it_is_named(saved, layout, tmp_path):
    names = set(manifest_of(saved[layout]))
    expected = {"run_state.json", "trainer_state.pt"}
    expected |= {"config.json", "dcp/.metadata", "dcp/__0_0.distcp", "model.safetensors"} if layout == "full" \
        else {"adapter_model.safetensors", "adapter_config.json"}
    assert expected <= names and "README.md" not in names and COMPLETE not in names
    for i, name in enumerate(sorted(names)):
        for damage, words in ((flip_middle_byte, "bytes changed"), (lambda p: p.unlink(), "missing"),
                              (lambda p: p.write_bytes(p.read_bytes()[:-1]), "cut short")):
            ckpt = copy_of(saved, layout, tmp_path / f"{i}-{words}")
            damage(ckpt / name)
            problem = checkpoint_problem(ckpt)
            assert problem is not None and problem.startswith(name) and words in problem, (name, problem)


def test_the_model_card_may_change_after_the_checkpoint_was_written(saved, tmp_path):
    ckpt = copy_of(saved, "full", tmp_path)
    with open(ckpt / "README.md", "a") as card:  # what `k3post eval --update-cards` does
        card.write("\n| eval | 1.0 |\n")
    assert checkpoint_problem(ckpt) is None


@pytest.mark.parametrize("name,damage,words", [
    ("dcp/.metadata", lambda p: p.unlink(), "dcp/.metadata is missing"),
    ("dcp/.metadata", lambda p: p.write_bytes(b"garbage"), "dcp/.metadata cannot be read"),
    ("dcp/__0_0.distcp", lambda p: p.write_bytes(p.read_bytes()[:100]), "dcp/__0_0.distcp is cut short"),
    ("dcp/__0_0.distcp", lambda p: p.unlink(), "dcp/__0_0.distcp is missing"),
    ("trainer_state.pt", flip_middle_byte, "trainer_state.pt: "),
    ("run_state.json", lambda p: p.write_text("{step"), "run_state.json: expected a JSON object"),
    ("config.json", lambda p: p.write_text("[1]"), "config.json: expected a JSON object, got list"),
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-100]), "model.safetensors: truncated weight"),
])
def test_a_checkpoint_from_before_the_manifest_gets_the_format_checks(saved, tmp_path, name, damage, words):
    ckpt = copy_of(saved, "old", tmp_path)
    damage(ckpt / name)
    assert words in (checkpoint_problem(ckpt) or "")


def run_dir_of(saved: dict, tmp_path: Path, recipe_path: Path, steps=(1, 2)) -> tuple[object, Path]:
    """A run directory of `recipe_path` with checkpoints at `steps` (copies of the full layout)."""
    recipe = load_run_recipe(recipe_path, [])
    run_dir = tmp_path / "run"
    for step in steps:
        shutil.copytree(saved["full"], run_dir / "checkpoints" / f"step-{step}")
    (run_dir / RESOLVED).write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    return recipe, run_dir


RECIPE = REPO / "recipes" / "smoke" / "tiny.yaml"


def test_a_damaged_newest_checkpoint_is_set_aside_and_kept(saved, tmp_path, capsys):
    recipe, run_dir = run_dir_of(saved, tmp_path, RECIPE)
    flip_middle_byte(run_dir / "checkpoints" / "step-2" / "model.safetensors")
    prepare_run_dir(recipe, run_dir, restart=False)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [".step-2.broken", "step-1"]
    assert "model.safetensors: its bytes changed" in capsys.readouterr().err


def test_fewer_steps_than_the_newest_checkpoint_are_refused(saved, tmp_path):
    recipe, run_dir = run_dir_of(saved, tmp_path, RECIPE, steps=(1, 2, 3))
    assert recipe.train.steps == 2
    with pytest.raises(UserError, match=r"newest checkpoint is step-3, past train.steps=2"):
        prepare_run_dir(recipe, run_dir, restart=False)
    prepare_run_dir(recipe, run_dir, restart=True)  # the way out the message names
    assert not (run_dir / "checkpoints").exists()


def test_checkpoints_without_their_saved_recipe_are_refused(saved, tmp_path):
    recipe, run_dir = run_dir_of(saved, tmp_path, RECIPE)
    (run_dir / RESOLVED).unlink()
    with pytest.raises(UserError, match=r"recipe.resolved.yaml: missing: this run directory holds checkpoints"):
        prepare_run_dir(recipe, run_dir, restart=False)


def test_a_damage_no_check_sees_is_a_user_error_naming_the_checkpoint(saved, tmp_path, tiny_spec):
    """dcp/ removed from a pre-manifest checkpoint: its format checks pass (it has weights), the
    learner cannot load it; the resume says which checkpoint, and what to do."""
    ckpt = Path(shutil.copytree(saved["old"], tmp_path / "run" / "checkpoints" / "step-1"))
    shutil.rmtree(ckpt / "dcp")
    assert checkpoint_problem(ckpt) is None
    with pytest.raises(UserError, match=r"step-1: cannot resume from this checkpoint \(KeyError: 'optimizer'\)"):
        resume(tmp_path / "run", learner(tiny_spec), data=None, say=print)  # the data is never reached
    assert json.loads((ckpt / "run_state.json").read_text())["step"] == 1
