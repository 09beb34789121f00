"""A one-rank sharded learner on a GPU hands its samplers device tensors (engine/sharded/sharded_learner.py:
`_device_weights`), the path CPU tests cannot reach: the learner `precision: auto` gives on a GPU
(bf16-mixed, FSDP2 over one NCCL rank).

- The weights are bf16 tensors on the learner's GPU, bit for bit the bucketed host gather's
  (`gathered_state`, the path a group of several ranks still takes), before and after a step.
- They live in buffers made once: a step later they sit at the same addresses, so the CUDA IPC
  handles `weight_ipc_handles` made at the first sync are the ones it gives at the second.
- The object store gets host copies of them (`host_weights`).

Skipped without CUDA; run on a GPU machine with `python -m pytest tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_one_rank_on_a_gpu_exports_its_weights_on_the_gpu_in_buffers_made_once():
    from k3post.config.learner_schema import LearnerSpec
    from k3post.config.schema import ModelSpec, OptimSpec, TinyModelSpec
    from k3post.engine.learner.learner import LearnerConfig
    from k3post.engine.sharded.rank import RankSpec, destroy_group, free_port
    from k3post.engine.sharded.sharded_learner import ShardedLearner
    from k3post.model.training.sharded_weights import gathered_state
    from tests.unit.test_learner import make_batch

    spec = ModelSpec(tiny=TinyModelSpec(hidden_size=256, num_layers=4, seed=3), dtype="bfloat16")
    cfg = LearnerConfig(student=spec, optim=OptimSpec(lr=1e-2, micro_batch_size=4), total_steps=10, num_threads=4)
    lrn = ShardedLearner(cfg, RankSpec(0, 1, "nccl", "127.0.0.1", free_port()), LearnerSpec())
    try:
        assert lrn.precision == "bf16-mixed"
        first = lrn.weights()
        handles = lrn.weight_ipc_handles()
        host = gathered_state(lrn.model, torch.bfloat16, to_host=True)
        assert set(first) == set(host)
        assert all(t.is_cuda and t.dtype == torch.bfloat16 and torch.equal(t.cpu(), host[k]) for k, t in first.items())
        addresses = {k: t.data_ptr() for k, t in first.items()}
        before = {k: t.clone() for k, t in first.items()}
        lrn.train_step(make_batch(spec, n=8, seed=0))
        second = lrn.weights()
        host = gathered_state(lrn.model, torch.bfloat16, to_host=True)
        assert {k: t.data_ptr() for k, t in second.items()} == addresses
        assert all(torch.equal(t.cpu(), host[k]) for k, t in second.items())
        assert not all(torch.equal(t, before[k]) for k, t in second.items())  # the step moved them
        assert lrn.weight_ipc_handles() is handles
        stored = lrn.host_weights()  # what the object store carries: host copies of the same values
        assert all(not (isinstance(v, torch.Tensor) and v.is_cuda) for v in stored.values())
        assert all(torch.equal(torch.as_tensor(stored[k]), t.cpu()) for k, t in second.items())
    finally:
        destroy_group()
