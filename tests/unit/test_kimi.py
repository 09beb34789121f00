"""Kimi Linear students (KDA + MLA + MoE) through the pipeline: build, decode, logprobs, learn,
save/reload, weight sync, pruning, router statistics. Tiny sizes; the KDA ops run transformers'
pure-PyTorch fallback on this CPU."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from k3post.config.errors import UserError
from k3post.algo.objectives import FullVocabReverseKL
from k3post.config.schema import KimiSpec, ModelSpec, OptimSpec, ReferenceSpec, TinyModelSpec
from k3post.model.loading.kimi import kernel_report, layer_types
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import completion_full_logprobs
from k3post.types import SamplingParams, TrainBatch
from tests.unit.test_model import assert_logprobs_padding_invariant, prompts

TOKENIZER = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3))
TEACHER = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=11, init_std=0.3))


def kimi(keep_layers: list[int] | None = None, **overrides) -> ModelSpec:
    fields = dict(tokenizer_from=TOKENIZER, hidden_size=32, num_layers=4, linear_num_heads=2, linear_head_dim=8,
                  num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                  num_experts=4, experts_per_token=2, moe_intermediate_size=16, intermediate_size=32, seed=5)
    return ModelSpec(kimi=KimiSpec(**(fields | overrides)), keep_layers=keep_layers)


@pytest.fixture(scope="module")
def student():
    return load_model(kimi())


def test_layer_types_always_have_full_attention():
    assert layer_types(8, 4) == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    assert layer_types(2, 4) == ["linear_attention", "full_attention"]  # the default would have none
    assert layer_types(3, 1) == ["full_attention"] * 3


def test_spec_validation():
    with pytest.raises(ValueError, match="exactly one of"):
        ModelSpec(kimi=KimiSpec(tokenizer_from=TOKENIZER), tiny=TinyModelSpec())
    with pytest.raises(ValueError, match="experts_per_token"):
        KimiSpec(tokenizer_from=TOKENIZER, num_experts=4, experts_per_token=5)


def test_student_shape_ids_and_kernel_report(student):
    model, tokenizer = student
    config = model.config
    assert type(model).__name__ == "KimiLinearForCausalLM" and config.vocab_size == len(tokenizer)
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id) == (
        tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id)
    assert config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    report = kernel_report(model)
    assert report["kda_layers"] == [0, 1, 2] and report["mla_layers"] == [3] and report["moe_layers"] == [1, 2, 3]
    assert set(report["kda_ops"]) == {"chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
                                      "causal_conv1d_fn", "causal_conv1d_update"}
    if not report["fla_kernels"]:  # a CPU-only torch has no triton, so no fla kernels
        assert report["kda_ops"]["chunk_kimi_delta_attention"] == "torch"
    assert "unknown" not in report["kda_ops"].values()


def test_cached_decode_equals_the_full_forward(student):
    """generate's step logits (KDA recurrent state + MLA latent cache) == one full forward."""
    model, _ = student
    x = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        out = model.generate(input_ids=x, max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        full = model(input_ids=out.sequences).logits[0, x.shape[1] - 1:-1]
    assert torch.allclose(torch.stack(out.logits, 1)[0], full, atol=1e-4)


def test_logprobs_are_padding_invariant_and_match_the_sampler(student):
    assert_logprobs_padding_invariant(*student)


def _full_vocab_batch(sampler):
    """The student's samples of 4 prompts and a full-vocab training batch against TEACHER."""
    teacher, _ = load_model(TEACHER)
    r = sampler.sample(prompts(4), SamplingParams(max_new_tokens=6, seed=0))
    with torch.no_grad():
        teacher_BTV = completion_full_logprobs(teacher, r.prompt_ids, r.completion_ids_BT, r.loss_mask_BT,
                                               sampler.tokenizer.pad_token_id)
    return r, TrainBatch(r.prompt_ids, r.completion_ids_BT, r.loss_mask_BT, r.sampler_logprobs_BT,
                         torch.zeros_like(r.sampler_logprobs_BT), teacher_BTV)


def test_learner_distills_a_kimi_student_toward_a_tiny_teacher():
    """Student samples, the teacher scores them (full distributions), the learner takes
    full-vocab reverse-KL steps: the loss (the exact reverse KL on the batch) falls, and the
    synced sampler then computes exactly the learner's distributions."""
    from k3post.engine.learner.learner import Learner, LearnerConfig
    from k3post.engine.samplers.sampler import HFSampler

    spec = kimi(num_layers=2, first_k_dense=0)  # one KDA + one MLA layer, both MoE: the fallback KDA is slow on a CPU
    sampler = HFSampler(spec, num_threads=2)
    learner = Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-2, micro_batch_size=4),
                                    objective=FullVocabReverseKL(), total_steps=100, num_threads=2))
    r, batch = _full_vocab_batch(sampler)
    pad = sampler.tokenizer.pad_token_id
    losses = []
    for _ in range(4):
        metrics = learner.train_step(batch)
        assert metrics["train/skipped"] == 0.0 and metrics["train/grad_norm"] > 0
        losses.append(metrics["train/loss"])
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.85 * losses[0], losses
    sampler.load_weights(learner.weights(), version=1)
    with torch.no_grad():
        args = (r.prompt_ids, r.completion_ids_BT, r.loss_mask_BT, pad)
        assert torch.allclose(sampler.full_logprobs(r), completion_full_logprobs(learner.model, *args), atol=1e-6)


