"""The reward protocol (normalising outputs, combining rewards) and the loader's errors."""

from __future__ import annotations

import functools
import math

import pytest

from k3post.config.errors import UserError
from k3post.rewards.loader import load_reward, make_reward_spec
from k3post.rewards.protocol import RewardSpec, combine_rewards, normalize_output


def test_normalize_float_bool_and_dict():
    assert normalize_output("r", 0.5) == (0.5, {})
    assert normalize_output("r", True) == (1.0, {})
    assert normalize_output("r", {"reward": 2, "passed": 3}) == (2.0, {"passed": 3.0})


@pytest.mark.parametrize("bad", [None, "1.0", math.nan, math.inf, {"passed": 1.0}, {"reward": "x"}, 1j])
def test_normalize_rejects_malformed_outputs(bad):
    with pytest.raises((TypeError, ValueError)):
        normalize_output("r", bad)


def test_combine_is_a_weighted_sum_with_unweighted_components():
    specs = [RewardSpec("correct", lambda p, c, m: 1.0, weight=1.0), RewardSpec("fmt", lambda p, c, m: 0.0, weight=0.1),
             RewardSpec("len", lambda p, c, m: -0.5, weight=0.5)]
    sample = combine_rewards(specs, {"correct": {"reward": 1.0, "passed": 4.0}, "fmt": 1.0, "len": -0.5})
    assert sample.reward == pytest.approx(1.0 + 0.1 * 1.0 + 0.5 * -0.5)
    assert sample.components == {"rl/reward/correct": 1.0, "rl/reward/correct/passed": 4.0,
                                 "rl/reward/fmt": 1.0, "rl/reward/len": -0.5}
    assert sample.errors == {}


def test_combine_counts_errors_and_malformed_outputs_as_zero():
    specs = [RewardSpec("a", print, weight=2.0), RewardSpec("b", print, weight=1.0), RewardSpec("c", print, weight=1.0)]
    sample = combine_rewards(specs, {"a": 0.5, "b": {"no_reward_key": 1.0}}, errors={"c": "ValueError: boom"})
    assert sample.reward == pytest.approx(1.0)
    assert sample.components["rl/reward/b"] == 0.0 and sample.components["rl/reward/b/error"] == 1.0
    assert sample.components["rl/reward/c/error"] == 1.0 and "rl/reward/a/error" not in sample.components
    assert set(sample.errors) == {"b", "c"} and "reward" in sample.errors["b"]


def test_spec_binds_kwargs():
    spec = RewardSpec("len", lambda p, c, m, target: float(len(c) > target), kwargs={"target": 3})
    assert spec("", "abcd", {}) == 1.0 and spec("", "ab", {}) == 0.0


def test_load_shipped_rewards_by_module_path():
    from rewards import format as shipped_format

    assert load_reward("rewards.format:boxed") is shipped_format.boxed
    spec = make_reward_spec("rewards.length:penalty", weight=0.5, kwargs={"target": 10})
    assert spec.name == "penalty" and spec.weight == 0.5 and spec("", "x" * 15, {}) == pytest.approx(-0.5)


def test_a_users_file_under_root_wins_and_py_paths_load(tmp_path):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine_k3post_test.py").write_text("def f(prompt, completion, meta):\n    return 0.25\n")
    assert load_reward("rewards.mine_k3post_test:f", root=tmp_path)("", "", {}) == 0.25
    script = tmp_path / "scoring.py"
    script.write_text("def g(prompt, completion, meta):\n    return len(completion)\n")
    assert load_reward(f"{script}:g")("", "abc", {}) == 3


@pytest.mark.parametrize(
    "target,message",
    [
        ("rewards.math", "expected '<module>:<function>'"),
        (":correctness", "expected '<module>:<function>'"),
        ("rewards.no_such_module_xyz:f", "no module 'rewards.no_such_module_xyz'"),
        ("no_such_package_xyz.sub:f", "no module"),
        ("rewards.format:no_such_fn", "has no attribute 'no_such_fn'"),
        ("rewards.format:BOX_COMMANDS", "not a function"),
        ("/no/such/file.py:f", "no such file"),
    ],
)
def test_loader_errors_name_the_target(target, message):
    with pytest.raises(UserError) as info:
        load_reward(target)
    assert repr(target) in str(info.value) and message in str(info.value)


def test_loader_reports_errors_inside_the_module(tmp_path):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "broken_k3post_test.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(UserError, match="importing .* failed: ModuleNotFoundError"):
        load_reward("rewards.broken_k3post_test:f", root=tmp_path)


def test_partials_are_callables_too(tmp_path):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "partial_k3post_test.py").write_text(
        "import functools\n\ndef f(p, c, m, k):\n    return k\n\nbound = functools.partial(f, k=0.5)\n"
    )
    fn = load_reward("rewards.partial_k3post_test:bound", root=tmp_path)
    assert isinstance(fn, functools.partial) and fn("", "", {}) == 0.5
