"""The FP8 weight sync (`sampling.weights: fp8` with QAT; model/quant/fp8_sync.py) on a real Ray
cluster (the shared head of conftest.py), over the two transports a CPU has: Ray's object store
and the collective (gloo). Per transport: the sampler replica ends up holding the e4m3 bytes and
scales the learner actor sent (the push's weight check passes, and the replica's quantised Linears
are in the FP8 form), its logprobs of its own samples equal the learner actor's fake-quantised
forward on the same tokens (< 1e-6), and one flipped byte of an e4m3 weight on the way in stops the
push naming that tensor. (In process: tests/unit/test_fp8_sync.py.)"""

from __future__ import annotations

import pytest
import ray

from k3post.algo.objectives import SampledTokenPG
from k3post.config.load import load_distill_recipe
from k3post.config.schema import SamplingSpec
from k3post.engine.transport.weight_check import WeightSyncMismatch, checked_names
from k3post.launch.engines import learner_config, sampler_spec
from k3post.ray.backend import RayBackend
from k3post.ray.weight_sync import connect_weights
from k3post.types import Prompt, SamplingParams
from tests.integration.helpers import REPO, SMOKE

pytestmark = pytest.mark.integration

PROMPTS = [Prompt(f"u{i}", "s", "alpha", (("user", f"Question number {i}?"),)) for i in range(3)]


@pytest.fixture(scope="module")
def actors(ray_driver):
    """The smoke recipe with QAT and FP8 rollouts: its learner and one sampler replica, on the
    shared head (they end when the module's driver detaches)."""
    recipe = load_distill_recipe(REPO / SMOKE, ["qat.enabled=true", "sampling.weights=fp8"])
    backend = RayBackend()
    config = learner_config(recipe, SampledTokenPG(), fp8_weights=True)
    learner = backend.learner(config, recipe.learner, recipe.resources.learner)
    samplers = backend.samplers(sampler_spec(recipe), 0)
    backend.start("learner, 1 sampler")
    ray.get(learner.rank0.__ray_call__.remote(_train_a_little))
    return recipe, learner, samplers


def _train_a_little(engine) -> None:
    """Runs in the learner actor: weights the sampler does not start with."""
    import torch

    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in engine.model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.dtype))


def _forms(engine) -> set[bool]:
    from k3post.model.quant.fp8_linear import Fp8Linear

    return {m.holds_fp8 for m in engine.model.modules() if isinstance(m, Fp8Linear)}


def _learner_logprobs(engine, rollouts):
    import torch

    from k3post.model.scoring.logprobs import completion_logprobs

    engine._update_fake_quant()  # as its step does first
    with torch.no_grad():
        return completion_logprobs(engine.model, rollouts.prompt_ids, rollouts.completion_ids_BT,
                                   rollouts.loss_mask_BT, engine.tokenizer.pad_token_id, 1.0)


def _flip_on_the_way_in(engine, name: str) -> None:
    """Runs in a sampler actor: the lowest bit of `name`'s first byte flips in what it loads."""
    import torch

    import k3post.engine.samplers.sampler as module

    module.clean_import_weights = getattr(module, "clean_import_weights", module.import_weights)

    def flipped(model, weights: dict) -> None:
        weights = dict(weights)
        weights[name] = torch.as_tensor(weights[name]).clone()
        weights[name].view(-1)[0] ^= 1
        module.clean_import_weights(model, weights)

    module.import_weights = flipped


def _restore(engine) -> None:
    import k3post.engine.samplers.sampler as module

    module.import_weights = module.clean_import_weights


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_the_fp8_sync_reaches_a_sampler_actor_and_it_samples_the_learners_qat_forward(actors, transport):
    recipe, learner, samplers = actors
    sync = connect_weights(SamplingSpec(weight_transport=transport), recipe.resources, learner, samplers)
    sync.push(1)  # checked: the window of v1
    assert ray.get(samplers.actors[0].__ray_call__.remote(_forms)) == {True}
    rollouts = samplers.sample(PROMPTS, SamplingParams(max_new_tokens=8, seed=1))
    learner_lp = ray.get(learner.rank0.__ray_call__.remote(_learner_logprobs, rollouts))
    mask = rollouts.loss_mask_BT.bool()
    assert mask.sum() > 0
    assert float((rollouts.sampler_logprobs_BT - learner_lp)[mask].abs().max()) < 1e-6

    names = [info.name for info in ray.get(learner.rank0.fp8_weight_manifest.remote())]
    target = "model.layers.0.mlp.down_proj.weight"
    version = next(v for v in range(2, 100) if target in checked_names(names, v))
    ray.get(samplers.actors[0].__ray_call__.remote(_flip_on_the_way_in, target))
    with pytest.raises(WeightSyncMismatch, match=rf"v{version}: sampler replica 0 does not hold the learner's "
                                                 rf"'{target}'"):
        sync.push(version)
    ray.get(samplers.actors[0].__ray_call__.remote(_restore))
    sync.push(version)