def test_save_pretrained_reloads_with_identical_logits(student, tmp_path):
    model, tokenizer = student
    model.save_pretrained(tmp_path / "kimi")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "kimi")
    assert reloaded.config.layer_types == model.config.layer_types
    x = torch.tensor([[4, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, reloaded(input_ids=x).logits)


def test_weight_sync_round_trips_every_tensor():
    from k3post.model.training.weights import export_weights, import_weights

    a, _ = load_model(kimi(seed=1))
    b, _ = load_model(kimi(seed=2))
    a.model.layers[1].mlp.gate.e_score_correction_bias.fill_(0.25)  # buffers travel too
    x = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert not torch.equal(a(input_ids=x).logits, b(input_ids=x).logits)
        import_weights(b, export_weights(a))
        assert torch.equal(a(input_ids=x).logits, b(input_ids=x).logits)
    assert torch.equal(b.model.layers[1].mlp.gate.e_score_correction_bias, torch.full((4,), 0.25))


def test_embeddings_initialised_from_the_teacher():
    model, _ = load_model(kimi(init_embeddings_from=TEACHER))
    teacher, _ = load_model(TEACHER)
    assert torch.equal(model.get_input_embeddings().weight, teacher.get_input_embeddings().weight)
    assert torch.equal(model.get_output_embeddings().weight, teacher.get_output_embeddings().weight)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # untied: both train
    with pytest.raises(UserError, match="hidden_size"):
        load_model(kimi(hidden_size=48, init_embeddings_from=TEACHER))


def test_teacher_embeddings_start_unsaturated():
    """A near-identity random body between the teacher's embedding and head predicts the input
    token again; at final-norm weight 1 its softmax saturates (and reverse KL on its own samples
    has no gradient). The default 0.1 with teacher embeddings starts it near uniform."""
    x = torch.randint(4, 90, (4, 12), generator=torch.Generator().manual_seed(0))

    def entropy_and_copy_rate(final_norm_init):
        model, tokenizer = load_model(kimi(init_embeddings_from=TEACHER, final_norm_init=final_norm_init))
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=x).logits, -1)
        return float(-(logp.exp() * logp).sum(-1).mean()), float((logp.argmax(-1) == x).float().mean())

    default, saturated = entropy_and_copy_rate(None), entropy_and_copy_rate(1.0)
    assert saturated[1] == 1.0 and saturated[0] < 1.0  # "repeat the last token", confidently
    assert default[0] > 0.95 * math.log(100)  # ~uniform over the tiny tokenizer's ~100 ids
    assert load_model(kimi())[0].model.norm.weight.eq(1.0).all()  # without a teacher: transformers' init


