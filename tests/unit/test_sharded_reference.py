"""The sharded learner's reference (engine/sharded/sharded_reference.py) on 2 gloo ranks (FSDP2, real
processes, no Ray): the swap puts the policy back whatever fails (the reference forward, the
root's reshard, or the swap itself part way through the parameters); the reference forward runs
in eval mode (a student with dropout) and the policy forward in train mode; under FP8 QAT the
copy and the grad-buffer references are one reference (the fake-quantised model).

One spawn of 2 ranks runs every scenario (process start-up dominates on a 2-core box); rank 0
saves what it saw and the tests read it.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from k3post.config.learner_schema import LearnerSpec
from k3post.config.schema import ModelSpec, OptimSpec, QatSpec, ReferenceSpec, TinyModelSpec
from k3post.engine.sharded import sharded_reference
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.sharded.rank import RankSpec, destroy_group, free_port
from k3post.model.training.fsdp import local
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import completion_logprobs
from tests.spawned_rank import leave_without_teardown
from tests.unit.test_learner import make_batch
from tests.unit.test_reference import (embedded, encoded_once, group_batch, max_gap, record_modes,
                                      save_dropout_model)

SPEC = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3))
ALWAYS = LearnerSpec(sharding="always", precision="fp32")
FAILURES = ("forward", "reshard", "swap")
QAT_FROM_STEP_2 = QatSpec(enabled=True, fake_quant_after_n_steps=1)


def config(reference: ReferenceSpec, student: ModelSpec = SPEC, qat: QatSpec = QatSpec()) -> LearnerConfig:
    return LearnerConfig(student=student, optim=OptimSpec(lr=1e-2, micro_batch_size=2), reference=reference,
                         total_steps=10, num_threads=1, qat=qat)


@contextmanager
def failing(lrn, where: str):
    """Make the reference pass of `lrn` raise: in the second decoder block's forward, in the
    root's reshard after the forwards, or in the swap after the first parameter was swapped."""
    if where == "forward":
        def boom(*_):
            raise RuntimeError("boom in forward")
        handle = lrn.model.model.layers[1].mlp.register_forward_pre_hook(boom)
        try:
            yield
        finally:
            handle.remove()
    elif where == "reshard":
        real = lrn.root.reshard

        def boom():
            real()
            raise RuntimeError("boom in reshard")
        lrn.root.reshard = boom
        try:
            yield
        finally:
            del lrn.root.reshard
    else:
        real, calls = sharded_reference.swap_through, []

        def boom(a, b, scratch):
            if calls:
                raise RuntimeError("boom in swap")
            calls.append(1)
            real(a, b, scratch)
        sharded_reference.swap_through = boom
        try:
            yield
        finally:
            sharded_reference.swap_through = real


def failure_scenarios(lrn_cls, rank: RankSpec, data: dict) -> dict:
    """A trained step (policy ≠ reference), then a reference pass that fails; what the parameters,
    the buffers and the error are after it, and whether the next step is the one a learner that
    never failed takes."""
    out = {}
    for where in FAILURES:
        lrn, twin = (lrn_cls(config(ReferenceSpec(kind="grad_buffer", kl_coef=0.1)), rank, ALWAYS)
                     for _ in range(2))
        lrn.train_step(data["opd"][0])
        twin.train_step(data["opd"][0])
        policy = [local(p).detach().clone() for p in lrn.params]
        mbs = [mb for mb, _ in lrn._work(data["opd"][1])]
        error = None
        with failing(lrn, where):
            try:
                lrn.reference.logprobs(mbs, 0, 1.0)
            except RuntimeError as exc:
                error = str(exc)
        out[where] = {"error": error,
                      "policy_intact": all(torch.equal(local(p), q) for p, q in zip(lrn.params, policy)),
                      "buffers_zero": all(float(local(p.grad).abs().max()) == 0 for p in lrn.params),
                      "next_step": (lrn.train_step(data["opd"][1]), twin.train_step(data["opd"][1]))}
    return out


def mode_scenarios(lrn_cls, rank: RankSpec, data: dict) -> dict:
    """A student with attention dropout 0.5 and a grad-buffer reference: the modes its first
    attention module ran in during one step, then two reference passes with the model in train mode."""
    lrn = lrn_cls(config(ReferenceSpec(kind="grad_buffer", kl_coef=0.5), ModelSpec(path=data["dropout_dir"])),
                  rank, ALWAYS)
    seen = record_modes(lrn.model)
    lrn.train_step(data["dropout_opd"])
    mbs = [mb for mb, _ in lrn._work(data["dropout_opd"])]
    lrn.model.train()
    passes = [lrn.reference.logprobs(mbs, 0, 1.0) for _ in range(2)]
    return {"seen": seen, "passes": passes, "training_after": all(m.training for m in lrn.model.modules())}


def qat_scenarios(lrn_cls, rank: RankSpec, data: dict) -> dict:
    """FP8 QAT with fake quantisation from step 2: the grad-buffer and the copy reference, two
    steps each, then both references' logprobs of a third batch (this rank's micro-batches)."""
    out = {}
    for kind in ("grad_buffer", "copy"):
        lrn = lrn_cls(config(ReferenceSpec(kind=kind, kl_coef=0.1), qat=QAT_FROM_STEP_2), rank, ALWAYS)
        metrics = [lrn.train_step(b) for b in data["opd"][:2]]
        lrn._update_fake_quant()  # as a step does first
        out[kind] = (metrics, lrn.reference.logprobs([mb for mb, _ in lrn._work(data["opd"][2])], 0, 1.0))
    return out


