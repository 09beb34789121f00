"""A Kimi Linear student (KDA + MLA + MoE, the K3 architecture) under FSDP2: 2 gloo ranks train
exactly as the one-process learner (loss, grad norm, final weights). Each decoder block is one
FSDP unit; the MoE experts are ordinary parameters of their block."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from k3post.config.learner_schema import LearnerSpec
from k3post.config.schema import OptimSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.sharded.rank import RankSpec, destroy_group
from k3post.model.loading.load import load_model
from tests.spawned_rank import leave_without_teardown
from tests.unit.test_kimi import kimi
from tests.unit.test_learner import make_batch

SPEC = kimi(num_layers=2, first_k_dense=0)  # one KDA and one MLA layer, both MoE


def config() -> LearnerConfig:
    return LearnerConfig(student=SPEC, optim=OptimSpec(lr=1e-2, micro_batch_size=2), total_steps=10, num_threads=1)


def weights(learner) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).clone() for k, v in learner.weights().items()}


def _rank_main(rank: int, world: int, port: int, batches, out: str) -> None:
    from k3post.engine.sharded.sharded_learner import ShardedLearner

    torch.set_num_threads(1)
    try:
        learner = ShardedLearner(config(), RankSpec(rank, world, "gloo", "127.0.0.1", port),
                                 LearnerSpec(sharding="always", precision="fp32"))
        metrics = [learner.train_step(b) for b in batches]
        gathered = weights(learner)
        if rank == 0:
            torch.save((metrics, gathered), out)
    finally:
        destroy_group()
    leave_without_teardown()


def test_two_ranks_train_a_kimi_linear_student_as_one_process(tmp_path):
    batches = [make_batch(SPEC, n=4, seed=s) for s in range(2)]  # 2 micro-batches a step: one per rank
    single = Learner(config())
    want = [single.train_step(b) for b in batches]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(2, port, batches, str(tmp_path / "two.pt")), nprocs=2)
    got, got_weights = torch.load(tmp_path / "two.pt", weights_only=False)
    for g, w in zip(got, want):
        for key in ("train/loss", "train/grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), key
    initial = {k: v.detach() for k, v in load_model(SPEC)[0].state_dict().items()}
    final = weights(single)
    assert max(float((final[k] - initial[k]).abs().max()) for k in final) > 1e-3  # the steps moved the weights
    for name, value in final.items():
        assert torch.allclose(got_weights[name], value, atol=1e-5), name