def test_pruned_kimi_student_keeps_its_layer_kinds_and_decodes():
    model, _ = load_model(kimi(num_layers=5, keep_layers=[0, 3, 4]))
    assert model.config.layer_types == ["linear_attention", "full_attention", "linear_attention"]
    assert model.config.mlp_layer_types == ["dense", "sparse", "sparse"]
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        out = model.generate(input_ids=x, max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        full = model(input_ids=out.sequences).logits[0, x.shape[1] - 1:-1]
    assert torch.allclose(torch.stack(out.logits, 1)[0], full, atol=1e-4)


def opinionated_router_model():
    """A Kimi student whose routers prefer the last experts for every token: a constant
    embedding channel 0 (on for all tokens) that the routers weigh from −0.4 to +0.4."""
    from k3post.model.training.moe_stats import router_modules

    model, _ = load_model(kimi())
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        for gate in router_modules(model).values():
            gate.weight[:, 0] = torch.linspace(-0.4, 0.4, gate.num_experts)
    return model


def test_router_recorder_sees_what_the_routers_chose():
    """Loads from the hooked `mlp.gate` choices == top-k of the router logits that transformers
    itself returns (output_router_logits), padding left out."""
    from k3post.algo.moe import expert_load, route_top_k
    from k3post.model.training.moe_stats import RouterRecorder

    model = opinionated_router_model()
    ids = torch.randint(4, 90, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad(), RouterRecorder(model) as recorder:
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    loads = recorder.loads(token_mask=mask)
    assert sorted(loads) == [1, 2, 3] and len(out.router_logits) == 3
    for (layer, load), logits_NE in zip(loads.items(), out.router_logits):
        expected = expert_load(route_top_k(torch.sigmoid(logits_NE.float()), 2), 4, mask.reshape(-1))
        assert torch.equal(load, expected), layer
    metrics = recorder.metrics(token_mask=mask)
    assert metrics["moe/load_max_over_mean/layer3"] == pytest.approx(2.0)  # everything on experts 2 and 3
    assert metrics["moe/load_entropy/min"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="token_mask"):
        recorder.loads(token_mask=mask[:2])


def test_quantile_biases_from_one_batch_balance_the_next_in_the_model():
    from k3post.model.training.moe_stats import RouterRecorder, moe_load_metrics, set_router_biases

    model = opinionated_router_model()
    g = torch.Generator().manual_seed(1)
    first, second = torch.randint(4, 90, (8, 24), generator=g), torch.randint(4, 90, (8, 24), generator=g)
    with torch.no_grad(), RouterRecorder(model, keep_scores=True) as recorder:
        model(input_ids=first)
    before = moe_load_metrics(model, second, torch.ones_like(second))
    set_router_biases(model, recorder.quantile_biases())
    after = moe_load_metrics(model, second, torch.ones_like(second))
    assert before["moe/load_max_over_mean/max"] == pytest.approx(2.0)
    # 192 tokens: ±10% sampling noise per expert remains (1.13-1.30 over the layers at this seed).
    assert after["moe/load_max_over_mean/max"] < 1.4 and after["moe/load_entropy/min"] > 0.97


def test_kimi_student_trains_under_fp8_qat_with_the_reference_in_the_grad_buffers():
    """The K3 learner options on a K3-shaped student: FP8 fake quantization on its Linear layers
    (KDA projections, MLA, experts' dense MLP) and a KL-to-reference term whose reference
    weights ride in the gradient buffers. The loss falls and nothing goes non-finite."""
    from k3post.config.schema import QatSpec, ReferenceSpec
    from k3post.engine.learner.learner import Learner, LearnerConfig
    from k3post.engine.samplers.sampler import HFSampler
    from k3post.model.quant.qat import fake_quant_layers

    spec = kimi(num_layers=2, first_k_dense=1)  # one KDA layer with a dense MLP, one MLA layer with MoE
    sampler = HFSampler(spec, num_threads=2)
    learner = Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-2, micro_batch_size=4),
                                    objective=FullVocabReverseKL(),
                                    reference=ReferenceSpec(kind="grad_buffer", kl_coef=0.1), total_steps=100,
                                    num_threads=2, qat=QatSpec(enabled=True)))
    assert fake_quant_layers(learner.model) >= 4
    _, batch = _full_vocab_batch(sampler)
    losses = [learner.train_step(batch)["train/loss"] for _ in range(4)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.9 * losses[0], losses
