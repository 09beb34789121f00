"""RayLearner.wait names the rank that died, also when a surviving rank's failed collective is
the first error to arrive (real Ray, a local cluster; stand-in rank actors)."""

from __future__ import annotations

import pytest
import ray

from k3post.ray.cluster import disconnect
from k3post.ray.groups import LearnerRankDied, RayLearner
from tests.integration.standins import Rank  # the stand-in rank: its actors import only that module


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20)
    yield
    disconnect()


def _ranks() -> list:
    return [ray.remote(num_cpus=0, max_restarts=0)(Rank).remote() for _ in range(2)]


def test_the_dead_rank_is_named_though_the_survivors_error_came_first(cluster):
    ranks = _ranks()
    refs = [ranks[0].step.remote("peer-gone"), ranks[1].step.remote("die")]
    with pytest.raises(LearnerRankDied, match=r"learner rank 1 of 2 died during step"):
        RayLearner(ranks).wait(refs, "step")


def test_a_failure_with_no_death_is_raised_as_it_is(cluster):
    ranks = _ranks()
    refs = [ranks[0].step.remote("peer-gone"), ranks[1].step.remote("fine")]
    with pytest.raises(ray.exceptions.RayTaskError, match="Connection closed by peer"):
        RayLearner(ranks).wait(refs, "step")
