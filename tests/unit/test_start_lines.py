"""The start lines: where a local cluster's CPU slots come from, and the learner group's layout
(k3post/launch/describe.py)."""

from __future__ import annotations

from k3post.config.learner_schema import LearnerSpec
from k3post.launch.describe import cpu_slots_line, learner_group_line


def test_slots_from_the_actors_on_a_small_machine():
    line = cpu_slots_line(4, None, 3.5, 2)
    assert line.startswith("4 CPU slots: the recipe's actors ask for 3.5 (resources.*.num_cpus × replicas summed), "
                           "this machine has 2 cores")
    assert "slots are logical" in line


def test_slots_from_the_cores_when_they_are_more():
    assert cpu_slots_line(8, None, 3, 8) == ("8 CPU slots: this machine's 8 cores (the recipe's actors ask for 3 "
                                             "(resources.*.num_cpus × replicas summed))")


def test_slots_set_in_the_recipe_and_from_placement_bundles():
    line = cpu_slots_line(6, 6, 2.5, 4, placement=True)
    assert line.startswith("6 CPU slots: ray.num_cpus in the recipe; the recipe's actors ask for 2.5 "
                           "(resources.placement's bundles summed), this machine has 4 cores")


def test_learner_group_line():
    spec = LearnerSpec(precision="bf16-mixed", placement="spread")
    assert learner_group_line(2, spec, 1, in_run_group=False) == (
        "learner group: 2 ranks (1 GPU each), placement spread, precision bf16-mixed, "
        "sharding auto (FSDP2 over 2 ranks), shard unit block")
    assert "placement bundles of the run's placement group" in learner_group_line(4, LearnerSpec(), 0, True)
    assert "(CPU)" in learner_group_line(4, LearnerSpec(), 0, True)
