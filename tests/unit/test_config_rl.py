"""RL recipes (`kind: rl`) and rewards in distillation recipes: typed, checked at load."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3post.cli.run import run_recipe
from k3post.config.errors import UserError
from k3post.config.load import load_recipe, load_run_recipe
from k3post.config.rl_schema import RlRecipe
from tests.unit.test_config import base_recipe, error_of, write


def rl_recipe(**changes) -> dict:
    data = {"kind": "rl", "student": {"tiny": {}},
            "reward_models": {"judge": {"path": "models/rm"}},
            "data": {"sources": [{"name": "m", "prompts": "builtin:math", "rewards": [
                {"fn": "rewards.format:boxed", "weight": 1.0},
                {"fn": "rewards.length:penalty", "weight": 0.5, "kwargs": {"target": 200}},
                {"model": "judge", "weight": 0.1}]}]}}
    data.update(changes)
    return data


def test_an_rl_recipe_loads_with_defaults_and_absolute_reward_model_paths(tmp_path):
    recipe = load_run_recipe(write(tmp_path, "r.yaml", rl_recipe()), ["sampling.n=8", "loss.advantage=rloo"])
    assert isinstance(recipe, RlRecipe)
    assert recipe.sampling.n == 8 and recipe.loss.advantage == "rloo" and recipe.loss.policy_loss == "ppo_clip"
    assert recipe.reward_models["judge"].path == str((tmp_path / "models" / "rm").resolve())
    uses = recipe.data.sources[0].rewards
    assert [u.metric_name for u in uses] == ["boxed", "penalty", "judge"]
    assert uses[1].kwargs == {"target": 200}


@pytest.mark.parametrize("change, where, what", [
    ({"loss": {"advantage": "ppo"}}, "loss.advantage", "'grpo', 'dr_grpo' or 'rloo'"),
    ({"loss": {"clip_eps": 0.2}}, "loss.clip_eps", "unknown key"),
    ({"sampling": {"n": 1}}, "sampling.n", "greater than or equal to 2"),
    ({"reward_models": {}}, "data.sources[0].rewards[2].model", "'judge' is not a reward model"),
    ({"reward_models": {"judge": {"path": "x", "tiny": {}}}}, "reward_models.judge", "exactly one of path"),
])
def test_rl_recipe_mistakes_name_the_key(tmp_path, change, where, what):
    message = error_of(write(tmp_path, "r.yaml", rl_recipe(**change)))
    assert where in message and what in message, message


def test_a_reward_is_a_function_or_a_model_and_named_once_per_source(tmp_path):
    data = rl_recipe()
    data["data"]["sources"][0]["rewards"] = [{"fn": "rewards.format:boxed", "model": "judge"}]
    assert "exactly one of fn" in error_of(write(tmp_path, "a.yaml", data))
    data["data"]["sources"][0]["rewards"] = [{"fn": "rewards.format"}]
    assert "rewards[0].fn" in error_of(write(tmp_path, "b.yaml", data))
    data["data"]["sources"][0]["rewards"] = [{"fn": "rewards.format:boxed"}, {"fn": "mine.format:boxed"}]
    assert "unique within a source" in error_of(write(tmp_path, "c.yaml", data))
    data["data"]["sources"][0]["rewards"] = [{"model": "judge", "kwargs": {"x": 1}}]
    assert "kwargs are bound to a reward function" in error_of(write(tmp_path, "d.yaml", data))


def test_distillation_with_rewards_needs_groups_and_the_sampled_token_loss(tmp_path):
    data = base_recipe(tmp_path)
    data["data"]["sources"][0]["rewards"] = [{"fn": "rewards.format:boxed"}]
    assert "sample a group of at least 2" in error_of(write(tmp_path, "r.yaml", data))
    data["sampling"] = {"n": 4}
    recipe = load_recipe(write(tmp_path, "r.yaml", data))
    assert recipe.loss.reward_coef == 1.0 and recipe.loss.reward_advantage == "grpo"
    assert "use loss.kind: sampled_token" in error_of(write(tmp_path, "r.yaml", data), ["loss.kind=full_vocab"])


def test_a_misnamed_reward_function_fails_before_any_model_loads(tmp_path):
    data = rl_recipe(reward_models={})
    data["data"]["sources"][0]["rewards"] = [{"fn": "rewards.format:boxxed"}]
    with pytest.raises(UserError, match=r"rewards.format:boxxed.*no attribute 'boxxed'"):
        run_recipe(write(tmp_path, "r.yaml", data), [], tmp_path / "run", in_process=True, restart=False)


def test_unknown_recipe_kinds_list_rl(tmp_path):
    assert "rl" in error_of(write(tmp_path, "r.yaml", {"kind": "ppo"}))


def test_shipped_rl_recipes_exist():
    assert list((Path(__file__).resolve().parents[2] / "recipes" / "rl").glob("*.yaml"))
