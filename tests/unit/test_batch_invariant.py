"""The batch-invariant mode (model/batch_invariant.py): with it, the learner's recomputed log π of
every sampled token equals the sampler's recorded log μ bit for bit (`torch.equal`), whatever the
batch, the left padding, the prompt lengths, the micro-batches or the temperature; a decode step
equals the whole-sequence forward at its position; gradients are the usual ones. Without it (the
negative control) the two differ, so these tests notice if the control stops controlling."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, TinyModelSpec
from k3post.engine.common import check_on_policy
from k3post.model.batch_invariant import _cpu_rows, batch_invariant
from k3post.model.generation.sampling import Completions, sample_completions
from k3post.model.loading.load import load_model
from k3post.model.loading.tiny import build_tiny_tokenizer
from k3post.model.scoring.logprobs import completion_logprobs, completion_logprobs_and_full
from k3post.types import SamplingParams

# Eight prompts of eight lengths (2 to 23 tokens: left padding up to 21 columns), the last two the
# same prompt (a group: its prefill runs once and is shared, model/generation/sampling.py).
PROMPTS = [[5 + i] * (2 + 3 * i) for i in range(6)] + [[40, 41, 42]] * 2


def tiny_model(blocks: bool):
    """The tiny Llama, whose 101-token vocabulary makes the CPU path take one row per call
    (`_cpu_rows`), or (`blocks`) the same with its vocabulary padded to 104, every width divisible
    by 4: blocks of `CPU_ROWS` rows, the path of real models."""
    model, tokenizer = load_model(ModelSpec(tiny=TinyModelSpec(hidden_size=64, num_layers=2, seed=1)))
    if blocks:
        model.resize_token_embeddings(104, mean_resizing=False)
    assert (_cpu_rows(model) > 1) == blocks
    return model, tokenizer


@pytest.fixture(scope="module", params=["row-by-row", "blocks"])
def tiny(request):
    return tiny_model(request.param == "blocks")


def sample(model, tokenizer, prompts, temperature: float, bitwise: bool) -> Completions:
    params = SamplingParams(max_new_tokens=8, temperature=temperature, top_p=1.0, seed=0)
    return sample_completions(model, tokenizer, prompts, params, bitwise=bitwise)


def learner_logprobs(model, tokenizer, prompts, out: Completions, rows: list[int], temperature: float,
                     bitwise: bool, full: bool = False) -> torch.Tensor:
    """The learner's log π of `rows` (one micro-batch), as it computes them: train mode, with grad."""
    model.train()
    try:
        args = ([prompts[i] for i in rows], out.completion_ids_BT[rows], out.loss_mask_BT[rows], tokenizer.pad_token_id,
                temperature)
        if full:
            return completion_logprobs_and_full(model, *args, bitwise=bitwise)[0].detach().cpu()
        return completion_logprobs(model, *args, bitwise=bitwise).detach().cpu()  # beside the sampler's, on the host
    finally:
        model.eval()


