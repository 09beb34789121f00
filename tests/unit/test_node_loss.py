"""The line that ends a run whose Ray node left the cluster (ray/node_loss.py), without a cluster:
which node, its address and the actors it held, from the places recorded at start; a node that Ray
names in the error is taken at its word at once, an unreachable actor waits for Ray's verdict on its
node, and a process that died alone on a live node is no node loss. On a real 3-node Ray cluster:
tests/integration/test_ray_multinode.py."""

from __future__ import annotations

import ray.exceptions

from k3post.ray.backend import actor_label
from k3post.ray.node_loss import NodeLost, Place, explain_node_loss, node_loss_line

A, B, C = "a" * 56, "b" * 56, "c" * 56
PLACES = [Place("learner rank 0 of 2", A, "10.0.0.1"), Place("learner rank 1 of 2", B, "10.0.0.2"),
          Place("sampler replica 0", C, "10.0.0.3"), Place("teacher alpha", A, "10.0.0.1"),
          Place("teacher beta", B, "10.0.0.2")]


def test_the_line_names_the_node_its_address_and_every_actor_it_held():
    line = node_loss_line(PLACES, {B})
    assert line.startswith(f"lost Ray node {B} (10.0.0.2) with learner rank 1 of 2, teacher beta: ")
    assert "re-run the same command" in line and "2 other nodes" in line and "\n" not in line
    assert A not in line and "teacher alpha" not in line


def test_two_lost_nodes_are_both_named_and_a_dead_node_of_no_actor_is_none():
    line = node_loss_line(PLACES, {A, C})
    assert f"{A} (10.0.0.1) with learner rank 0 of 2, teacher alpha; Ray node {C} (10.0.0.3) with sampler" in line
    assert "1 other node)" in line
    assert node_loss_line(PLACES, {"d" * 56}) is None


def test_labels_follow_the_group_keys():
    assert [actor_label("learner", 1, 2), actor_label("learner", 0, 1)] == ["learner rank 1 of 2", "learner"]
    assert actor_label("samplers", 0, 1) == "sampler replica 0"
    assert [actor_label("teacher/math", 0, 1), actor_label("reward_model/rm", 1, 2)] == [
        "teacher math", "reward model rm replica 1"]


class Script:
    """What Ray's GCS answers, call by call: the node goes dead after `after` questions."""

    def __init__(self, dead: set[str], after: int):
        self.dead, self.after, self.calls = dead, after, 0

    def __call__(self, nodes: set[str]) -> set[str]:
        self.calls += 1
        return self.dead & nodes if self.calls > self.after else set()


def test_a_node_named_by_ray_is_taken_at_once():
    died = ray.exceptions.ActorDiedError()
    try:
        try:
            raise died
        except ray.exceptions.ActorDiedError:
            raise RuntimeError(f"The actor died because its node has died. Node Id: {B}") from None
    except RuntimeError as err:
        gcs = Script(set(), after=0)
        lost = explain_node_loss(err, PLACES, wait_s=5.0, dead_of=gcs)
    assert isinstance(lost, NodeLost) and B in str(lost) and "teacher beta" in str(lost)
    assert gcs.calls == 1  # asked once, no wait


def test_an_unreachable_actor_waits_for_the_verdict_on_its_node():
    gone = ray.exceptions.ActorUnavailableError("The actor is temporarily unavailable: Socket closed", None)
    gcs = Script({A}, after=2)
    lost = explain_node_loss(gone, PLACES, wait_s=5.0, dead_of=gcs)
    assert isinstance(lost, NodeLost) and f"{A} (10.0.0.1) with learner rank 0 of 2, teacher alpha" in str(lost)
    assert gcs.calls == 3
    assert explain_node_loss(gone, PLACES, wait_s=0.6, dead_of=Script(set(), after=0)) is None  # no node died


def test_a_process_that_died_alone_is_no_node_loss_and_is_not_waited_for():
    gcs = Script({A}, after=5)
    assert explain_node_loss(ray.exceptions.ActorDiedError(), PLACES, wait_s=30.0, dead_of=gcs) is None
    assert gcs.calls == 1


def test_an_error_raised_by_a_call_is_no_node_loss_and_is_not_waited_for():
    gcs = Script({A}, after=5)
    assert explain_node_loss(ValueError("a bug in a rank"), PLACES, wait_s=30.0, dead_of=gcs) is None
    assert gcs.calls == 1
