"""The sharded grad-buffer reference on a GPU (engine/sharded/sharded_reference.py): the path the CPU
tests cannot reach. On CUDA the reference shards are copied from pinned host memory into the
sharded .grad buffers on a side stream (`prefetch`, right after the optimizer step), and the
reference pass waits on that copy's event before it swaps the buffers into the parameters.

- The reference it computes is the reference: bit for bit the logprobs of a separate frozen
  sharded copy (`ShardedCopyRef`), at every step of a run whose policy moves away from it, and
  the two runs' metrics are identical.
- The wait is what makes it so: with the side stream held back (a GPU sleep queued ahead of the
  copy, so the race is certain rather than timing-dependent), the reference pass with its wait
  still matches the copy exactly, and the same pass without the wait reads the buffers before
  the copy lands and does not. This is the test that fails if the wait is removed.

One NCCL rank (world size 1: FSDP2's sharded parameters, DTensors and hooks, on one GPU).
Skipped without CUDA; run on a GPU machine with `python -m pytest tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 4
SLEEP_CYCLES = 200_000_000  # ~0.1 s on an H200: far longer than the copy's own launch


@pytest.fixture(scope="module")
def setup():
    from k3post.config.learner_schema import LearnerSpec
    from k3post.config.schema import ModelSpec, OptimSpec, ReferenceSpec, TinyModelSpec
    from k3post.engine.learner.learner import LearnerConfig
    from k3post.engine.sharded.rank import RankSpec, destroy_group, free_port
    from k3post.engine.sharded.sharded_learner import ShardedLearner
    from tests.unit.test_learner import make_batch

    spec = ModelSpec(tiny=TinyModelSpec(hidden_size=256, num_layers=4, seed=3))
    batches = [make_batch(spec, n=8, seed=s) for s in range(STEPS + 1)]
    rank = RankSpec(0, 1, "nccl", "127.0.0.1", free_port())

    def learner(kind: str) -> ShardedLearner:
        cfg = LearnerConfig(student=spec, optim=OptimSpec(lr=1e-2, micro_batch_size=4), total_steps=10,
                            num_threads=4, reference=ReferenceSpec(kind=kind, kl_coef=0.1))
        return ShardedLearner(cfg, rank, LearnerSpec(sharding="always", precision="fp32"))

    yield learner, batches
    destroy_group()


def reference_logprobs(lrn, batch) -> list[torch.Tensor]:
    return [t.detach().clone() for t in lrn.reference.logprobs([mb for mb, _ in lrn._work(batch)], 0, 1.0)]


def test_the_prefetched_reference_equals_a_separate_copy_bit_for_bit_at_every_step(setup):
    learner, batches = setup
    buffered, copied = learner("grad_buffer"), learner("copy")
    assert buffered.reference.stream is not None and buffered.reference.host[0].is_pinned()
    for step, batch in enumerate(batches[:STEPS]):
        got, want = buffered.train_step(batch), copied.train_step(batch)
        assert got["train/ref_kl"] == want["train/ref_kl"] and got["train/loss"] == want["train/loss"], step
        assert buffered.reference.prefetched  # the next step's copy was started after this optimizer step
        for a, b in zip(reference_logprobs(buffered, batches[step + 1]), reference_logprobs(copied, batches[step + 1])):
            assert torch.equal(a, b), step
    assert got["train/ref_kl"] != 0  # the policy moved: the reference is not the policy


def held_back_prefetch(ref) -> None:
    """`ref.prefetch()` with its side stream asleep first: the copy lands ~0.1 s later."""
    ref.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ref.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    ref.prefetch()


def test_without_the_wait_the_reference_pass_reads_the_buffers_before_the_copy_lands(setup):
    learner, batches = setup
    buffered, copied = learner("grad_buffer"), learner("copy")
    for batch in batches[:2]:
        buffered.train_step(batch), copied.train_step(batch)
    want = reference_logprobs(copied, batches[2])
    ref = buffered.reference
    torch.cuda.synchronize()
    ref.prefetched = False  # prefetch again, held back (the buffers hold the reference already: zero them)
    for p in ref.params:
        p.grad.zero_()
    held_back_prefetch(ref)
    assert all(torch.equal(a, b) for a, b in zip(reference_logprobs(buffered, batches[2]), want))  # with the wait
    held_back_prefetch(ref)
    ref.ready = None  # the wait removed
    raced = reference_logprobs(buffered, batches[2])
    torch.cuda.synchronize()
    assert not all(torch.equal(a, b) for a, b in zip(raced, want))