def group_scenarios(lrn_cls, rank: RankSpec, data: dict) -> dict:
    """Each reference kind's pass over one micro-batch of n = 4 samples of two prompts (the same
    micro-batch on both ranks): the input ids of every forward through the token embedding, and
    the logprobs."""
    out = {}
    for kind in ("grad_buffer", "copy"):
        lrn = lrn_cls(config(ReferenceSpec(kind=kind, kl_coef=0.1)), rank, ALWAYS)
        calls = embedded(lrn.reference.model if kind == "copy" else lrn.model)
        out[kind] = (lrn.reference.logprobs([data["groups"]], 0, 1.0)[0], calls)
    return out


def _rank_main(rank: int, world: int, port: int, data: dict, out: Path) -> None:
    from k3post.engine.sharded.sharded_learner import ShardedLearner

    torch.set_num_threads(1)
    try:
        spec = RankSpec(rank, world, "gloo", "127.0.0.1", port)
        res = {"failures": failure_scenarios(ShardedLearner, spec, data),
               "modes": mode_scenarios(ShardedLearner, spec, data), "qat": qat_scenarios(ShardedLearner, spec, data),
               "groups": group_scenarios(ShardedLearner, spec, data)}
        if rank == 0:
            torch.save(res, out / "two_ranks.pt")
    finally:
        destroy_group()
    leave_without_teardown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_reference")
    dropout = save_dropout_model(out / "dropout")
    data = {"opd": [make_batch(SPEC, n=4, seed=s) for s in range(3)], "dropout_dir": dropout.path,
            "dropout_opd": make_batch(dropout, n=4), "groups": group_batch(SPEC)}
    mp.spawn(_rank_main, args=(2, free_port(), data, out), nprocs=2)
    return {**torch.load(out / "two_ranks.pt", weights_only=False), "data": data}


@pytest.mark.parametrize("where", FAILURES)
def test_a_failed_reference_pass_leaves_the_policy_bit_for_bit_and_raises(runs, where):
    """The forward raising, the root's reshard raising after the forwards, or the swap raising
    after the first parameter: the error reaches the caller, every local shard holds exactly the
    policy it held before, the buffers are zero, and the next step is the step of a learner that
    never failed."""
    seen = runs["failures"][where]
    assert seen["error"] == f"boom in {where}"
    assert seen["policy_intact"]
    assert seen["buffers_zero"]
    got, want = seen["next_step"]
    for key in ("train/loss", "train/grad_norm", "train/ref_kl"):
        assert got[key] == want[key], key


def test_the_sharded_reference_runs_in_eval_mode_and_the_policy_in_train_mode(runs):
    """Attention dropout 0.5, 2 ranks (one micro-batch each): the step ran the reference forward
    in eval mode and the policy forward in train mode; two reference passes are identical and
    equal the one-process eval-mode forward of the initial model (rank 0's micro-batch)."""
    seen = runs["modes"]
    assert seen["seen"] == [False, True, False, False]  # the step's reference and policy, then the two passes
    assert seen["training_after"]
    first, second = seen["passes"]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    spec = ModelSpec(path=runs["data"]["dropout_dir"])
    mb = runs["data"]["dropout_opd"].micro_batches(2)[0]  # rank 0's share
    with torch.no_grad():
        expected = completion_logprobs(load_model(spec)[0], mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, 0)
    assert torch.allclose(first[0], expected, atol=1e-6, rtol=0)


def test_under_qat_the_sharded_copy_and_grad_buffer_are_one_reference(runs):
    """2 gloo ranks, FP8 QAT switched on at step 2: the copy reference is prepared for QAT like
    the learner and follows its switch, so both kinds give the same losses and train/ref_kl (0 at
    step 1, equal weights), the same reference logprobs, and the one-process learner's steps."""
    (trick_steps, trick_ref), (copy_steps, copy_ref) = runs["qat"]["grad_buffer"], runs["qat"]["copy"]
    single = Learner(config(ReferenceSpec(kind="grad_buffer", kl_coef=0.1), qat=QAT_FROM_STEP_2))
    single_steps = [single.train_step(b) for b in runs["data"]["opd"][:2]]
    for step, (a, b, c) in enumerate(zip(trick_steps, copy_steps, single_steps)):
        assert a["train/fake_quant"] == b["train/fake_quant"] == float(step >= 1)
        for key in ("train/loss", "train/ref_kl", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-7, rel=1e-6), (step, key)
            assert a[key] == pytest.approx(c[key], abs=1e-5, rel=1e-5), (step, key)
    assert trick_steps[0]["train/ref_kl"] == copy_steps[0]["train/ref_kl"] == 0.0
    assert trick_steps[1]["train/ref_kl"] != 0.0
    assert max_gap(trick_ref, copy_ref) <= 1e-6


@pytest.mark.parametrize("kind", ["grad_buffer", "copy"])
def test_the_sharded_reference_encodes_each_groups_prompt_once(runs, kind):
    """n = 4 samples of each of two prompts, 2 ranks: the sharded reference runs the embedding over
    each distinct prompt once and then over the completions alone, and its logprobs equal the
    one-process ungrouped forward of the initial model within 1e-5."""
    got, calls = runs["groups"][kind]
    batch = runs["data"]["groups"]
    assert encoded_once(calls, batch, 0) == []
    with torch.no_grad():
        want = completion_logprobs(load_model(SPEC)[0], batch.prompt_ids, batch.completion_ids_BT,
                                   batch.loss_mask_BT, 0)
    assert float((got - want).abs().max()) <= 1e-5
