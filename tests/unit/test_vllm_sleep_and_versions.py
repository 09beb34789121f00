"""vLLM's sleep mode around engine turns (engine/vllm/sleep.py) on a scripted engine, the releases
the vLLM engines accept (engine/vllm/versions.py), and where `vllm.sleep` is refused at load.
The GPU side (memory handed back, identical tokens after a wake) is tests/gpu/test_vllm_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import k3post.engine.vllm.sleep as sleep_module
from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, ResourceSpec, TeacherSpec, TinyModelSpec, VllmSpec
from k3post.engine.vllm.sleep import Sleeper
from k3post.engine.vllm.versions import check_release, release


class ScriptedLLM:
    """Records the sleep/wake calls vLLM's `LLM` would get."""

    def __init__(self):
        self.calls: list[tuple] = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))


@pytest.fixture(autouse=True)
def no_gpu_reading(monkeypatch):
    monkeypatch.setattr(sleep_module, "free_gib", lambda: 1.5)


def test_a_turn_wakes_what_sleeps_and_sleeps_after_even_when_it_raises():
    llm = ScriptedLLM()
    sleeper = Sleeper(llm, enabled=True)
    with sleeper.turn():  # a new engine is awake: nothing to wake
        pass
    assert llm.calls == [("sleep", 1)]
    with pytest.raises(RuntimeError), sleeper.turn():
        raise RuntimeError("generation failed")
    assert llm.calls[1:] == [("wake_up", ("weights", "kv_cache")), ("sleep", 1)]
    counts = sleeper.take_counts()
    assert counts["sleeps"] == 2 and counts["wakes"] == 1 and counts["free_gib_asleep"] == 1.5
    assert sleeper.take_counts() == {}


