"""MoE routing balance inside the learner (k3post.model.training.moe_stats.RouterBalancer): what is
recorded (policy forwards, real tokens), the metrics a train step returns, and the sign /
Quantile-Balancing bias updates on a deliberately skewed tiny Kimi student."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from k3post.config.errors import UserError
from k3post.algo.objectives import FullVocabReverseKL, SampledTokenPG
from k3post.config.schema import MoeSpec, OptimSpec, ReferenceSpec
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.model.training.moe_stats import router_modules
from k3post.types import TrainBatch
from tests.unit.test_kimi import TOKENIZER, kimi

SPEC = kimi(num_layers=2, first_k_dense=0)  # one KDA + one MLA layer, both MoE (4 experts, top-2)


def learner(bias_update: str = "none", objective=None, reference: ReferenceSpec | None = None, spec=SPEC,
            **moe) -> Learner:
    return Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-3, micro_batch_size=2),
                                 objective=objective or SampledTokenPG(), reference=reference or ReferenceSpec(),
                                 total_steps=10, num_threads=2, moe=MoeSpec(bias_update=bias_update, **moe)))


def skew_routers(model) -> None:
    """Tokens prefer the last experts: a constant embedding channel (on for all tokens) that
    the routers weigh from −0.5 to +0.5, on top of random token-dependent router logits.

    Unlike test_kimi.opinionated_router_model (channel 10, every token scored alike), the
    tokens here differ (unit-variance embeddings, router weights of std 0.2): with identical
    tokens the optimizer step's drift of the router (~1e-2 in the scores) exceeds the spread
    the previous step's quantiles were read from, and QB balances nothing."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1, generator=g)
        model.model.embed_tokens.weight[:, 0] = 4.0
        for gate in router_modules(model).values():
            gate.weight.normal_(0, 0.2, generator=g)
            gate.weight[:, 0] = torch.linspace(-0.5, 0.5, gate.num_experts)


