"""The full-vocabulary learner step runs the decoder once (issue 20) and trains exactly as the
two-forward step did: same distributions, same gradients, same update."""

from __future__ import annotations

import torch

from k3post.algo.objectives import FullVocabReverseKL
from k3post.config.schema import OptimSpec
from k3post.engine.learner import learner_base
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.model.scoring.logprobs import completion_full_logprobs, completion_logprobs, completion_logprobs_and_full
from k3post.types import TrainBatch


def _batch(vocab: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 7
    prompt_ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 5, 2, 6)]
    completion_BT = torch.randint(3, vocab, (B, T), generator=g)
    mask_BT = torch.ones(B, T)
    mask_BT[1, 4:] = 0
    mask_BT[3, 2:] = 0
    teacher_BTV = torch.log_softmax(torch.randn(B, T, vocab, generator=g), -1)
    return TrainBatch(prompt_ids, completion_BT, mask_BT, torch.zeros(B, T) - 2.0, torch.zeros(B, T), teacher_BTV)


def _two_forwards(model, mb, pad_id, temperature, full, recording, compiled=False, bitwise=False):
    """The step before issue 20: the sampled tokens' logprobs and the distributions from two forwards."""
    with recording():
        logprobs_BT = completion_logprobs(model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                          temperature)
    full_BTV = (completion_full_logprobs(model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                         temperature) if full else None)
    return logprobs_BT, full_BTV


def test_one_forward_gives_both_outputs(tiny_model):
    model, tokenizer = tiny_model
    batch = _batch(len(tokenizer))
    args = (batch.prompt_ids, batch.completion_ids_BT, batch.loss_mask_BT, tokenizer.pad_token_id, 0.7)
    with torch.no_grad():
        logprobs_BT, full_BTV = completion_logprobs_and_full(model, *args)
        assert torch.equal(full_BTV, completion_full_logprobs(model, *args))
        reference_BT = completion_logprobs(model, *args)
    assert torch.allclose(logprobs_BT, reference_BT, atol=1e-5)
    assert torch.equal(logprobs_BT[batch.loss_mask_BT == 0], torch.zeros(int((batch.loss_mask_BT == 0).sum())))


def _trained(spec, monkeypatch, policy_outputs):
    monkeypatch.setattr(learner_base, "policy_outputs", policy_outputs)
    lrn = Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-3, micro_batch_size=2), total_steps=4,
                                objective=FullVocabReverseKL(), num_threads=2))
    batch = _batch(len(lrn.tokenizer))
    metrics = lrn.train_step(batch)
    return metrics, {k: v.detach().clone() for k, v in lrn.model.named_parameters()}


def test_full_vocab_step_equals_the_two_forward_step(tiny_spec, monkeypatch):
    """Bit-identical loss, grad norm and updated weights; the ratio diagnostics (from the gathered
    logprobs) agree to float rounding."""
    new_metrics, new_params = _trained(tiny_spec, monkeypatch, learner_base.policy_outputs)
    old_metrics, old_params = _trained(tiny_spec, monkeypatch, _two_forwards)
    assert new_metrics["train/loss"] == old_metrics["train/loss"] > 0
    assert new_metrics["train/grad_norm"] == old_metrics["train/grad_norm"] > 0
    assert all(torch.equal(new_params[k], old_params[k]) for k in old_params)
    assert abs(new_metrics["train/ratio_mean"] - old_metrics["train/ratio_mean"]) < 1e-5


def test_one_forward_per_micro_batch(tiny_spec, monkeypatch):
    """The decoder runs once per micro-batch (it ran twice with the full-vocabulary loss)."""
    lrn = Learner(LearnerConfig(student=tiny_spec, optim=OptimSpec(lr=1e-3, micro_batch_size=2), total_steps=4,
                                objective=FullVocabReverseKL(), num_threads=2))
    base = getattr(lrn.model, lrn.model.base_model_prefix)
    calls = []
    base.register_forward_hook(lambda *_: calls.append(1))
    lrn.train_step(_batch(len(lrn.tokenizer)))
    assert len(calls) == 2  # 4 rows, micro-batches of 2
