"""Keys that do not apply to a recipe's kind fail at load with the key path (none is silently
ignored), and an SFT run made before `model:` became `student:` still resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3post.config.errors import RecipeError, UserError
from k3post.config.load import load_run_recipe
from k3post.track.run_dir import RESOLVED, prepare_run_dir
from tests.unit.test_run_dir import write_checkpoint

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "recipes" / "smoke"


@pytest.mark.parametrize("recipe,override,key", [
    ("tiny-rl.yaml", "train.mode=async", "train.mode"),
    ("tiny-sft-qat.yaml", "train.mode=async", "train.mode"),
    ("tiny-sft-qat.yaml", "resources.samplers.num_cpus=2", "resources.samplers"),
])
def test_a_key_of_another_kind_is_an_error_naming_it(recipe, override, key):
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_run_recipe(SMOKE / recipe, [override])


def test_distillation_still_takes_its_own_keys():
    assert load_run_recipe(SMOKE / "tiny.yaml", ["train.mode=async"]).train.mode == "async"


def test_an_sft_recipe_with_the_old_model_key_is_told_the_new_name(tmp_path):
    data = yaml.safe_load((SMOKE / "tiny-sft-qat.yaml").read_text())
    data["model"] = data.pop("student")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match="student"):
        load_run_recipe(path, [])


def test_an_sft_run_saved_with_model_and_samplers_resumes(tmp_path):
    recipe = load_run_recipe(SMOKE / "tiny-sft-qat.yaml", [])
    saved = recipe.model_dump(mode="json")
    saved["model"] = saved.pop("student")  # as k3post wrote SFT runs before the rename
    saved["resources"]["samplers"] = {"replicas": 1, "num_cpus": 1.0, "num_gpus": 0.0, "threads": None}
    saved["train"]["mode"] = "sync"
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir / "checkpoints" / "step-1")
    (run_dir / RESOLVED).write_text(yaml.safe_dump(saved))
    changed = load_run_recipe(SMOKE / "tiny-sft-qat.yaml", ["optim.lr=0.5"])
    with pytest.raises(UserError, match=r"changed: optim\.lr\)"):  # only the real change is named
        prepare_run_dir(changed, run_dir, restart=False)
    prepare_run_dir(recipe, run_dir, restart=False)  # the same recipe: no "different recipe" refusal


@pytest.mark.parametrize("recipe", ["tiny-sft-qat.yaml", "tiny-rl.yaml", "tiny.yaml"])
def test_every_kind_puts_its_learner_on_the_gpus_it_asks_for(recipe):
    """SFT recipes used to train on the CPU while Ray held the GPU they asked for."""
    from k3post.algo.objectives import SftNll
    from k3post.launch.engines import learner_config

    on_gpu = load_run_recipe(SMOKE / recipe, ["resources.learner.num_gpus=1"])
    assert learner_config(on_gpu, SftNll()).device == "cuda"
    assert learner_config(load_run_recipe(SMOKE / recipe, []), SftNll()).device == "cpu"


def test_a_learner_rank_asking_for_gpus_it_cannot_use_is_an_error():
    with pytest.raises(RecipeError, match="set replicas: 4 and num_gpus: 1"):
        load_run_recipe(SMOKE / "tiny.yaml", ["resources.learner.num_gpus=4"])
    assert load_run_recipe(SMOKE / "tiny.yaml", ["resources.learner.replicas=4",
                                                 "resources.learner.num_gpus=1"]).resources.learner.replicas == 4


def test_a_reward_model_no_source_uses_is_an_error():
    spec = {"tiny": {"hidden_size": 16, "num_layers": 1}}
    with pytest.raises(RecipeError, match="reward_models: unused is named by no data source"):
        load_run_recipe(SMOKE / "tiny.yaml", [f"reward_models={{unused: {spec}}}".replace("'", "")])