def recomputed(model, tokenizer, prompts, out: Completions, micro_batch: int, temperature: float,
               bitwise: bool = True) -> torch.Tensor:
    """Every row's log π, computed in micro-batches of `micro_batch` rows taken in reverse order."""
    rows = list(range(len(prompts)))[::-1]
    result = torch.zeros_like(out.logprobs_BT)
    for start in range(0, len(rows), micro_batch):
        part = rows[start:start + micro_batch]
        result[part] = learner_logprobs(model, tokenizer, prompts, out, part, temperature, bitwise)
    return result


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_learner_recomputes_the_samplers_logprobs_bit_for_bit(tiny, batch, temperature):
    model, tokenizer = tiny
    prompts = PROMPTS[-batch:] if batch < 8 else PROMPTS
    out = sample(model, tokenizer, prompts, temperature, bitwise=True)
    assert out.loss_mask_BT.sum() >= 2 * batch
    for micro_batch in sorted({1, 2, batch}):  # other compositions, other padding, other row counts
        assert torch.equal(recomputed(model, tokenizer, prompts, out, micro_batch, temperature), out.logprobs_BT)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_static_cache_sampler_records_what_the_learner_recomputes(tiny, batch):
    """The static-cache sampler (model/generation/fast_sampling.py: prompts left-padded to a
    128-column bucket, one static cache, a decode step per token) in the mode: the learner's
    log π equals its log μ bit for bit in every micro-batch split; and on a CPU it draws the
    dynamic-cache sampler's tokens with the same log μ, to the bit."""
    from k3post.model.generation.fast_sampling import StaticSampler
    from k3post.model.generation.sampling import eos_ids

    model, tokenizer = tiny
    prompts = PROMPTS[-batch:] if batch < 8 else PROMPTS
    static = StaticSampler(model, tokenizer.pad_token_id, eos_ids(tokenizer, model.generation_config), bitwise=True)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=1.0, seed=0)
    out = static.sample(prompts, params)
    assert out.loss_mask_BT.sum() >= 2 * batch
    for micro_batch in sorted({1, 2, batch}):
        assert torch.equal(recomputed(model, tokenizer, prompts, out, micro_batch, 0.7), out.logprobs_BT)
    dynamic = sample(model, tokenizer, prompts, 0.7, bitwise=True)
    assert torch.equal(out.completion_ids_BT, dynamic.completion_ids_BT)
    assert torch.equal(out.logprobs_BT, dynamic.logprobs_BT)


def test_without_the_mode_the_two_differ(tiny):
    """The negative control: the same rollouts, the ordinary kernels on both sides."""
    model, tokenizer = tiny
    out = sample(model, tokenizer, PROMPTS, 1.0, bitwise=False)
    gap = (recomputed(model, tokenizer, PROMPTS, out, 3, 1.0, bitwise=False) - out.logprobs_BT).abs()
    print(f"mode off: max |log π − log μ| = {gap.max().item():.3g}")
    assert 0 < gap.max().item() < 1e-5


def test_the_full_vocabulary_path_gives_the_same_sampled_token_values(tiny):
    """A full_vocab or top-k loss takes log π of the sampled tokens from its one forward: bitwise too."""
    model, tokenizer = tiny
    out = sample(model, tokenizer, PROMPTS, 0.7, bitwise=True)
    rows = list(range(len(PROMPTS)))
    assert torch.equal(learner_logprobs(model, tokenizer, PROMPTS, out, rows, 0.7, True, full=True), out.logprobs_BT)


