"""A vLLM engine's GPU settings follow its actor (config/vllm_resources.py), checked at load; the
replicas' score checks merge; a full_vocab teacher on vLLM with GPUs is refused at launch.

Pure functions and recipe loading only: no engine is built (vLLM on a GPU cannot run here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3post.config.errors import RecipeError, UserError
from k3post.config.load import load_recipe
from k3post.config.schema import VllmSpec
from k3post.config.vllm_resources import engine_memory_utilization, engine_tensor_parallel_size
from k3post.engine.vllm.vllm_engine import engine_options
from k3post.engine.teachers.vllm_teacher import merge_score_checks
from k3post.launch.distill import note_full_vocab_on_vllm, teacher_losses


@pytest.mark.parametrize("utilization, num_gpus, expected", [
    (0.9, 0.0, 0.9),    # no GPU asked (CPU engine, or built outside an actor): as the recipe says
    (0.9, 0.5, 0.45),   # half a GPU: half of what the recipe would give a whole one
    (0.4, 0.25, 0.1),
    (0.9, 1.0, 0.9),    # a whole GPU
    (0.8, 4.0, 0.8),    # whole GPUs, one tensor-parallel rank on each
])
def test_memory_utilization_is_a_fraction_of_the_actors_share(utilization, num_gpus, expected):
    assert engine_memory_utilization(utilization, num_gpus) == pytest.approx(expected)


@pytest.mark.parametrize("requested, num_gpus, expected", [
    (None, 0.0, 1), (2, 0.0, 2),      # no actor GPUs: nothing to follow, the recipe's value (default 1)
    (None, 0.5, 1), (1, 0.5, 1),      # a share of one GPU: one rank
    (None, 1.0, 1), (None, 4.0, 4),   # whole GPUs: one rank each
    (4, 4.0, 4),
])
def test_tensor_parallel_size_follows_the_actors_gpus(requested, num_gpus, expected):
    assert engine_tensor_parallel_size(requested, num_gpus) == expected


@pytest.mark.parametrize("requested, num_gpus, words", [
    (2, 1.0, ["vllm.tensor_parallel_size is 2", "holds 1 GPU", "resources.num_gpus: 1"]),
    (2, 0.5, ["vllm.tensor_parallel_size is 2", "holds 0.5 GPU"]),
    (1, 2.0, ["vllm.tensor_parallel_size is 1", "holds 2 GPUs", "tensor_parallel_size 2"]),
    (None, 1.5, ["resources.num_gpus", "1.5 GPUs cannot be split"]),
])
def test_a_tensor_parallel_size_the_actor_cannot_hold_is_refused(requested, num_gpus, words):
    with pytest.raises(ValueError) as info:
        engine_tensor_parallel_size(requested, num_gpus)
    for word in words:
        assert word in str(info.value)


def test_engine_options_apply_both_rules():
    spec = VllmSpec(gpu_memory_utilization=0.8)
    options = engine_options("/m", spec, num_gpus=0.5)
    assert options["gpu_memory_utilization"] == pytest.approx(0.4) and options["tensor_parallel_size"] == 1
    options = engine_options("/m", spec, num_gpus=2.0)
    assert options["gpu_memory_utilization"] == pytest.approx(0.8) and options["tensor_parallel_size"] == 2


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def _distill(tmp_path: Path, teacher: dict, **top) -> Path:
    _write(tmp_path / "teachers" / "t.yaml", {"kind": "teacher", "model": {"tiny": {"seed": 1}}, **teacher})
    return _write(tmp_path / "r.yaml", {
        "kind": "distill", "student": {"tiny": {}}, "teachers": {"t": "teachers/t.yaml"},
        "data": {"sources": [{"name": "s", "prompts": "builtin:chat", "teacher": "t"}]}, **top})


def test_a_teacher_yaml_whose_tp_size_disagrees_with_its_gpus_fails_at_load(tmp_path):
    path = _distill(tmp_path, {"engine": "vllm", "vllm": {"tensor_parallel_size": 2},
                               "resources": {"num_gpus": 1}})
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "t.yaml" in message and "vllm.tensor_parallel_size is 2" in message and "holds 1 GPU" in message
    # Following the actor (no tensor_parallel_size given), or an HF teacher, loads.
    _distill(tmp_path, {"engine": "vllm", "resources": {"num_gpus": 2}})
    assert load_recipe(path).teachers["t"].vllm.tensor_parallel_size is None
    _distill(tmp_path, {"vllm": {"tensor_parallel_size": 2}, "resources": {"num_gpus": 1}})
    load_recipe(path)


@pytest.mark.parametrize("kind", ["distill", "rl"])
def test_a_sampler_tp_size_that_disagrees_with_its_gpus_fails_at_load(tmp_path, kind):
    sampling = {"engine": "vllm", "vllm": {"tensor_parallel_size": 2}}
    resources = {"learner": {"num_gpus": 1}, "samplers": {"num_gpus": 1}}
    if kind == "distill":
        path = _distill(tmp_path, {}, sampling=sampling, resources=resources)
    else:
        path = _write(tmp_path / "rl.yaml", {
            "kind": "rl", "student": {"tiny": {}}, "sampling": {**sampling, "n": 2}, "resources": resources,
            "data": {"sources": [{"name": "a", "prompts": "builtin:arith", "rewards": [{"fn": "rewards.math:correctness"}]}]}})
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "sampling.vllm.tensor_parallel_size is 2" in str(info.value)
    assert "resources.samplers.num_gpus: 1" in str(info.value)


def test_replica_checks_merge_to_the_largest_max_and_the_mean_of_means():
    merged = merge_score_checks([{"max_abs_diff": 0.2, "mean_abs_diff": 0.1}, None,
                                 {"max_abs_diff": 0.5, "mean_abs_diff": 0.3}])
    assert merged == pytest.approx({"max_abs_diff": 0.5, "mean_abs_diff": 0.2})
    assert merge_score_checks([None, None]) is None


def test_full_vocab_on_a_vllm_teacher_with_gpus_is_refused(tmp_path, capsys):
    teacher = {"engine": "vllm", "loss": {"kind": "full_vocab"}}
    recipe = load_recipe(_distill(tmp_path, {**teacher, "resources": {"num_gpus": 1}}))
    with pytest.raises(UserError, match="teacher 't': the full_vocab loss .* use engine: hf"):
        note_full_vocab_on_vllm(recipe, teacher_losses(recipe))
    recipe = load_recipe(_distill(tmp_path, teacher))  # on a CPU: the HF copy on the CPU is what HF would do
    note_full_vocab_on_vllm(recipe, teacher_losses(recipe))
    assert "HF copy of the teacher on the CPU" in capsys.readouterr().out
