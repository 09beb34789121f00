"""`resources.placement` (config/placement_schema.py): the bundles a recipe asks Ray for, the
guarantee colocation gives, and the weight transport chosen from it (ray/weight_sync.py:
resolve_transport, a pure function). Ray itself placing the actors: tests/integration/test_ray_placement.py."""

from __future__ import annotations

import pytest

from k3post.config.errors import RecipeError, UserError
from k3post.config.load import load_distill_recipe
from k3post.config.placement_schema import MIN_BUNDLE_CPU, PlacementSpec, group_keys, one_gpu_guaranteed, plan_bundles
from k3post.config.schema import ResourcesSpec
from tests.conftest import REPO

SMOKE = REPO / "recipes/smoke/tiny.yaml"


def recipe(*overrides: str):
    return load_distill_recipe(SMOKE, list(overrides))


def test_one_bundle_per_actor_in_creation_order():
    r = recipe("resources.placement.strategy=spread", "resources.samplers.replicas=2",
               "teachers.beta.resources.replicas=2", "resources.learner.num_cpus=2")
    plan = plan_bundles(group_keys(r), r.resources.placement)
    assert plan.strategy == "SPREAD"
    assert plan.actors == {"learner": [0], "samplers": [1, 2], "teacher/alpha": [3], "teacher/beta": [4, 5]}
    assert plan.bundles[0] == {"CPU": 2.0} and plan.bundles[1] == plan.bundles[2] == {"CPU": 0.5}
    assert len(plan.bundles) == 6


def test_colocate_puts_the_learner_and_every_sampler_in_one_bundle():
    r = recipe("resources.placement.colocate=true", "resources.samplers.replicas=2",
               "resources.samplers.num_gpus=0.25", "resources.learner.num_gpus=0.5")
    plan = plan_bundles(group_keys(r), r.resources.placement)
    assert plan.strategy == "PACK"
    assert plan.actors["learner"] == [0] and plan.actors["samplers"] == [0, 0]
    assert plan.bundles[0] == {"CPU": 1.5, "GPU": 1.0}  # one GPU, shared
    assert plan.actors["teacher/alpha"] == [1] and plan.actors["teacher/beta"] == [2] and len(plan.bundles) == 3
    assert one_gpu_guaranteed(r.resources)


def test_sharded_learner_ranks_each_get_a_bundle_and_rank_0_shares_with_the_samplers():
    r = recipe("resources.placement.colocate=true", "resources.learner.replicas=3")
    plan = plan_bundles(group_keys(r), r.resources.placement)
    assert plan.actors["learner"] == [0, 1, 2] and plan.actors["samplers"] == [0]
    assert plan.bundles[0] == {"CPU": 1.0} and plan.bundles[1] == {"CPU": 0.5}


def test_bundles_ray_accepts_whole_gpus_above_one_and_never_zeros():
    r = recipe("resources.placement.colocate=true", "resources.learner.num_gpus=1", "resources.samplers.num_gpus=0.5",
               "teachers.alpha.resources.num_cpus=0")
    plan = plan_bundles(group_keys(r), r.resources.placement)
    assert plan.bundles[0]["GPU"] == 2.0  # 1.5 GPUs: two whole ones on one node (not one shared GPU)
    assert plan.bundles[plan.actors["teacher/alpha"][0]] == {"CPU": MIN_BUNDLE_CPU}
    assert not one_gpu_guaranteed(r.resources)


def res(learner: float, sampler: float, replicas: int = 1, colocate: bool | None = None, learner_ranks: int = 1):
    spec = {"learner": {"num_gpus": learner, "replicas": learner_ranks},
            "samplers": {"num_gpus": sampler, "replicas": replicas}}
    if colocate is not None:
        spec["placement"] = {"colocate": colocate}
    return ResourcesSpec.model_validate(spec)


