"""The MTP draft head on the sharded learner (FSDP2 over 2 gloo ranks, real processes, no Ray)
against the one-process learner: the same head losses, acceptance and weights step by step (one
rank pads with a weight-0 micro-batch, and one micro-batch has no trained position); checkpoints
that carry the head and its AdamW across 2 ranks, 1 rank and one process both ways; the weight
sync carries the gathered head; a `draft.hidden: residual` head trains alike; bf16-mixed keeps
fp32 masters and moments for the head too.

One spawn of 2 ranks runs every scenario (process start-up dominates on a 2-core machine); rank 0
saves what it saw and the tests compare it with runs in this process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from k3post.config.draft_schema import DraftSpec, SpeculateSpec
from k3post.config.learner_schema import LearnerSpec
from k3post.config.schema import ModelSpec, OptimSpec, TinyModelSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.sharded.rank import RankSpec, destroy_group
from k3post.types import TrainBatch
from tests.spawned_rank import leave_without_teardown
from tests.unit.test_learner import make_batch
from tests.unit.test_sharded_learner import assert_same_run, assert_same_weights, free_port

SPEC = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3, init_std=0.2))
FP32 = LearnerSpec(sharding="always", precision="fp32")
HEAD_KEYS = ("train/draft_loss", "train/draft_accept", "train/draft_positions")


def config(speculate: bool = True, hidden: str = "final_norm") -> LearnerConfig:
    draft = DraftSpec(kind="mtp", lr=1e-2, hidden=hidden, speculate=SpeculateSpec(tokens=2) if speculate else None)
    return LearnerConfig(student=SPEC, optim=OptimSpec(lr=1e-2, micro_batch_size=2), total_steps=10, num_threads=1,
                         draft=draft)


def without_pairs(batch: TrainBatch, row: int) -> TrainBatch:
    """`batch` with row `row` keeping only its first completion token (no position the head trains at)."""
    mask_BT = batch.loss_mask_BT.clone()
    mask_BT[row, 1:] = 0
    return dataclasses.replace(batch, loss_mask_BT=mask_BT, advantages_BT=batch.advantages_BT * mask_BT)


def weights_of(lrn) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).clone() for k, v in lrn.weights().items()}


def straight_run(lrn, batches: list[TrainBatch], directory: Path) -> dict:
    """A step, a checkpoint, two more steps: what a resume from the checkpoint must reproduce."""
    first = lrn.train_step(batches[0])
    lrn.save_checkpoint(str(directory), {"step": 1})
    rest = [lrn.train_step(b) for b in batches[1:]]
    return {"metrics": [first, *rest], "weights": weights_of(lrn)}


def resumed_run(lrn, directory: Path, batches: list[TrainBatch]) -> dict:
    state = lrn.load_checkpoint(str(directory))
    return {"state": state, "metrics": [lrn.train_step(b) for b in batches[1:]], "weights": weights_of(lrn)}


def sync_to_receiver(lrn, queue) -> None:
    """The weight sync over a gloo weight group: rank 0 hosts it, this test's process receives."""
    if lrn.rank.rank == 0:
        queue.put((lrn.open_weight_store("127.0.0.1", 2), lrn.weight_manifest()))
        lrn.join_weight_group(2, "gloo")
    lrn.broadcast_weights()
    lrn.leave_weight_group()


def _rank_main(rank: int, world: int, port: int, data: dict, out: Path, queue) -> None:
    from k3post.engine.sharded.sharded_learner import ShardedLearner

    torch.set_num_threads(1)
    try:
        group = RankSpec(rank, world, "gloo", "127.0.0.1", port)
        res = {"straight": straight_run(ShardedLearner(config(), group, FP32), data["batches"], out / "w2" / "step-1")}
        res["from_unsharded"] = resumed_run(ShardedLearner(config(), group, FP32), data["unsharded"], data["batches"])
        residual = ShardedLearner(config(hidden="residual"), group, FP32)
        res["residual"] = ([residual.train_step(b) for b in data["batches"][:2]], weights_of(residual))
        mixed = ShardedLearner(config(), group, LearnerSpec(sharding="always", precision="bf16-mixed"))
        res["bf16_mixed"] = (mixed.train_step(data["batches"][0]), {p.dtype for p in mixed.draft.head.parameters()},
                             {t.dtype for s in mixed.draft.optimizer.state.values() for t in s.values() if t.dim()})
        sync = ShardedLearner(config(), group, FP32)
        sync.train_step(data["batches"][0])
        res["sync_weights"] = weights_of(sync)
        sync_to_receiver(sync, queue)
        if rank == 0:
            torch.save(res, out / "two_ranks.pt")
    finally:
        destroy_group()
    leave_without_teardown(queue)


