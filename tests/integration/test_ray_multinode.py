"""A run on a real multi-node Ray cluster on one machine: Ray's own mini-cluster
(`ray.cluster_utils.Cluster`: a head and two worker nodes, each its own raylet with its own CPUs
and object store), with the smoke recipe's learner as 2 gloo ranks, `resources.placement: spread`
and the weights broadcast over gloo (`sampling.weight_transport: collective`):

- spread puts the two learner ranks on different nodes and the sampler on a third, every actor
  in the bundle the plan gives it (and every actor imports this checkout's k3post); the weights
  cross nodes over gloo, each push verified (ray/weight_sync.py: verify_sync), and the run
  reproduces the one-process run's metrics at every step; both ranks' checkpoint shards land in
  the one run directory; where the host name resolves to loopback (as here) the gloo ends bind the
  interface of the node address;
- removing the node that holds a learner rank mid-run (`Cluster.remove_node`) ends `k3post run`
  with one line naming the node and the actors it held, and the same command resumes on the two
  nodes left and ends with the uninterrupted run's metrics.

The reference is `tiny_reference` (conftest.py): the same recipe in one process, no Ray.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

import k3post.ray.weight_sync as weight_sync
from k3post.config.load import load_distill_recipe
from k3post.engine.transport.gloo_interface import IFNAME_ENV, host_name_is_loopback, interface_with
from k3post.launch.distill import build_distill_run
from k3post.loops.distill import run_distill
from k3post.ray.backend import RayBackend, actor_label, run_placement
from k3post.ray.cluster import actor_env, disconnect
from k3post.ray.weight_sync import leave_weight_groups
from k3post.track.metrics import read_metrics
from k3post.track.run_dir import prepare_run_dir
from tests.integration.helpers import (ARGS, BIN, REPO, SMOKE, STEPS, assert_same_run, env_without_ray_address,
                                       logged_steps, wait_for)

pytestmark = pytest.mark.integration
NODE_CPUS = 2  # logical: 5 actors of 0.5 CPU fit on any 2 of the 3 nodes (resume after a node is lost)
NODE_STORE = 100 * 2**20
MULTINODE = ["resources.learner.replicas=2", "resources.placement.strategy=spread",
             "sampling.weight_transport=collective"]
RANKS = [actor_label("learner", rank, 2) for rank in range(2)]


@pytest.fixture(scope="module")
def three_nodes():
    """A head and two worker nodes on this machine; this process is a driver on the head.

    Torn down whatever the tests did: the driver leaves first (Ray refuses to remove the node a
    driver is attached to), then every node's processes are stopped and the temp dir removed, so
    a later module's `ray.init(address="local")` starts clean."""
    temp_dir = Path("/tmp") / f"k3mn-{os.getpid()}"  # Ray wants a short socket path
    cluster = Cluster(shutdown_at_exit=True)
    machine_wide = pytest.MonkeyPatch()
    # Cluster records its head in /tmp/ray/ray_current_cluster (and deletes that file when it shuts
    # down), where `ray.init()` and `ray start` of anyone else on the machine look: leave it alone.
    machine_wide.setattr(ray._private.utils, "write_ray_address", lambda *args, **kwargs: None)
    machine_wide.setattr(ray._common.utils, "reset_ray_address", lambda *args, **kwargs: None)
    try:
        cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=NODE_STORE, include_dashboard=False,
                         temp_dir=str(temp_dir))
        for _ in range(2):
            cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=NODE_STORE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={
            "env_vars": actor_env(), "worker_process_setup_hook": "k3post.engine.common.quiet_libraries"})
        yield cluster
    finally:
        disconnect()
        cluster.shutdown()
        machine_wide.undo()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _gloo_interface(_engine) -> str | None:
    return os.environ.get(IFNAME_ENV)


def _k3post_file(_engine) -> str:
    import k3post  # noqa: PLC0415

    return k3post.__file__


def test_spread_places_the_ranks_apart_and_the_weights_cross_nodes_checked(three_nodes, tmp_path, monkeypatch,
                                                                          tiny_reference):
    recipe = load_distill_recipe(REPO / SMOKE, [*ARGS, *MULTINODE])
    run_dir = tmp_path / "run"
    prepare_run_dir(recipe, run_dir, restart=False)
    checked, verify = [], weight_sync.verify_sync

    def verify_and_count(learner, samplers, version: int) -> None:
        verify(learner, samplers, version)  # raises WeightSyncMismatch on any difference
        checked.append(version)

    monkeypatch.setattr(weight_sync, "verify_sync", verify_and_count)
    group, plan = run_placement(recipe)
    backend = RayBackend((group, plan))
    try:
        check_the_run(build_distill_run(recipe, run_dir, backend), backend, (group, plan), checked, tiny_reference)
    finally:  # free the cluster for the next test: its own run needs the nodes
        leave_weight_groups()
        for actor in backend.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(group)


