"""The weight-sync check (ray/weight_sync.py: verify_sync) on a real Ray cluster (the shared head of
conftest.py), with the object-store transport and the collective one (gloo on CPUs), two sampler
replicas each: clean pushes pass and do check, a tensor perturbed on its way into replica 1 stops
the push with one line naming the tensor, the version and replica 1, and once the receiver is
restored the next push passes. (In process: tests/unit/test_weight_check.py.)"""

from __future__ import annotations

import pytest
import ray

from k3post.algo.objectives import SampledTokenPG
from k3post.config.load import load_distill_recipe
from k3post.config.schema import SamplingSpec
from k3post.engine.transport.weight_check import WeightSyncMismatch, checked_names
from k3post.launch.engines import learner_config, sampler_spec
from k3post.ray.backend import RayBackend
from k3post.ray.groups import RaySamplers
from k3post.ray.weight_sync import connect_weights
from tests.integration.helpers import REPO, SMOKE

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def actors(ray_driver):
    """The smoke recipe's learner and two sampler replicas (no teachers: the sync needs none), on
    the shared head (they end when the module's driver detaches)."""
    recipe = load_distill_recipe(REPO / SMOKE, ["resources.samplers.replicas=2"])
    backend = RayBackend()
    learner = backend.learner(learner_config(recipe, SampledTokenPG()), recipe.learner, recipe.resources.learner)
    samplers = backend.samplers(sampler_spec(recipe), 0)
    backend.start("learner, 2 samplers")
    return recipe, learner, samplers


def _corrupt_receiver(engine, name: str) -> None:
    """Runs in a sampler actor: what it loads from now on has `name` perturbed (a fault in transit,
    whichever transport brought the weights: both end in the engine's `import_weights`)."""
    import torch

    import k3post.engine.samplers.sampler as module

    module.clean_import_weights = getattr(module, "clean_import_weights", module.import_weights)

    def corrupted(model, weights: dict) -> None:
        weights = dict(weights)
        weights[name] = torch.as_tensor(weights[name]).clone()
        weights[name].view(-1)[0] += 1e-3
        module.clean_import_weights(model, weights)

    module.import_weights = corrupted


def _restore_receiver(engine) -> None:
    import k3post.engine.samplers.sampler as module

    module.import_weights = module.clean_import_weights


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_a_tensor_corrupted_in_transit_stops_the_push_naming_it_and_a_clean_push_passes(actors, transport,
                                                                                       monkeypatch):
    recipe, learner, samplers = actors
    sync = connect_weights(SamplingSpec(weight_transport=transport), recipe.resources, learner, samplers)
    calls = []
    original = RaySamplers.weight_checksums
    monkeypatch.setattr(RaySamplers, "weight_checksums", lambda self, n: calls.append(n) or original(self, n))
    sync.push(1)  # clean: silent
    sync.push(2)
    assert len(calls) == 2 and calls[0] != calls[1]  # checked after each push, a different window each time

    version = 3
    every = ray.get(learner.rank0.weight_manifest.remote())
    target = checked_names([info.name for info in every], version)[2]
    ray.get(samplers.actors[1].__ray_call__.remote(_corrupt_receiver, target))
    with pytest.raises(WeightSyncMismatch) as err:
        sync.push(version)
    message = str(err.value)
    assert f"v{version}: sampler replica 1 does not hold the learner's '{target}'" in message and "\n" not in message

    ray.get(samplers.actors[1].__ray_call__.remote(_restore_receiver))
    sync.push(version)  # the transport restored: the same version syncs and checks clean
    assert samplers.version == version