def whole_and_stepwise(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one sequence from one forward over all of it, and one token at a time with a KV cache."""
    whole = model(ids).logits[0]
    cache = DynamicCache(config=model.config)
    steps = [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0, 0] for t in range(ids.shape[1])]
    return whole, torch.stack(steps)


def assert_decode_equals_whole(model) -> None:
    """In the mode, on the model's device: a 40-token sequence's logits one token at a time equal
    its whole-sequence forward; and its first 20 tokens prefilled left-padded by 7 beside a longer
    row, then decoded to 40 beside it, give the same logits at every position."""
    device = model.get_output_embeddings().weight.device
    ids = torch.arange(5, 45, device=device).view(1, -1)
    with torch.no_grad(), batch_invariant(model):
        whole, stepwise = whole_and_stepwise(model, ids)
        assert torch.equal(whole, stepwise)
        padded = torch.cat([torch.zeros(7, dtype=torch.long, device=device), ids[0, :20]])
        batch = torch.stack([padded, torch.arange(60, 87, device=device)])
        mask = torch.stack([torch.arange(27, device=device) >= 7, torch.ones(27, dtype=torch.bool, device=device)]).long()
        cache = DynamicCache(config=model.config)
        prefill = model(batch, attention_mask=mask, past_key_values=cache, use_cache=True,
                        position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        assert torch.equal(prefill.logits[0, 7:], whole[:20])
        for t in range(20, 40):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long, device=device)], dim=1)
            step = model(torch.tensor([[ids[0, t]], [99]], device=device), attention_mask=mask, past_key_values=cache,
                         use_cache=True, position_ids=torch.tensor([[t], [t + 7]], device=device))
            assert torch.equal(step.logits[0, 0], whole[t])


def test_a_decode_step_equals_the_whole_sequence_forward_at_every_position(tiny):
    """Equal bit for bit in the mode (`assert_decode_equals_whole`); not without it."""
    model, _ = tiny
    with torch.no_grad():
        whole, stepwise = whole_and_stepwise(model, torch.arange(5, 45).view(1, -1))
    assert not torch.equal(whole, stepwise)
    assert_decode_equals_whole(model)


def test_gradients_are_the_usual_ones(tiny):
    """The mode changes the forward's values (by rounding), not the gradient of the maths: the
    learner's gradient of Σ a_t·log π_t in the mode matches the ordinary one (relative 1e-5)."""
    model, tokenizer = tiny
    out = sample(model, tokenizer, PROMPTS[:4], 0.8, bitwise=True)
    grads = {}
    model.train()
    for bitwise in (False, True):
        model.zero_grad()
        logprobs_BT = completion_logprobs(model, PROMPTS[:4], out.completion_ids_BT, out.loss_mask_BT,
                                          tokenizer.pad_token_id, 0.8, bitwise=bitwise)
        (logprobs_BT * torch.linspace(-1, 1, logprobs_BT.numel()).view_as(logprobs_BT)).sum().backward()
        grads[bitwise] = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.eval()
    model.zero_grad()
    for name, grad in grads[False].items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(grads[True][name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item()), name


def test_a_bf16_student_and_other_families(tiny):
    """bfloat16 (where the gap without the mode is ~1e-3) and the other covered families."""
    tokenizer = build_tiny_tokenizer()
    models = [load_model(ModelSpec(tiny=TinyModelSpec(hidden_size=64, num_layers=2, seed=1), dtype="bfloat16"))[0]]
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None, initializer_range=0.1)
    for config in (tf.Qwen2Config(**common), tf.Qwen3Config(**common, head_dim=16),
                   tf.MistralConfig(**common, head_dim=16)):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            models.append(tf.AutoModelForCausalLM.from_config(config).eval())
    for model in models:
        out = sample(model, tokenizer, PROMPTS[3:], 0.9, bitwise=True)
        assert torch.equal(recomputed(model, tokenizer, PROMPTS[3:], out, 2, 0.9), out.logprobs_BT), \
            (model.config.model_type, model.dtype)


@pytest.fixture(scope="module")
def fp8_pair():
    """The blocks model as a QAT learner (fake-quantised Linears over its own weights) and the FP8
    sampler those weights sync to (e4m3 bytes and per-row scales): FP8 rollouts on the QAT grid."""
    import copy

    from k3post.model.quant.fp8_linear import hold_own_weights_in_fp8
    from k3post.model.quant.qat import prepare_fp8_qat

    learner, tokenizer = tiny_model(blocks=True)
    sampler = copy.deepcopy(learner)
    assert hold_own_weights_in_fp8(sampler) and prepare_fp8_qat(learner)
    return learner, sampler.eval(), tokenizer


def test_under_fp8_qat_in_blocks_the_learner_recomputes_the_fp8_samplers_logprobs(fp8_pair):
    """Many rows in 16-row blocks (a prefill of 8 prompts, micro-batches of 1, 3 and 8 rows): the
    QAT learner's log π equals the FP8 sampler's log μ bit for bit; with the mode off they differ."""
    learner, sampler, tokenizer = fp8_pair
    out = sample(sampler, tokenizer, PROMPTS, 0.8, bitwise=True)
    for micro_batch in (1, 3, 8):
        assert torch.equal(recomputed(learner, tokenizer, PROMPTS, out, micro_batch, 0.8), out.logprobs_BT)
    off = sample(sampler, tokenizer, PROMPTS, 0.8, bitwise=False)
    assert not torch.equal(recomputed(learner, tokenizer, PROMPTS, off, 3, 0.8, bitwise=False), off.logprobs_BT)


def test_a_quantised_weight_is_formed_once_per_forward_not_once_per_block(fp8_pair, monkeypatch):
    """An MLP runs block by block in the mode, and each block calls its Linears: their quantised
    weights are formed once per forward, whatever the number of blocks (here ~15)."""
    learner, sampler, tokenizer = fp8_pair
    calls = {"learner": 0, "sampler": 0}

    def counted(side, method):
        def call(*args, **kwargs):
            calls[side] += 1
            return method(*args, **kwargs)
        return call

    quantiser = learner.model.layers[0].mlp.up_proj.weight_fake_quantizer
    monkeypatch.setattr(quantiser, "forward", counted("learner", quantiser.forward))
    layer = sampler.model.layers[0].mlp.up_proj
    monkeypatch.setattr(layer, "dequantised_weight", counted("sampler", layer.dequantised_weight))
    ids = torch.arange(5, 245).view(1, -1) % 100 + 1
    with torch.no_grad():
        for model in (learner, sampler):
            with batch_invariant(model):
                model(ids)
    assert calls == {"learner": 1, "sampler": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_cpu_a_row_gets_the_same_bits_in_every_place_of_a_block(dtype):
    """The CPU path calls each row-wise piece on blocks of `CPU_ROWS` rows (model/batch_invariant.py:
    `_cpu_rows`). At the quickstart's widths, a row's Linear output, norm and log-softmax are the
    same bits alone, at every place of a block and beside any other rows, with the last block
    padded: what lets a decode step of 3 rows and a whole sequence of 40 agree."""
    from torch import nn

    from k3post.model.batch_invariant import each_row, linear_rows, token_logprobs

    g = torch.Generator().manual_seed(4)
    weight, norm = torch.randn(1536, 576, generator=g).to(dtype), nn.RMSNorm(576, eps=1e-5).to(dtype)
    x = torch.randn(576, generator=g).to(dtype)
    targets = torch.tensor([7])
    with batch_invariant(tiny_model(blocks=True)[0]):  # a model whose widths take blocks
        alone = (linear_rows(x[None], weight), each_row(norm, x[None]), token_logprobs(x[None], targets, 0.7))
        for rows in (2, 15, 16, 17, 40):
            for place in {0, rows // 2, rows - 1}:
                batch = torch.randn(rows, 576, generator=g).to(dtype) * 3
                batch[place] = x
                got = (linear_rows(batch, weight)[place], each_row(norm, batch)[place],
                       token_logprobs(batch, targets.expand(rows), 0.7)[place])
                assert all(torch.equal(a[0], b) for a, b in zip(alone, got)), (rows, place)


def test_a_model_with_a_width_not_divisible_by_4_takes_one_row_per_call():
    """A width whose 16-row block is not a whole number of 64-element vectors would put some
    rows' last elements in an elementwise kernel's scalar tail: such a model takes one row per call."""
    from k3post.model.batch_invariant import CPU_ROWS

    assert _cpu_rows(tiny_model(blocks=True)[0]) == CPU_ROWS
    odd = load_model(ModelSpec(tiny=TinyModelSpec(hidden_size=64, intermediate_size=90, num_layers=1, seed=1)))[0]
    assert _cpu_rows(odd) == 1


def test_a_model_the_mode_does_not_cover_is_refused_when_its_engine_starts():
    tokenizer = build_tiny_tokenizer()
    gemma = tf.AutoModelForCausalLM.from_config(tf.Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16))
    check_on_policy(gemma, "off")
    with pytest.raises(UserError, match=r"sampling.on_policy: bitwise: .* model_type 'gemma2' .* use "
                                        r"sampling.on_policy: off"):
        check_on_policy(gemma, "bitwise")