def check_the_run(run, backend: RayBackend, placed, checked: list[int], tiny_reference: list[dict]) -> None:
    group, plan = placed
    run_dir = run.run_dir
    where = {place.label: place.node_id for place in backend.places}
    bundle_nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
    for key, bundles in plan.actors.items():  # every actor in its planned bundle, on that bundle's node
        for index, bundle in enumerate(bundles):
            assert where[actor_label(key, index, len(bundles))] == bundle_nodes[bundle], key
    assert len(where) == 5 and len(set(where.values())) == 3  # 2 ranks, the sampler, 2 teachers: all 3 nodes
    assert where[RANKS[0]] != where[RANKS[1]]
    assert where["sampler replica 0"] not in (where[RANKS[0]], where[RANKS[1]])  # the broadcast leaves rank 0's node
    files = ray.get([actor.__ray_call__.remote(_k3post_file) for actor in backend.actors])
    assert {Path(f).resolve() for f in files} == {REPO / "k3post" / "__init__.py"}

    # This machine's host name resolves to loopback: gloo would bind 127.0.0.1 where the ranks and the
    # sampler must reach each other over the node address (engine/transport/gloo_interface.py).
    want = interface_with(backend.places[0].address) if host_name_is_loopback() else None
    gloo_ends = [actor for actor, label in zip(backend.actors, backend.labels) if not label.startswith("teacher")]
    assert ray.get([actor.__ray_call__.remote(_gloo_interface) for actor in gloo_ends]) == [want] * 3

    run_distill(run)
    assert checked == list(range(STEPS + 1))  # every push (the initial one too) verified, every check passed
    assert_same_run(read_metrics(run_dir / "metrics.jsonl"), tiny_reference)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step-{s}" for s in range(STEPS - 2, STEPS + 1)]  # keep_checkpoints=3, no temp left
    shards = {p.name.split("_")[2] for p in (run_dir / "checkpoints" / f"step-{STEPS}" / "dcp").glob("__*.distcp")}
    assert shards == {"0", "1"}  # both ranks (two nodes) wrote into the one run directory
    assert (run_dir / "checkpoints" / f"step-{STEPS}" / "COMPLETE").is_file()


def start(cluster: Cluster, run_dir: Path, log: Path) -> subprocess.Popen:
    """`k3post run` as a user would type it on the head, joining the cluster by RAY_ADDRESS."""
    env = env_without_ray_address(RAY_ADDRESS=cluster.address)
    with open(log, "a") as out:
        return subprocess.Popen([str(BIN / "k3post"), "run", SMOKE, *ARGS, *MULTINODE, "--run-dir", str(run_dir)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def worker_node_of_a_rank(cluster: Cluster):
    """A worker node (never the head: the drivers are attached to it) that holds a learner rank."""
    alive = cluster.global_state.actor_table(None, actor_state_name="ALIVE").values()
    ours = ray.get_runtime_context().get_job_id()  # this process's job: not the run's
    rank_nodes = {a["Address"]["NodeID"] for a in alive
                  if a["ActorClassName"] == "ShardedLearner" and a["JobID"] != ours}
    assert len(rank_nodes) == 2, rank_nodes
    return next(node for node in cluster.worker_nodes if node.node_id in rank_nodes)


@pytest.mark.slow  # opt-in (K3POST_SLOW=1; 181-198 s on the busy 2-core machine: two runs' actor start-ups and
# Ray's ~14 s to declare a SIGKILLed node dead). In make test: the message itself (tests/unit/test_node_loss.py) and
# the resume after a dead learner rank (test_ray_learner_ranks.py).
def test_a_lost_node_is_named_in_one_line_and_the_same_command_resumes_on_the_nodes_left(three_nodes, tmp_path,
                                                                                        tiny_reference):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(three_nodes, run_dir, log)
    try:
        wait_for(lambda: 2 in logged_steps(run_dir), proc, log)
        victim = worker_node_of_a_rank(three_nodes)
        three_nodes.remove_node(victim, allow_graceful=False)  # SIGKILL: the machine is gone
        assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]
    finally:
        proc.kill()
    output = log.read_text()
    assert "on 3 Ray nodes" in output
    errors = [line for line in output.splitlines() if line.startswith("k3post: error:")]
    assert len(errors) == 1 and errors[0].startswith("k3post: error: lost Ray node "), output[-3000:]
    assert victim.node_id in errors[0] and "learner rank" in errors[0] and "re-run the same command" in errors[0]
    assert "Traceback" not in output
    assert STEPS not in logged_steps(run_dir)

    rerun_log = tmp_path / "rerun.log"
    rerun = start(three_nodes, run_dir, rerun_log)
    try:
        assert rerun.wait(timeout=400) == 0, rerun_log.read_text()[-4000:]
    finally:
        rerun.kill()
    resumed = rerun_log.read_text()
    assert "resumed from" in resumed and "on 2 Ray nodes" in resumed, resumed[-3000:]
    assert_same_run(read_metrics(run_dir / "metrics.jsonl"), tiny_reference)
