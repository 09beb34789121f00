"""The weight broadcast group over gloo, in real processes: rank 0 hosts the store on a port the
OS picks, and what it sends every receiver gets bit for bit (float32 and bfloat16, numpy or
torch), in the manifest's order and names - the full weights and, in a group formed with both
manifests, the FP8 payload (e4m3 bytes + scales, model/quant/fp8_sync.py), a one-byte header saying
which; a send of weights that match neither manifest raises; every rank leaves cleanly. Plus the
choice of transport from the actors' placement."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from k3post.config.errors import UserError
from k3post.config.placement_schema import PlacementSpec
from k3post.engine.transport.weight_broadcast import TensorInfo, WeightGroup, fp8_manifest, manifest_of, open_store
from k3post.model.quant.fp8_sync import fp8_payload
from tests.spawned_rank import leave_without_teardown

FP8_LAYERS = ["layers.0.mlp"]


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(7, 5, generator=g),
            "layers.0.mlp.weight": torch.randn(3, 7, generator=g).to(torch.bfloat16),
            "norm.weight": torch.randn(5, generator=g).numpy()}  # a numpy array, as CPU learners export


def sent(step: int) -> dict:
    """Step 3 is sent in FP8 (as a learner whose fake quantisation turned on)."""
    return fp8_payload(weights(step), FP8_LAYERS) if step == 3 else weights(step)


def as_bytes(value) -> np.ndarray:
    return torch.as_tensor(value).contiguous().view(torch.uint8).numpy()


def _rank(rank: int, world: int, ports, manifest: list, out) -> None:
    if rank == 0:
        store = open_store("127.0.0.1", 0, world, 0)
        for _ in range(world - 1):
            ports.put(store.port)
    else:
        store = open_store("127.0.0.1", ports.get(timeout=60), world, rank)
    group = WeightGroup(store, world, rank, "gloo", manifest, fp8_manifest(manifest, FP8_LAYERS))
    if rank == 0:
        for step in (1, 2, 3):  # three steps, the last in FP8
            group.send(sent(step))
        try:
            group.send({"embed.weight": torch.zeros(7, 5)})
        except ValueError as e:
            out.put((rank, "refused", str(e)))
    else:
        got = [group.receive() for _ in range(3)]
        out.put((rank, "got", [{k: as_bytes(v) for k, v in step.items()} for step in got],
                 [{k: str(v.dtype) for k, v in step.items()} for step in got]))
    group.close()  # every rank leaves cleanly (a raise here fails the process's exit code)
    leave_without_teardown(out)


def test_every_receiver_gets_every_step_bit_for_bit():
    world = 3
    manifest = manifest_of(weights(1))
    assert manifest[1] == TensorInfo("layers.0.mlp.weight", (3, 7), "bfloat16")
    assert manifest[2] == TensorInfo("norm.weight", (5,), "float32")
    ctx = mp.get_context("spawn")
    out, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, ports, manifest, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    refused = [r for r in results if r[1] == "refused"]
    assert len(refused) == 1 and "manifest" in refused[0][2]
    received = [r for r in results if r[1] == "got"]
    assert sorted(r[0] for r in received) == [1, 2]
    for _, _, steps, dtypes in received:
        for seed, step, step_dtypes in zip((1, 2, 3), steps, dtypes):
            want = sent(seed)
            assert list(step) == list(want)
            mlp = {"layers.0.mlp.weight": "torch.bfloat16"} if seed < 3 else {
                "layers.0.mlp.weight": "torch.uint8", "layers.0.mlp.weight_scale": "torch.float32"}
            assert step_dtypes == {"embed.weight": "torch.float32", **mlp, "norm.weight": "torch.float32"}
            for name, value in want.items():
                np.testing.assert_array_equal(step[name], as_bytes(value))


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="nccl or gloo"):
        WeightGroup(open_store("127.0.0.1", 0, 1, 0), 1, 0, "mpi", [])


def test_cuda_ipc_refuses_host_weights():
    from k3post.engine.transport.weight_broadcast import ipc_handles

    with pytest.raises(ValueError, match="cuda_ipc needs the learner's weights on its GPU"):
        ipc_handles(weights(1))


@pytest.mark.parametrize("learner_gpus, sampler_gpus, gpus, expected", [
    (0, 0, [], "object_store"),  # a CPU run keeps restartable samplers
    (1, 0, [], "object_store"),
    (0.5, 0.5, [("n", "GPU-a"), ("n", "GPU-a")], "object_store"),  # colocated by luck: cuda_ipc needs
    # resources.placement.colocate to guarantee it (tests/unit/test_placement.py)
    (1, 1, [("n", "GPU-a"), ("n", "GPU-b"), ("n", "GPU-c")], "collective"),  # each its own
    (0.5, 0.5, [("n", "GPU-a"), ("n", "GPU-a"), ("n", "GPU-b")], "object_store"),  # neither fits
])
def test_auto_transport_follows_the_placement(learner_gpus, sampler_gpus, gpus, expected):
    from k3post.config.schema import SamplingSpec
    from k3post.launch.engines import ACTOR_RESTARTS, sampler_restarts
    from k3post.ray.weight_sync import resolve_transport

    res = resources(learner_gpus, sampler_gpus)
    assert resolve_transport("auto", res, gpus) == expected
    restarts = sampler_restarts(SamplingSpec(), res)
    assert restarts == (ACTOR_RESTARTS if not gpus else 0) and ACTOR_RESTARTS > 0


def resources(learner_gpus: float, sampler_gpus: float):
    from k3post.config.schema import ResourcesSpec

    return ResourcesSpec.model_validate({"learner": {"num_gpus": learner_gpus}, "samplers": {"num_gpus": sampler_gpus}})


def test_a_forced_transport_the_placement_cannot_carry_is_a_clear_error():
    from k3post.ray.weight_sync import resolve_transport

    apart, together = [("n", "GPU-a"), ("n", "GPU-b")], [("n", "GPU-a"), ("n", "GPU-a")]
    with pytest.raises(UserError, match="cuda_ipc needs the learner and every sampler on one GPU"):
        resolve_transport("cuda_ipc", resources(1, 1), apart)
    with pytest.raises(UserError, match="NCCL, which needs the learner and every sampler replica on a GPU of its own"):
        resolve_transport("collective", resources(0.5, 0.5), together)
    colocated = resources(0.5, 0.5).model_copy(update={"placement": PlacementSpec(colocate=True)})
    assert resolve_transport("cuda_ipc", colocated, together) == "cuda_ipc"
    assert resolve_transport("collective", resources(1, 1), apart) == "collective"
    assert resolve_transport("collective", resources(0, 0), []) == "collective"  # gloo on CPUs
    assert resolve_transport("object_store", resources(0.5, 0.5), together) == "object_store"


def test_a_sampler_whose_engine_core_runs_apart_hands_it_the_learners_ipc_handles_unopened(monkeypatch):
    """Under Ray with cuda_ipc, a sleeping vLLM sampler (its engine core a third process) passes the
    learner's handles on as they came: the core maps them itself, since torch refuses to share a
    tensor the actor had mapped (measured on an H100, 2026-12-07). Nothing is mapped in the actor
    until an evaluation builds the HF copy."""
    import pickle

    from k3post.config.schema import VllmSpec
    from k3post.engine.samplers.vllm_sampler import VLLMSampler
    from k3post.engine.transport import weight_broadcast
    from k3post.engine.transport.weight_broadcast import IpcHandles
    from k3post.engine.vllm.sleep import Sleeper

    def mapped(handles):
        raise AssertionError("the actor mapped the learner's handles")

    from k3post.engine.samplers import vllm_sampler

    for module in (weight_broadcast, vllm_sampler):  # the base class's mapping, and the sampler's own
        monkeypatch.setattr(module, "open_ipc_handles", mapped)
    received = []

    class ApartCore:  # an LLM whose engine core runs in a process of its own
        k3post_own_process = True

        def collective_rpc(self, fn, args=()):
            received.append(args[0])
            return [[]]  # every parameter written

        def reset_prefix_cache(self):
            pass

    sampler = VLLMSampler.__new__(VLLMSampler)
    sampler.llm, sampler.vllm_spec, sampler.weight_version = ApartCore(), VllmSpec(), 0
    sampler.sleeper, sampler._weights, sampler._hf = Sleeper(sampler.llm, False), None, None
    handles = {"model.embed_tokens.weight": ("rebuild", (0, b"handle", 4096))}
    assert sampler.load_ipc_weights(handles, 3) == 3 and sampler.weight_version == 3
    (kind, data), = received
    assert kind == "cuda_ipc" and pickle.loads(data) == handles
    assert isinstance(sampler._weights, IpcHandles) and dict(sampler._weights) == handles
