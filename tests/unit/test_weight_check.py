"""The weight-sync check (engine/transport/weight_check.py): the checksum sees a changed, moved or reshaped
value and nothing else; the rotating window covers every tensor; and the in-process sync
(launch/in_process.py: DirectWeightSync) stops a run whose sampler got one corrupted tensor,
naming it, stays silent on clean syncs, and catches a transport that always corrupts one tensor
within one rotation of the window. (On Ray: tests/integration/test_ray_weight_check.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3post.config.errors import RunStopped
from k3post.engine.learner.learner import Learner
from k3post.engine.sharded.rank import RankSpec, destroy_group
from k3post.engine.samplers.sampler import HFSampler
from k3post.engine.transport.weight_check import (WeightSyncMismatch, check_sync, checked_names, checksum,
                                        checksums, syncs_to_cover)
from k3post.launch.in_process import DirectWeightSync, LocalSamplers
from tests.unit.test_learner import learner
from tests.unit.test_sharded_learner import config


def test_equal_values_give_equal_checksums_whatever_the_container():
    t = torch.randn(300, 7, generator=torch.Generator().manual_seed(0))
    assert checksum(t) == checksum(t.clone()) == checksum(t.numpy()) == checksum(t.t().contiguous().t())
    b = t.to(torch.bfloat16)
    assert checksum(b) == checksum(b.clone()) and checksum(b) != checksum(t)
    assert checksum(t).agrees_with(checksum(t.clone()))


def test_a_changed_moved_or_reshaped_value_disagrees():
    t = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    base = checksum(t)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        one = t.to(dtype).clone()
        one[17, 3] = torch.nextafter(one[17, 3], torch.tensor(10.0, dtype=dtype))  # one ulp
        assert not checksum(t.to(dtype)).agrees_with(checksum(one)), dtype
    transposed = checksum(t.t().contiguous())
    assert transposed.plain == base.plain  # the plain sum cannot see a transpose...
    assert not base.agrees_with(transposed)  # ...the index-weighted one does
    swapped = t.clone().reshape(-1)
    swapped[[5, 900]] = swapped[[900, 5]]
    assert not base.agrees_with(checksum(swapped.reshape(64, 64)))
    assert not base.agrees_with(checksum(t.reshape(32, 128)))  # same values, another shape
    nan = t.clone()
    nan[0, 0] = float("nan")
    assert checksum(nan).agrees_with(checksum(nan.clone())) and not checksum(nan).agrees_with(base)


def _h(r: int) -> int:
    """The row mixer h, written out again in Python integers (31 bits)."""
    mask = 2**31 - 1
    r ^= r >> 16
    r = (r * 0x21F0AAAD) & mask
    r ^= r >> 15
    r = (r * 0x735A2D97) & mask
    return r ^ (r >> 15)


def _definition(t: torch.Tensor) -> tuple[int, int]:
    """plain and weighted straight from the definition, in Python integers:
    w_i = a_(i mod 2^16) · c_(i div 2^16), a_k = 2·(40503·k mod 2^16) + 1, c_r = 2·h(r) + 1."""
    bits = t.reshape(-1).view(torch.int32).numpy().astype(np.int64)
    index = np.arange(bits.size, dtype=np.int64)
    a = 2 * ((index % 65536 * 40503) % 65536) + 1
    c = np.array([2 * _h(r) + 1 for r in range(-(-bits.size // 65536))], dtype=np.int64)[index // 65536]
    w = (a * c) % 2**32  # < 2^32; b·w < 2^63 in magnitude
    return int(bits.sum()) % 2**32, int(((bits * w) % 2**32).sum()) % 2**32


def test_the_blocked_form_equals_the_definition_on_a_tensor_of_several_blocks(monkeypatch):
    import k3post.engine.transport.weight_check as module

    monkeypatch.setattr(module, "CHUNK", 2 * 65536)  # several blocks, and a tail that is not a whole period
    t = torch.randn(300, 701, generator=torch.Generator().manual_seed(3))
    c = checksum(t)
    assert (c.plain, c.weighted) == _definition(t)
    for flat_index in (5, 3 * 65536 + 11):  # in a full period and in the tail
        bad = t.clone().reshape(-1)
        bad[flat_index] += 1e-5
        assert not c.agrees_with(checksum(bad.reshape(300, 701)))


def test_many_tensors_read_back_at_once_give_each_ones_definition(monkeypatch):
    """`checksums` queues every tensor's sums and reads them in one transfer; each must still be
    its own tensor's, by the definition, whatever the widths beside it (int16 and int32 bits
    widened to int32 sums, 8-byte ones to int64) and however many rows the largest needs (the
    row weights are one table, grown and sliced)."""
    import k3post.engine.transport.weight_check as module

    monkeypatch.setattr(module, "_ROW_WEIGHTS", {})
    g = torch.Generator().manual_seed(11)
    small, large = torch.randn(7, 3, generator=g), torch.randn(5 * 65536 + 17, generator=g)
    tensors = {"small": small, "bf16": torch.randn(40, 9, generator=g).bfloat16(), "large": large,
               "f64": torch.randn(3, 65537, generator=g, dtype=torch.float64), "again": small.clone()}
    together = checksums(tensors)
    assert list(together) == list(tensors)
    assert together == {name: checksum(t) for name, t in tensors.items()}
    for name in ("small", "large"):
        assert (together[name].plain, together[name].weighted) == _definition(tensors[name])
    assert together["small"] == together["again"] and together["small"] != together["large"]


def test_integer_sums_agree_whatever_the_thread_count():
    t = torch.randn(3_000_000, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = checksum(t)
        torch.set_num_threads(2)
        assert checksum(t) == one
    finally:
        torch.set_num_threads(threads)


def test_the_window_moves_with_the_version_and_covers_every_tensor():
    names = [f"layers.{i}.w" for i in range(10)]
    assert checked_names(names, 3) == checked_names(list(reversed(names)), 3)  # order-free: both sides agree
    assert checked_names(names, 0) != checked_names(names, 1)
    rounds = syncs_to_cover(len(names))
    assert rounds == 3
    assert set().union(*(checked_names(names, v) for v in range(rounds))) == set(names)
    assert checked_names(names[:2], 5) == sorted(names[:2])  # fewer tensors than the window: all of them
    assert checked_names([], 1) == []


def test_a_mismatch_is_a_one_line_stop_naming_tensor_version_and_replica():
    a = checksum(torch.ones(3))
    with pytest.raises(WeightSyncMismatch) as err:
        check_sync({"model.norm.weight": a}, {"model.norm.weight": checksum(torch.zeros(3))}, 7, 2)
    message = str(err.value)
    assert isinstance(err.value, RunStopped) and "\n" not in message
    assert "v7" in message and "replica 2" in message and "'model.norm.weight'" in message
    with pytest.raises(WeightSyncMismatch, match="sampler: nothing"):
        check_sync({"x": a}, {}, 1, 0)


@pytest.fixture(scope="module")
def pair():
    """A learner and a sampler of the same tiny student, joined by the in-process sync."""
    from k3post.config.schema import ModelSpec, TinyModelSpec

    spec = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3))
    lrn, sampler = learner(spec), HFSampler(spec, num_threads=2)
    with torch.no_grad():  # the learner moves on: a sync has something to carry
        for p in lrn.model.parameters():
            p.add_(0.01)
    return lrn, sampler, DirectWeightSync(lrn, LocalSamplers(sampler))


def corrupting(sampler: HFSampler, name: str, monkeypatch) -> None:
    """The transport perturbs `name` on its way to the sampler."""
    load = HFSampler.load_weights

    def load_corrupted(weights: dict, version: int) -> int:
        weights = dict(weights)
        weights[name] = torch.as_tensor(weights[name]).clone()
        weights[name].view(-1)[0] += 1e-3
        return load(sampler, weights, version)

    monkeypatch.setattr(sampler, "load_weights", load_corrupted)


def test_a_tensor_corrupted_in_transit_stops_the_sync_and_a_clean_sync_passes(pair, monkeypatch):
    lrn, sampler, sync = pair
    version = 4
    target = checked_names(list(lrn.weights()), version)[1]
    corrupting(sampler, target, monkeypatch)
    with pytest.raises(WeightSyncMismatch, match=rf"v{version}: sampler replica 0 does not hold the learner's "
                                                 rf"'{target}'"):
        sync.push(version)
    monkeypatch.undo()  # the transport restored
    sync.push(version)
    assert sampler.weight_version == version


def test_clean_syncs_are_silent_and_do_check_something(pair, monkeypatch):
    lrn, sampler, sync = pair
    checked = []
    original = HFSampler.weight_checksums
    monkeypatch.setattr(sampler, "weight_checksums", lambda names: checked.append(names) or original(sampler, names))
    n = len(lrn.weights())
    for version in range(1, syncs_to_cover(n) + 1):
        sync.push(version)
    assert {name for names in checked for name in names} == set(lrn.weights())


def test_a_transport_that_always_corrupts_one_tensor_is_caught_within_one_rotation(pair, monkeypatch):
    lrn, sampler, sync = pair
    names = sorted(lrn.weights())
    target = names[len(names) // 2]
    corrupting(sampler, target, monkeypatch)
    caught = None
    for version in range(1, syncs_to_cover(len(names)) + 1):
        try:
            sync.push(version)
        except WeightSyncMismatch as err:
            caught = (version, str(err))
            break
    assert caught is not None and target in caught[1] and target in checked_names(names, caught[0])


def test_the_sharded_learner_checksums_what_the_one_process_learner_does():
    """One FSDP2 rank gathers only the checked tensors; its checksums equal the unsharded learner's."""
    from k3post.engine.sharded.sharded_learner import ShardedLearner
    from tests.unit.test_sharded_learner import ALWAYS, free_port

    try:
        sharded = ShardedLearner(config(), RankSpec(0, 1, "gloo", "127.0.0.1", free_port()), ALWAYS)
        single = Learner(config())
        for version in (0, 1, 5):
            got, want = sharded.weight_checksums(version), single.weight_checksums(version)
            assert set(got) == set(want) and len(got) > 0
            for name in want:
                assert got[name].agrees_with(want[name]), name
    finally:
        destroy_group()