def test_a_sync_wakes_the_weights_alone_and_the_next_turn_the_kv_cache():
    llm = ScriptedLLM()
    sleeper = Sleeper(llm, enabled=True)
    sleeper.sleep()
    sleeper.wake(("weights",))
    sleeper.wake(("weights",))  # already awake: no second call
    with sleeper.turn():
        pass
    assert llm.calls == [("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("sleep", 1)]


def test_sleeping_half_awake_wakes_the_rest_first():
    llm = ScriptedLLM()
    sleeper = Sleeper(llm, enabled=True)
    sleeper.sleep()
    sleeper.wake(("weights",))
    sleeper.sleep()
    assert llm.calls[2:] == [("wake_up", ("kv_cache",)), ("sleep", 1)]


def test_disabled_it_never_calls_the_engine():
    llm = ScriptedLLM()
    sleeper = Sleeper(llm, enabled=False)
    with sleeper.turn():
        sleeper.wake(("weights",))
    assert llm.calls == [] and sleeper.take_counts() == {}


class Allocation:
    """One record of vLLM's `CuMemAllocator.pointer_to_data` (the fields k3post reads)."""

    def __init__(self, tag: str, data: torch.Tensor):
        self.tag, self.device, self.handle = tag, data, (0, data.numel())
        self.cpu_backup_tensor: torch.Tensor | None = None


class AllocatorLLM:
    """An engine whose sleep and wake follow vLLM 0.26's `CuMemAllocator` (device_allocator/cumem.py):
    a sleep copies the offloaded tags' bytes into fresh host tensors and drops every device byte; a
    wake maps the memory again (garbage) and copies a host copy in where one is set, then forgets
    it. Level 1 offloads "weights", level 2 nothing. Counts the bytes copied to the host."""

    def __init__(self):
        self.allocations = {1000: Allocation("weights", torch.arange(8, dtype=torch.uint8)),
                            2000: Allocation("weights", torch.arange(8, 12, dtype=torch.uint8)),
                            3000: Allocation("kv_cache", torch.zeros(4, dtype=torch.uint8))}
        self.copied_to_host = 0
        self.worker = SimpleNamespace()

    def sleep(self, level):
        for data in self.allocations.values():
            if level == 1 and data.tag == "weights":
                data.cpu_backup_tensor = data.device.clone()
                self.copied_to_host += data.device.numel()
            data.device.fill_(255)  # unmapped: what comes back on a wake without a copy is not the weights

    def wake_up(self, tags=None):
        for data in self.allocations.values():
            if tags is None or data.tag in tags:
                if data.cpu_backup_tensor is not None:
                    data.device.copy_(data.cpu_backup_tensor)
                    data.cpu_backup_tensor = None

    def collective_rpc(self, method):
        return [method(self.worker)]

    def weights(self) -> list[list[int]]:
        return [data.device.tolist() for data in self.allocations.values() if data.tag == "weights"]


def test_a_frozen_engine_copies_its_weights_to_the_host_once_and_wakes_with_them_every_time(monkeypatch):
    llm = AllocatorLLM()
    monkeypatch.setattr(sleep_module, "_weight_allocations",
                        lambda: {ptr: d for ptr, d in llm.allocations.items() if d.tag == "weights"})
    before = llm.weights()
    sleeper = Sleeper(llm, enabled=True, keep_weights=True)
    sleeper.sleep()
    for _ in range(4):
        assert llm.weights() != before  # asleep: the device bytes are gone
        with sleeper.turn():
            assert llm.weights() == before
    assert llm.copied_to_host == 12  # the 8 + 4 weight bytes, at the first sleep alone
    assert sleeper.take_counts()["sleeps"] == 5

    # the sampler's kind (weights replaced by every sync) copies at every sleep, as vLLM's level 1 does
    llm = AllocatorLLM()
    plain = Sleeper(llm, enabled=True)
    plain.sleep()
    for _ in range(3):
        with plain.turn():
            assert llm.weights() == before
    assert llm.copied_to_host == 4 * 12


def test_a_frozen_engine_whose_allocations_changed_refuses_to_wake_with_a_copy_that_no_longer_fits(monkeypatch):
    llm = AllocatorLLM()
    monkeypatch.setattr(sleep_module, "_weight_allocations",
                        lambda: {ptr: d for ptr, d in llm.allocations.items() if d.tag == "weights"})
    sleeper = Sleeper(llm, enabled=True, keep_weights=True)
    sleeper.sleep()
    sleeper.wake()
    sleeper.sleep()
    llm.allocations[4000] = Allocation("weights", torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="allocations changed since its first sleep"):
        sleeper.wake()


@pytest.mark.parametrize("version, accepted", [("0.26.0", True), ("0.32.0+cpu", True), ("0.27.0rc1", True),
                                               ("0.25.1", False), ("0.33.0", False), ("1.0.0", False)])
def test_the_supported_vllm_releases(version, accepted):
    assert release("0.32.0+cpu") == (0, 32)
    if accepted:
        check_release(version)
    else:
        with pytest.raises(UserError, match="0.26 to 0.32"):
            check_release(version)


def test_vllm_sleep_is_refused_where_it_cannot_act():
    model = ModelSpec(tiny=TinyModelSpec())
    with pytest.raises(ValueError, match="applies to engine: vllm"):
        TeacherSpec(model=model, engine="hf", vllm=VllmSpec(sleep=True))
    with pytest.raises(ValueError, match="holds no GPU"):
        TeacherSpec(model=model, engine="vllm", vllm=VllmSpec(sleep=True))
    TeacherSpec(model=model, engine="vllm", vllm=VllmSpec(sleep=True), resources=ResourceSpec(num_gpus=0.3))


def test_a_sleeping_engine_on_a_cpu_is_refused_when_built():
    from k3post.engine.vllm.vllm_engine import build_llm

    with pytest.raises(UserError, match="needs a CUDA GPU"):
        build_llm(ModelSpec(tiny=TinyModelSpec()), VllmSpec(sleep=True))


def test_engines_in_sleep_mode_are_known_to_the_backends():
    """Backends build sleeping engines one at a time (ray/backend.py): EngineSpec.sleeps finds the
    sampler's VllmSpec or the teacher's among the constructor's arguments."""
    from k3post.launch.backend import EngineSpec

    model, gpu = ModelSpec(tiny=TinyModelSpec()), ResourceSpec(num_gpus=0.3)
    asleep = TeacherSpec(model=model, engine="vllm", vllm=VllmSpec(sleep=True), resources=gpu)
    assert EngineSpec(object, (model, VllmSpec(sleep=True)), gpu).sleeps
    assert EngineSpec(object, ("t", asleep), gpu).sleeps
    assert not EngineSpec(object, (model, VllmSpec()), gpu).sleeps
    assert not EngineSpec(object, ("t", TeacherSpec(model=model)), gpu).sleeps


def test_an_fp32_engine_for_a_quantized_checkpoint_on_a_gpu_is_refused(tmp_path, monkeypatch):
    """vLLM's FP8 GEMMs on a GPU write 16-bit outputs: an fp32 engine would die on a bare assertion
    inside the kernel (seen on an H100), so the engine refuses it first, naming the key."""
    import json

    import torch

    from k3post.engine.vllm.vllm_engine import _check_quantized_dtype

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"format": "float-quantized"}}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UserError, match="vllm.dtype: float32 cannot serve the quantized checkpoint"):
        _check_quantized_dtype(str(tmp_path), "float32")
    _check_quantized_dtype(str(tmp_path), "bfloat16")  # 16-bit: fine
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _check_quantized_dtype(str(tmp_path), "float32")  # not quantized: fine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {}}))
    _check_quantized_dtype(str(tmp_path), "float32")  # the CPU build serves it in fp32
