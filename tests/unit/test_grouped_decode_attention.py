"""The grouped decode attention (model/generation/grouped_decode_attention.py) computes what transformers'
SDPA attention computes after `repeat_kv`: the same tokens and, in fp32, the same logprobs (to
summation order), over
a left-padded static cache, for grouped heads; and it leaves a model alone that has no groups
or does not run SDPA."""

from __future__ import annotations

import copy

import pytest
import torch

from k3post.config.schema import ModelSpec, TinyModelSpec
from k3post.model.generation.fast_sampling import StaticSampler
from k3post.model.generation.grouped_decode_attention import NAME, grouped_decode_attention, use_grouped_decode_attention
from k3post.model.loading.load import load_model
from k3post.model.generation.sampling import eos_ids
from k3post.types import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20]]


def sample(model, tokenizer, grouped: bool, seed: int):
    sampler = StaticSampler(model, tokenizer.pad_token_id, eos_ids(tokenizer, model.generation_config),
                            min_bucket=4, grouped_attention=grouped)
    return sampler.sample(PROMPTS, SamplingParams(max_new_tokens=20, temperature=1.0, top_p=1.0, seed=seed))


@pytest.mark.parametrize("kv_heads", [1, 2])  # groups of 4 and of 2 query heads
def test_the_sampler_with_grouped_attention_equals_it_with_sdpa(kv_heads):
    model, tokenizer = load_model(ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, num_kv_heads=kv_heads,
                                                               seed=3, init_std=0.2)))
    plain = copy.deepcopy(model)
    for seed in (0, 1):
        ours, theirs = sample(model, tokenizer, True, seed), sample(plain, tokenizer, False, seed)
        assert torch.equal(ours.completion_ids_BT, theirs.completion_ids_BT)
        torch.testing.assert_close(ours.logprobs_BT, theirs.logprobs_BT, atol=1e-5, rtol=0)  # fp32 sums
    assert model.config._attn_implementation == NAME and plain.config._attn_implementation == "sdpa"


def test_one_query_against_the_repeated_heads_by_brute_force():
    torch.manual_seed(0)
    B, KV, G, L, D = 3, 2, 3, 7, 8
    q, k, v = torch.randn(B, KV * G, 1, D), torch.randn(B, KV, L, D), torch.randn(B, KV, L, D)
    mask = torch.rand(B, 1, 1, L) > 0.3
    mask[..., -1] = True  # every row attends something
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = G, True
    got, _ = grouped_decode_attention(module, q, k, v, mask, scaling=D ** -0.5)  # [B, 1, H, D]
    for b in range(B):
        for h in range(KV * G):
            scores = (q[b, h, 0] @ k[b, h // G].T) * D ** -0.5
            weights = torch.softmax(scores.masked_fill(~mask[b, 0, 0], float("-inf")), dim=-1)
            torch.testing.assert_close(got[b, 0, h], weights @ v[b, h // G], atol=1e-6, rtol=0)


def test_a_model_that_does_not_run_sdpa_is_left_alone():
    model, _ = load_model(ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=1, seed=0)))
    model.set_attn_implementation("eager")
    assert not use_grouped_decode_attention(model) and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("Q", [2, 4])
def test_a_block_of_queries_with_its_own_mask_rows_against_the_repeated_heads_by_brute_force(Q):
    """A speculative verify block: Q queries per head, each with its own mask row [B, 1, Q, L]."""
    torch.manual_seed(1)
    B, KV, G, L, D = 3, 2, 3, 9, 8
    q, k, v = torch.randn(B, KV * G, Q, D), torch.randn(B, KV, L, D), torch.randn(B, KV, L, D)
    mask = torch.rand(B, 1, Q, L) > 0.4
    mask[..., 0] = True  # every query attends something
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = G, True
    got, _ = grouped_decode_attention(module, q, k, v, mask, scaling=D ** -0.5)  # [B, Q, H, D]
    assert got.shape == (B, Q, KV * G, D)
    for b in range(B):
        for h in range(KV * G):
            for i in range(Q):
                scores = (q[b, h, i] @ k[b, h // G].T) * D ** -0.5
                weights = torch.softmax(scores.masked_fill(~mask[b, 0, i], float("-inf")), dim=-1)
                torch.testing.assert_close(got[b, i, h], weights @ v[b, h // G], atol=1e-6, rtol=0)