def test_a_lora_learner_syncs_and_checks_its_merged_weights():
    """A LoRA learner exports its adapters merged into base names (host copies): what the check
    hashes on the learner side is what the sampler loaded, once the adapters are non-zero."""
    import dataclasses

    from k3post.config.schema import LoraSpec

    lrn = Learner(dataclasses.replace(config(), lora=LoraSpec(rank=4)))
    with torch.no_grad():
        for name, p in lrn.peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a trained adapter: merged weights differ from the base ones
    sampler = HFSampler(config().student, num_threads=2)
    sync = DirectWeightSync(lrn, LocalSamplers(sampler))
    names = list(lrn.weights())
    assert not any("lora_" in n or "base_layer" in n for n in names)
    for version in range(1, syncs_to_cover(len(names)) + 1):
        sync.push(version)


def _swapped(t: torch.Tensor, a: slice, b: slice) -> torch.Tensor:
    """t with the blocks t[a] and t[b] (equal shapes, along dim 0) exchanged."""
    out = t.clone()
    out[a], out[b] = t[b], t[a]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_moved_by_a_multiple_of_2_16_elements_disagree(dtype):
    """The moves a real sync bug makes, at distances that are multiples of 2^16 elements (where an
    index weight of period 2^16 would line the two blocks up on equal weights): two attention heads
    of a q_proj (128 rows of 4096: 8·2^16 elements each), the two halves of a fused [2I, H]
    gate/up projection (I·H = 2^19), two rows 16 apart of a [·, 4096] tensor (16·4096 = 2^16)."""
    g = torch.Generator().manual_seed(5)
    q_proj = torch.randn(1024, 4096, generator=g).to(dtype)  # 8 heads of 128
    heads = _swapped(q_proj, slice(0, 128), slice(128, 256))
    gate_up = torch.randn(2 * 1024, 512, generator=g).to(dtype)  # [2I, H], I = 1024
    halves = _swapped(gate_up, slice(0, 1024), slice(1024, 2048))
    rows = torch.randn(64, 4096, generator=g).to(dtype)
    rows_16_apart = _swapped(rows, slice(3, 4), slice(19, 20))
    for name, before, after in (("heads", q_proj, heads), ("halves", gate_up, halves),
                                ("rows 16 apart", rows, rows_16_apart)):
        assert not torch.equal(before, after), name  # the move did change the tensor
        assert checksum(before).plain == checksum(after).plain, name  # same values: only the order tells
        assert not checksum(before).agrees_with(checksum(after)), name
        assert checksum(before).agrees_with(checksum(before.clone())), name  # unchanged still matches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_hashes_a_tensor_to_the_bits_the_cpu_does():
    """Learner on a GPU, sampler on a CPU (or the other way round): the same bits, the same sums,
    for each width (int16, int32, int64 accumulators) and a tensor with a partial last row."""
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        t = torch.randn(300, 701, generator=g).to(dtype)
        assert checksum(t.cuda()) == checksum(t), dtype