def receive(queue) -> dict[str, torch.Tensor]:
    from k3post.engine.transport.weight_broadcast import WeightGroup, open_store

    port, manifest = queue.get(timeout=600)
    group = WeightGroup(open_store("127.0.0.1", port, 2, 1), 2, 1, "gloo", manifest)
    try:
        return group.receive()
    finally:
        group.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from k3post.engine.sharded.sharded_learner import ShardedLearner

    out = tmp_path_factory.mktemp("sharded_draft")
    batches = [make_batch(SPEC, n=5, seed=s) for s in range(3)]  # 3 micro-batches of 2: rank 1 pads
    batches[1] = without_pairs(batches[1], 4)  # its third micro-batch (row 4 alone) trains the head nowhere
    unsharded = straight_run(Learner(config()), batches, out / "u1" / "step-1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    data = {"batches": batches, "unsharded": out / "u1" / "step-1"}
    procs = mp.start_processes(_rank_main, args=(2, free_port(), data, out, queue), nprocs=2, join=False,
                               start_method="spawn")
    received = receive(queue)
    while not procs.join():
        pass
    two = torch.load(out / "two_ranks.pt", weights_only=False)
    try:  # the 2 ranks' checkpoint resumed by one rank and by the one-process learner
        one_rank = ShardedLearner(config(), RankSpec(0, 1, "gloo", "127.0.0.1", free_port()), FP32)
        from_two = {"one_rank": resumed_run(one_rank, out / "w2" / "step-1", batches)}
    finally:
        destroy_group()
    from_two["unsharded"] = resumed_run(Learner(config()), out / "w2" / "step-1", batches)
    return {"unsharded": unsharded, "two": two, "from_two": from_two, "received": received, "batches": batches,
            "out": out}


def assert_same_metrics(got: list[dict], want: list[dict]):
    assert_same_run(got, want, ("train/loss", "train/grad_norm", *HEAD_KEYS))


def test_two_ranks_train_the_head_as_one_process(runs):
    want, got = runs["unsharded"], runs["two"]["straight"]
    assert_same_metrics(got["metrics"], want["metrics"])
    assert_same_weights(got["weights"], want["weights"])
    head = {k for k in want["weights"] if k.startswith("mtp.")}
    assert {"mtp.eh_proj.weight", "mtp.enorm.weight", "mtp.block.self_attn.q_proj.weight"} <= head
    first = [k for k in head if "eh_proj" in k][0]  # the head did move (lr 1e-2, three steps)
    initial = Learner(config()).draft.weights()[first]
    assert not torch.allclose(want["weights"][first], initial, atol=1e-3)
    # The second step's batch has a micro-batch without trained positions: fewer positions than the others.
    assert want["metrics"][1]["train/draft_positions"] < want["metrics"][0]["train/draft_positions"]


@pytest.mark.parametrize("saved,resumed", [("two", "one_rank"), ("two", "unsharded"), ("unsharded", "two")])
def test_checkpoints_carry_the_head_across_group_sizes(runs, saved, resumed):
    """A checkpoint (head + its AdamW in mtp_dcp/) written by 2 ranks or by one process, resumed
    by another layout: the next two steps, the head's included, are the uninterrupted run's."""
    straight = runs["two"]["straight"] if saved == "two" else runs["unsharded"]
    got = runs["from_two"][resumed] if saved == "two" else runs["two"]["from_unsharded"]
    assert got["state"] == {"step": 1}
    assert_same_metrics(got["metrics"], straight["metrics"][1:])
    assert_same_weights(got["weights"], straight["weights"])


def test_the_sharded_checkpoint_holds_the_whole_head_and_its_reshardable_state(runs):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    directory = runs["out"] / "w2" / "step-1"
    head = load_file(directory / "mtp_head.safetensors")
    assert head["eh_proj.weight"].shape == (32, 64)  # whole, not a rank's rows
    keys = set(FileSystemReader(str(directory / "mtp_dcp")).read_metadata().state_dict_metadata)
    assert {"model.eh_proj.weight", "optim.state.eh_proj.weight.exp_avg"} <= keys
    assert len(list((directory / "mtp_dcp").glob("*.distcp"))) == 2  # each rank wrote its shards


def test_the_weight_sync_carries_the_gathered_head(runs):
    received, sent = runs["received"], runs["two"]["sync_weights"]
    assert {k for k in received if k.startswith("mtp.")} == {k for k in sent if k.startswith("mtp.")} != set()
    assert_same_weights(received, sent, tol=0.0)
    one = Learner(config())
    one.train_step(runs["batches"][0])
    assert_same_weights(received, {k: torch.as_tensor(v) for k, v in one.weights().items()})


def test_a_residual_head_trains_on_two_ranks_as_in_one_process(runs):
    """draft.hidden: residual: the states before the final norm, captured inside the FSDP root."""
    one = Learner(config(hidden="residual"))
    want = [one.train_step(b) for b in runs["batches"][:2]]
    got, weights = runs["two"]["residual"]
    assert_same_metrics(got, want)
    assert_same_weights(weights, weights_of(one))
    assert got[0]["train/draft_loss"] != runs["unsharded"]["metrics"][0]["train/draft_loss"]  # another input


def test_bf16_mixed_keeps_the_heads_fp32_masters_and_moments(runs):
    metrics, param_dtypes, state_dtypes = runs["two"]["bf16_mixed"]
    assert param_dtypes == {torch.float32} and state_dtypes == {torch.float32}
    fp32 = runs["unsharded"]["metrics"][0]
    assert metrics["train/draft_loss"] == pytest.approx(fp32["train/draft_loss"], rel=0.02)
    assert metrics["train/draft_loss"] != pytest.approx(fp32["train/draft_loss"], rel=1e-7)  # computed in bf16
