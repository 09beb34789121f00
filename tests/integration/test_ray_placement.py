"""`resources.placement` on a real local Ray cluster (2 fake GPUs: Ray advertises them, nothing
touches CUDA):

- the placement group Ray reserves for a recipe is the plan's (bundles, strategy), and the Ray
  backend puts each group's actors in their bundles: with `colocate`, the learner and both
  sampler replicas see the same GPU - so `auto` resolves to cuda_ipc from what they see - while
  the teachers' bundles are their own;
- a real two-step run on CPU whose every actor (learner, samplers, teachers) lives in the run's
  placement group, with the in-process run's losses.
"""

from __future__ import annotations

import pytest
import ray

from k3post.cli.run import run_recipe
from k3post.config.load import load_distill_recipe
from k3post.config.schema import ResourceSpec
from k3post.launch.backend import EngineSpec
from k3post.launch.distill import build_distill_run
from k3post.loops.distill import run_distill
from k3post.ray.backend import RayBackend, run_placement
from k3post.ray.cluster import actor_env, disconnect
from k3post.ray.weight_sync import resolve_transport
from k3post.track.metrics import read_metrics
from k3post.track.run_dir import prepare_run_dir
from tests.integration.helpers import REPO, SMOKE
from tests.integration.standins import Probe  # a stand-in engine: its actors import only that module

pytestmark = pytest.mark.integration
STEPS = ["train.steps=2", "train.eval_every=0", "train.checkpoint_every=0"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, object_store_memory=200 * 2**20,
             runtime_env={"env_vars": actor_env(), "worker_process_setup_hook": "k3post.engine.common.quiet_libraries"})
    yield
    disconnect()


def test_the_reserved_group_is_the_plan_and_colocated_actors_share_a_gpu(cluster):
    recipe = load_distill_recipe(REPO / SMOKE, [
        "resources.placement.colocate=true", "resources.placement.strategy=strict_pack",
        "resources.learner.num_gpus=0.5", "resources.samplers.num_gpus=0.25", "resources.samplers.replicas=2",
        "teachers.alpha.resources.num_gpus=1"])
    group, plan = run_placement(recipe)
    try:
        table = ray.util.placement_group_table(group)
        assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
        assert [table["bundles"][i] for i in range(len(plan.bundles))] == plan.bundles
        assert plan.bundles[0] == {"CPU": 1.5, "GPU": 1.0} and len(plan.bundles) == 3

        backend = RayBackend((group, plan))
        res = recipe.resources

        def probes(key: str, spec: ResourceSpec) -> list:
            # With a timeout: an actor left outside the group would wait forever for the GPUs it holds.
            return ray.get([a.where.remote() for a in backend._group(EngineSpec(Probe, (), spec), key)], timeout=120)

        learner, samplers = probes("learner", res.learner), probes("samplers", res.samplers)
        alpha = probes("teacher/alpha", recipe.teachers["alpha"].resources)
        everyone = learner + samplers + alpha
        assert {pg for _, pg, _ in everyone} == {group.id.hex()}
        assert len({gpus for _, _, gpus in learner + samplers}) == 1 and len(learner[0][2]) == 1  # one GPU, shared
        assert alpha[0][2] != learner[0][2]  # the teacher's whole GPU is the other one
        seen = [(node, gpus[0]) for node, _, gpus in learner + samplers]
        assert resolve_transport("auto", res, seen) == "cuda_ipc"
    finally:
        ray.util.remove_placement_group(group)


def _placement_group_id(_engine) -> str:
    return ray.get_runtime_context().get_placement_group_id() or ""


def test_a_run_whose_actors_the_placement_group_places_learns_as_in_process(cluster, tmp_path):
    overrides = [*STEPS, "resources.placement.strategy=pack", "resources.placement.colocate=true"]
    recipe = load_distill_recipe(REPO / SMOKE, overrides)
    prepare_run_dir(recipe, tmp_path / "ray", restart=False)
    group, plan = run_placement(recipe)
    backend = RayBackend((group, plan))
    run = build_distill_run(recipe, tmp_path / "ray", backend)
    assert len(backend.actors) == 4 and len(plan.bundles) == 3  # learner + sampler share a bundle; 2 teachers
    assert set(ray.get([a.__ray_call__.remote(_placement_group_id) for a in backend.actors])) == {group.id.hex()}
    run_distill(run)

    assert run_recipe(REPO / SMOKE, overrides, tmp_path / "here", in_process=True, restart=False) == 0
    on_ray, here = read_metrics(tmp_path / "ray" / "metrics.jsonl"), read_metrics(tmp_path / "here" / "metrics.jsonl")
    assert [m["step"] for m in on_ray] == [m["step"] for m in here] and len(here) == 3
    for got, want in zip(on_ray, here):
        for key in ("train/loss", "distill/kl/alpha"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (want["step"], key)
