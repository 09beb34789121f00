"""`RayTeacher.check_scores` on a real Ray cluster (the shared head of conftest.py): every replica
checks its own share of the batch, and the answers merge as the largest max and the mean of the
means (a replica with nothing to compare answers None and is left out). The replicas are stand-ins
that report which rows they were given, so the fan-out itself is what is checked;
VLLMTeacher.check_scores is checked on vLLM in tests/vllm/test_vllm_hazards.py."""

from __future__ import annotations

import pytest
import ray
import torch

from k3post.ray.groups import RayTeacher
from k3post.types import Prompt, Rollouts
from tests.integration.standins import RowsChecker  # a stand-in replica: its actors import only that module

# In `make test` since its stand-in replicas import only tests/integration/standins.py: ~8 s on a
# 2-core CPU machine (74 s while each actor imported this module's torch/k3post stack).
pytestmark = pytest.mark.integration


def _rollouts(sources: list[str]) -> Rollouts:
    B = len(sources)
    return Rollouts([Prompt(str(i + 1), s, "t", (("user", "hi"),)) for i, s in enumerate(sources)], [[1]] * B,
                    torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2), torch.zeros(B, 2))


@pytest.fixture(scope="module")
def teacher(bare_ray_driver):
    """Two stand-in replicas on the shared head (they end when the module's driver detaches)."""
    return RayTeacher([ray.remote(num_cpus=0)(RowsChecker).remote() for _ in range(2)])


def test_every_replica_checks_its_share_and_the_answers_merge(teacher):
    # Rows 1, 2 go to the first replica, 3, 4 to the second: max(2, 4), mean(1.5, 3.5).
    assert teacher.check_scores(_rollouts(["a"] * 4)).result() == {"max_abs_diff": 4.0, "mean_abs_diff": 2.5}
    # A replica with nothing to compare is left out of both figures.
    merged = teacher.check_scores(_rollouts(["a", "a", "empty", "empty"])).result()
    assert merged == {"max_abs_diff": 2.0, "mean_abs_diff": 1.5}
    assert teacher.check_scores(_rollouts(["empty"] * 4)).result() is None