@pytest.mark.parametrize("resources, guaranteed", [
    (res(0.5, 0.5), False),  # Ray may put them on one GPU; nothing guarantees it
    (res(0.5, 0.5, colocate=False), False),
    (res(0.5, 0.5, colocate=True), True),
    (res(0.4, 0.3, replicas=2, colocate=True), True),
    (res(0.5, 0.5, replicas=2, colocate=True), False),  # 1.5 GPUs: the bundle is two GPUs
    (res(1, 0.5, colocate=True, learner_ranks=2), False),  # ranks of a sharded learner
    (res(0, 0, colocate=True), False),  # CPUs
])
def test_only_colocation_within_one_gpu_guarantees_a_shared_gpu(resources, guaranteed):
    assert one_gpu_guaranteed(resources) is guaranteed


SAME, APART = [("n", "GPU-a"), ("n", "GPU-a")], [("n", "GPU-a"), ("n", "GPU-b")]


@pytest.mark.parametrize("requested, resources, gpus, lora, expected", [
    ("auto", res(0, 0), [], False, "object_store"),
    ("auto", res(0.5, 0.5, colocate=True), SAME, False, "cuda_ipc"),
    ("auto", res(0.5, 0.5), SAME, False, "object_store"),  # lucky colocation is not trusted
    ("auto", res(0.5, 0.5, colocate=True), SAME, True, "object_store"),  # colocated LoRA: host copies
    ("auto", res(1, 1), APART, False, "collective"),
    ("auto", res(1, 1, colocate=True), APART, False, "collective"),  # one node, a GPU each
    ("cuda_ipc", res(0.5, 0.5, colocate=True), SAME, False, "cuda_ipc"),
    ("cuda_ipc", res(0.5, 0.5), SAME, False, "resources.placement.colocate"),
    ("cuda_ipc", res(0.5, 0.5, colocate=True), SAME, True, "LoRA"),
    ("cuda_ipc", res(0.5, 0.5, colocate=True), APART, False, "resources.placement.colocate"),
    ("collective", res(0.5, 0.5, colocate=True), SAME, False, "NCCL"),
    ("object_store", res(0.5, 0.5, colocate=True), SAME, True, "object_store"),
])
def test_transport_choices(requested, resources, gpus, lora, expected):
    from k3post.ray.weight_sync import resolve_transport

    if expected in ("object_store", "cuda_ipc", "collective"):
        assert resolve_transport(requested, resources, gpus, lora) == expected
    else:
        with pytest.raises(UserError, match=expected):
            resolve_transport(requested, resources, gpus, lora)


def test_cuda_ipc_without_a_guaranteed_shared_gpu_fails_at_load():
    gpus = ["resources.learner.num_gpus=0.5", "resources.samplers.num_gpus=0.5", "sampling.weight_transport=cuda_ipc"]
    with pytest.raises(RecipeError, match="resources.placement.colocate"):
        recipe(*gpus)
    assert recipe(*gpus, "resources.placement.colocate=true").sampling.weight_transport == "cuda_ipc"
    with pytest.raises(RecipeError, match="resources.placement.strategy"):
        recipe("resources.placement.strategy=anywhere")
    assert recipe().resources.placement is None and PlacementSpec().strategy == "pack"


def test_learner_placement_beside_the_run_placement_is_refused_before_ray_starts():
    from k3post.ray.backend import run_placement

    with pytest.raises(UserError, match="drop learner.placement"):
        run_placement(recipe("resources.placement.strategy=pack", "learner.placement=spread"))
    assert run_placement(recipe()) is None  # no resources.placement: Ray places the actors


def test_a_local_cluster_is_sized_for_the_bundles():
    from k3post.launch.engines import cpus_needed

    assert cpus_needed(recipe()) == 2.0
    zero = recipe("resources.placement.strategy=pack", "teachers.alpha.resources.num_cpus=0")
    assert cpus_needed(zero) == pytest.approx(1.5 + MIN_BUNDLE_CPU)  # Ray reserves a sliver for an empty bundle