def padded_batch(seed: int, vocab: int, B: int = 4, T: int = 8) -> tuple[TrainBatch, int]:
    """Prompts of different lengths and completions cut short by the loss mask, so the packed
    micro-batches carry padding; random advantages and teacher distributions so the weights
    move. Returns the batch and its number of real tokens (prompt + unmasked completion)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (3, 7, 5, 9)[:B]]
    completion_BT = torch.randint(4, vocab, (B, T), generator=g)
    mask_BT = torch.ones(B, T)
    for b, length in enumerate((8, 3, 6, 1)[:B]):
        mask_BT[b, length:] = 0
    teacher_BTV = torch.log_softmax(torch.randn(B, T, vocab, generator=g), -1)
    batch = TrainBatch(prompt_ids, completion_BT, mask_BT, torch.zeros(B, T) - 2.0, torch.randn(B, T, generator=g),
                       teacher_BTV)
    real = sum(len(p) for p in prompt_ids) + int(mask_BT.sum())
    return batch, real


def vocab_of(lrn: Learner) -> int:
    return len(lrn.tokenizer)


def test_records_only_real_tokens_of_the_policy_forward():
    """Full-vocab loss (a second pass of the policy over the same tokens) plus a grad-buffer
    reference (a third forward through the same modules with reference weights): the step
    still counts each real token once per layer, padding excluded."""
    lrn = learner("none", FullVocabReverseKL(), ReferenceSpec(kind="grad_buffer", kl_coef=0.1))
    batch, real = padded_batch(0, vocab_of(lrn))
    padded = sum(len(p) for p in batch.prompt_ids) + batch.completion_ids_BT.numel()  # > real: there is padding
    metrics = lrn.train_step(batch)
    assert metrics["train/skipped"] == 0.0 and "train/ref_kl" in metrics
    assert metrics["moe/tokens"] == real and real < padded
    assert lrn.moe.recorder.tokens() == real
    for layer in (0, 1):
        assert sum(t.shape[0] for t in lrn.moe.recorder.indices[layer]) == real
    lrn.train_step(batch)  # the next step starts afresh
    assert lrn.moe.recorder.tokens() == real


def test_step_metrics_keys():
    lrn = learner("none", log_expert_load=True)
    metrics = lrn.train_step(padded_batch(1, vocab_of(lrn))[0])
    for key in ("moe/load_max_over_mean/max", "moe/load_cv/max", "moe/load_entropy/min", "moe/tokens",
                "moe/bias_range/max"):
        assert key in metrics
    for layer in (0, 1):
        for name in ("load_max_over_mean", "load_cv", "load_entropy"):
            assert f"moe/{name}/layer{layer}" in metrics
        shares = [metrics[f"moe/expert_load/layer{layer}/e{j}"] for j in range(4)]
        assert sum(shares) == pytest.approx(1.0)
    assert all(isinstance(v, float) for v in metrics.values())


def train_skewed(bias_update: str, steps: int) -> list[dict]:
    lrn = learner(bias_update)
    skew_routers(lrn.model)
    return [lrn.train_step(padded_batch(step, vocab_of(lrn))[0]) for step in range(steps)]


def test_quantile_bias_update_balances_a_skewed_router_during_training():
    """Step 0 is routed with zero biases (max/mean 2.0: all tokens on experts 2 and 3 of 4);
    from step 1 on, QB biases estimated on the previous step's batch spread the load, while
    without an update it stays near 2.0. Measured at these seeds: none 2.0, 1.95, 2.0, 1.95;
    quantile 2.0, 1.48, 1.29, 1.38 (a batch is ~40 real tokens: ±15% sampling noise per
    expert remains)."""
    none, quantile = train_skewed("none", 4), train_skewed("quantile", 4)
    assert none[0]["moe/load_max_over_mean/max"] == pytest.approx(2.0)
    assert quantile[0]["moe/load_max_over_mean/max"] == pytest.approx(2.0)
    assert all(m["moe/load_max_over_mean/max"] > 1.9 for m in none)
    assert all(m["moe/load_max_over_mean/max"] < 1.6 for m in quantile[1:]), [
        m["moe/load_max_over_mean/max"] for m in quantile]
    assert quantile[-1]["moe/load_entropy/min"] > none[-1]["moe/load_entropy/min"] + 0.15
    assert none[-1]["moe/bias_range/max"] == 0.0 and quantile[-1]["moe/bias_range/max"] > 0


def test_sign_update_moves_each_bias_by_one_step_against_its_load():
    lrn = learner("sign", sign_step=0.05)
    skew_routers(lrn.model)
    lrn.train_step(padded_batch(0, vocab_of(lrn))[0])
    for gate in router_modules(lrn.model).values():
        # Experts 0, 1 got nothing (below the mean load: +γ), experts 2, 3 everything (−γ).
        assert torch.allclose(gate.e_score_correction_bias, torch.tensor([0.05, 0.05, -0.05, -0.05]))


def test_a_skipped_update_leaves_the_biases():
    lrn = learner("quantile")
    batch, _ = padded_batch(0, vocab_of(lrn))
    bad = TrainBatch(batch.prompt_ids, batch.completion_ids_BT, batch.loss_mask_BT, batch.sampler_logprobs_BT,
                     batch.advantages_BT * float("nan"), batch.teacher_full_logprobs_BTV)
    assert lrn.train_step(bad)["train/skipped"] == 1.0
    assert all(gate.e_score_correction_bias.eq(0).all() for gate in router_modules(lrn.model).values())


def test_dense_student_has_no_balancer_and_rejects_a_bias_update():
    from tests.unit.test_kimi import TEACHER

    dense = learner("none", spec=TOKENIZER)
    assert dense.moe is None
    metrics = dense.train_step(padded_batch(0, vocab_of(dense))[0])
    assert metrics["train/skipped"] == 0.0 and not [k for k in metrics if k.startswith("moe/")]
    with pytest.raises(UserError, match="bias_update"):
        learner("quantile", spec=TEACHER)


def test_moe_spec_is_strict():
    assert MoeSpec().bias_update == "none"
    with pytest.raises(ValidationError):
        MoeSpec(bias_update="sgn")
    with pytest.raises(ValidationError):
        MoeSpec(bias_updates="quantile")
