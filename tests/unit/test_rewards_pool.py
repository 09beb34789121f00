"""The reward pool: order, weighting, concurrency, and failures that never crash a run."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from k3post.config.errors import UserError
from k3post.rewards.loader import make_reward_spec
from k3post.rewards.pool import RewardPool
from k3post.rewards.protocol import RewardSpec


def length_reward(prompt, completion, meta):
    return float(len(completion))


def tagged_reward(prompt, completion, meta):
    return {"reward": meta["r"], "seen": 1.0}


def test_scores_in_input_order_with_weights_and_metrics():
    pool = RewardPool([RewardSpec("len", length_reward, weight=0.5), RewardSpec("tag", tagged_reward, weight=2.0)])
    batch = pool.score(["p"] * 3, ["a", "bbb", "cc"], [{"r": 1.0}, {"r": 0.0}, {"r": -1.0}])
    assert batch.rewards == pytest.approx([0.5 + 2.0, 1.5, 1.0 - 2.0])
    assert batch.num_failures == 0 and pool.failures == 0
    metrics = batch.metrics()
    assert metrics["rl/reward/len"] == pytest.approx(2.0) and metrics["rl/reward/tag/seen"] == 1.0
    assert metrics["rl/reward/total"] == pytest.approx(sum(batch.rewards) / 3) and metrics["rl/reward/failures"] == 0.0


def test_a_raising_or_malformed_reward_costs_only_that_sample(caplog):
    def flaky(prompt, completion, meta):
        if completion == "boom":
            raise ZeroDivisionError("division by zero")
        return "not a number" if completion == "bad" else 1.0

    pool = RewardPool([RewardSpec("flaky", flaky), RewardSpec("len", length_reward, weight=0.0)])
    with caplog.at_level(logging.WARNING, logger="k3post.rewards.pool"):
        batch = pool.score(["p"] * 3, ["ok", "boom", "bad"], [{}] * 3)
    assert batch.rewards == [1.0, 0.0, 0.0]
    assert "ZeroDivisionError: division by zero" in batch.samples[1].errors["flaky"]
    assert "real number" in batch.samples[2].errors["flaky"]
    assert batch.num_failures == 2 and pool.failures == 2
    assert batch.metrics()["rl/reward/flaky/error"] == pytest.approx(2 / 3)
    assert batch.samples[1].components["rl/reward/len"] == 4.0  # the other reward still scored it
    assert "reward 'flaky' failed on sample 1" in caplog.text


def test_a_hanging_reward_times_out_and_the_pool_moves_on():
    release = threading.Event()

    def hangs(prompt, completion, meta):
        if completion == "hang":
            release.wait(30)  # released at the end of the test, so no thread outlives it for long
        return 1.0

    pool = RewardPool([RewardSpec("hangs", hangs)], max_workers=2, timeout_s=0.3)
    try:
        start = time.monotonic()
        batch = pool.score(["p"] * 4, ["hang", "a", "b", "c"], [{}] * 4)
        elapsed = time.monotonic() - start
        assert batch.rewards == [0.0, 1.0, 1.0, 1.0]
        assert "timed out after 0.3 s" in batch.samples[0].errors["hangs"]
        assert pool.abandoned == 1 and pool.failures == 1
        assert elapsed < 2.0
        assert pool.score(["p"], ["again"], [{}]).rewards == [1.0]  # still usable
    finally:
        release.set()


def test_calls_run_concurrently_up_to_max_workers():
    def slow(prompt, completion, meta):
        time.sleep(0.3)
        return 1.0

    start = time.monotonic()
    RewardPool([RewardSpec("slow", slow)], max_workers=4).score(["p"] * 4, ["x"] * 4, [{}] * 4)
    assert time.monotonic() - start < 0.9  # serial would take 1.2 s
    start = time.monotonic()
    RewardPool([RewardSpec("slow", slow)], max_workers=1).score(["p"] * 3, ["x"] * 3, [{}] * 3)
    assert time.monotonic() - start >= 0.9  # one at a time


def test_submit_returns_a_future():
    pool = RewardPool([RewardSpec("len", length_reward)])
    future = pool.submit(["p", "p"], ["ab", "abcd"], [{}, {}])
    assert future.result(timeout=10).rewards == [2.0, 4.0]
    with pytest.raises(ValueError):
        pool.submit(["p"], ["a", "b"], [{}]).result(timeout=10)


def test_names_must_be_distinct_and_not_reserved():
    with pytest.raises(UserError, match="share the name"):
        RewardPool([RewardSpec("a", length_reward), RewardSpec("a", tagged_reward)])
    with pytest.raises(UserError, match="reserved"):
        RewardPool([RewardSpec("total", length_reward)])


def test_sandboxed_code_rewards_in_parallel():
    spec = make_reward_spec("rewards.code:tests_pass", kwargs={"timeout_s": 2.0})
    good = "```python\ndef sq(x):\n    return x * x\n```"
    bad = "```python\ndef sq(x):\n    return x + x\n```"
    meta = {"tests": ["assert sq(3) == 9", "assert sq(2) == 4"]}
    batch = RewardPool([spec], max_workers=4).score(["p"] * 4, [good, bad, good, bad], [meta] * 4)
    assert batch.rewards == [1.0, 0.5, 1.0, 0.5] and batch.num_failures == 0
