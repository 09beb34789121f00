"""Scoring as a continuation of cached keys and values (model/scoring/prefix_scoring.py) equals the
uncached forward, for every family of the parity suite that takes it (fp32, 1e-5): a shared
prefix cached once, groups of rows sharing a prompt encoded once, rows that do not start with
the prefix scored the uncached way; and a cache is never served for other ids than its own."""

from __future__ import annotations

import pytest
import torch

from k3post.config.schema import ModelSpec
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import completion_full_logprobs, completion_logprobs
from k3post.model.scoring.prefix_scoring import (PrefixKV, PrefixStore, cache_unsupported, common_prefix, encode_prefix,
                                         grouped_logprobs, hidden_logprobs, prefixed_hidden_states)
from k3post.model.scoring import prefix_scoring, shared_prefix_attention
from k3post.model.generation.fast_sampling import StaticSampler
from k3post.model.scoring.shared_prefix_attention import takes_split
from k3post.model.generation.sampling import eos_ids, sample_completions
from k3post.model.loading.tiny import build_tiny_tokenizer
from k3post.types import SamplingParams
from tests.unit.test_family_parity import FAMILIES, save_family

TOL = 1e-5
PREFIX = [20, 21, 22, 23, 24, 25, 26, 27, 28]
# Rows: three start with the prefix (two share a prompt: a group), one does not (scored uncached).
PROMPTS = [PREFIX + [5, 6, 7], PREFIX + [8], PREFIX + [5, 6, 7], [30, 31, 32, 33]]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    directory = save_family(request.param, tmp_path_factory.mktemp(request.param))
    model, tokenizer = load_model(ModelSpec(path=str(directory)))
    return request.param, model.eval(), tokenizer.pad_token_id


def prefix_of(model, ids: list[int]) -> PrefixKV:
    """The prefix's cache; for a family that cannot take one, its ids alone (never read)."""
    return encode_prefix(model, ids) if cache_unsupported(model) is None else PrefixKV(tuple(ids), (), ())


def completions(B: int, T: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random completion ids with rows of different lengths (a stop then pads)."""
    g = torch.Generator().manual_seed(1)
    ids_BT = torch.randint(40, 200, (B, T), generator=g)
    mask_BT = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    return ids_BT * mask_BT.long(), mask_BT


def test_common_prefix_is_the_longest_shared_start():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
    assert common_prefix([[1, 2], [3]]) == [] and common_prefix([]) == []


@pytest.fixture
def split_calls(monkeypatch) -> list[tuple]:
    """The shapes of every attention over the shared prefix (model/scoring/shared_prefix_attention.py)."""
    calls, real = [], shared_prefix_attention._prefix_part
    monkeypatch.setattr(shared_prefix_attention, "_prefix_part",
                        lambda q, k, v, scale: calls.append((tuple(q.shape), tuple(k.shape))) or real(q, k, v, scale))
    return calls


@pytest.mark.parametrize("attention", ["split", "concat"])
@pytest.mark.parametrize("groups", [True, False])
def test_cached_prefix_scores_equal_the_uncached_forward(family_model, groups, attention, monkeypatch, split_calls):
    """Both ways of attending the shared prefix (once for all rows with a log-sum-exp merge, or
    expanded in front of every row's keys) give the uncached forward's scores; the split one runs
    for every family whose attention it reproduces, with the one stored copy of the prefix."""
    model_type, model, pad = family_model
    monkeypatch.setattr(prefix_scoring, "PREFIX_ATTENTION", attention)
    ids_BT, mask_BT = completions(len(PROMPTS), 6, [6, 3, 5, 1])
    with torch.no_grad():
        want_BT = completion_logprobs(model, PROMPTS, ids_BT, mask_BT, pad)
        want_BTV = completion_full_logprobs(model, PROMPTS, ids_BT, mask_BT, pad)
        h_BTH, stats = prefixed_hidden_states(model, prefix_of(model, PREFIX), PROMPTS, ids_BT, mask_BT, pad,
                                              groups=groups)
        got_BT = hidden_logprobs(model, h_BTH, ids_BT, mask_BT)
        got_BTV = torch.log_softmax((h_BTH @ model.get_output_embeddings().weight.T).float(), -1)
    valid = mask_BT.bool()
    assert float((got_BT - want_BT).abs().max()) <= TOL, model_type
    if model_type not in ("gemma2", "gemma3_text", "granite", "cohere"):  # families with a logit transform
        assert float((got_BTV[valid] - want_BTV[valid]).abs().max()) <= TOL, model_type
    if cache_unsupported(model) is not None:
        assert stats.fallback_rows == len(PROMPTS) and stats.reused == 0
    else:
        assert stats.fallback_rows == 1
        group_saving = 3 if groups else 0  # the second [5, 6, 7] row's rest is not encoded again
        assert stats.reused == 3 * len(PREFIX) + group_saving, stats
    split = attention == "split" and cache_unsupported(model) is None and takes_split(model)
    assert bool(split_calls) == split, (model_type, attention)
    assert all(k[0] == 1 and k[2] == len(PREFIX) for _, k in split_calls)  # one copy of the prefix, every layer
    assert len(split_calls) == (model.config.num_hidden_layers * (2 if groups else 1) if split else 0)


def test_groups_without_a_prefix_encode_each_prompt_once(family_model):
    model_type, model, pad = family_model
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10], [5, 6, 7, 8]]
    ids_BT, mask_BT = completions(len(prompts), 5, [5, 2, 4, 5, 1])
    with torch.no_grad():
        want_BT = completion_logprobs(model, prompts, ids_BT, mask_BT, pad)
    got_BT = grouped_logprobs(model, prompts, ids_BT, mask_BT, pad)
    assert float((got_BT - want_BT).abs().max()) <= TOL, model_type
    _, stats = prefixed_hidden_states(model, None, prompts, ids_BT, mask_BT, pad)
    if cache_unsupported(model) is None:
        assert stats.encoded_prompt_tokens == 4 + 2, stats  # each distinct prompt once


def test_a_one_token_completion_is_predicted_by_the_prompts_last_position(family_model):
    model_type, model, pad = family_model
    prompts = [PREFIX + [5, 6], PREFIX + [5, 6]]
    ids_BT, mask_BT = completions(2, 1, [1, 1])
    with torch.no_grad():
        want_BT = completion_logprobs(model, prompts, ids_BT, mask_BT, pad)
        h_BTH, _ = prefixed_hidden_states(model, prefix_of(model, PREFIX), prompts, ids_BT, mask_BT, pad)
        got_BT = hidden_logprobs(model, h_BTH, ids_BT, mask_BT)
    assert float((got_BT - want_BT).abs().max()) <= TOL, model_type


def test_a_cached_prefix_is_keyed_on_its_ids(tmp_path):
    """A run whose prefix changes (a resumed job with another system prompt) gets the new
    prefix's keys: the store rebuilds on other ids, and a prefix the rows do not start with is
    never applied to them (scores equal the uncached ones, which differ between the two)."""
    model, tokenizer = load_model(ModelSpec(path=str(save_family("llama", tmp_path))))
    pad = tokenizer.pad_token_id
    store = PrefixStore(model)
    old, new = PREFIX, [40, 41] + PREFIX[2:]
    assert store.get(old) is store.get(old) and store.builds == 1
    kv = store.get(new)
    assert store.builds == 2 and kv.ids == tuple(new)
    fresh = encode_prefix(model, new)
    assert all(torch.equal(a, b) for a, b in zip(kv.keys, fresh.keys))
    prompts = [new + [5, 6, 7], new + [8]]
    ids_BT, mask_BT = completions(2, 4, [4, 2])
    with torch.no_grad():
        want_BT = completion_logprobs(model, prompts, ids_BT, mask_BT, pad)
        stale_BT = completion_logprobs(model, [old + [5, 6, 7], old + [8]], ids_BT, mask_BT, pad)
        h_BTH, stats = prefixed_hidden_states(model, encode_prefix(model, old), prompts, ids_BT, mask_BT, pad)
        got_BT = hidden_logprobs(model, h_BTH, ids_BT, mask_BT)
    assert float((want_BT - stale_BT).abs().max()) > 1e-3  # the two prefixes score differently: the test can fail
    assert stats.fallback_rows == 2
    assert float((got_BT - want_BT).abs().max()) <= TOL


GROUP_PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [12, 13], [12, 13], [5, 6, 7, 8, 9], [14, 15, 16]]
SAMPLING = SamplingParams(max_new_tokens=5, temperature=0.9, top_p=1.0, seed=3)


def test_samplers_prefill_each_prompt_once_and_draw_the_same(family_model):
    """With repeated prompts (sampling.n > 1) both HF engines prefill each distinct prompt once
    and continue each row from its prompt's cache: the same tokens and log μ as prefilling every
    row (same seed), with fewer prompt tokens run."""
    model_type, model, pad = family_model
    tokenizer = build_tiny_tokenizer()
    whole = sample_completions(model, tokenizer, GROUP_PROMPTS, SAMPLING, groups=False)
    grouped = sample_completions(model, tokenizer, GROUP_PROMPTS, SAMPLING)
    assert torch.equal(whole.completion_ids_BT, grouped.completion_ids_BT), model_type
    assert float((whole.logprobs_BT - grouped.logprobs_BT).abs().max()) <= TOL, model_type
    engine = StaticSampler(model, pad, eos_ids(tokenizer, model.generation_config), min_bucket=4)
    fast_whole = engine.sample(GROUP_PROMPTS, SAMPLING, groups=False)
    fast = engine.sample(GROUP_PROMPTS, SAMPLING)
    assert torch.equal(fast_whole.completion_ids_BT, fast.completion_ids_BT), model_type
    assert float((fast_whole.logprobs_BT - fast.logprobs_BT).abs().max()) <= TOL, model_type
    if model_type != "kimi_linear":
        P = 5  # the longest prompt; three distinct ones among six rows
        assert grouped.prefill_tokens == 3 * (P - 1) + 6 and whole.prefill_tokens == 6 * P
        if all(type(layer).__name__ == "StaticLayer" for layer in engine._cache(6, 8 + 5).layers):
            assert fast.prefill_tokens == 3 * 8 < fast_whole.prefill_tokens  # bucket of 8 (min_bucket 4)


def test_a_forward_in_which_a_layer_skipped_the_shared_prefix_raises(tmp_path):
    """The split attention is reached through the model's config; a forward in which some layer
    did not attend the shared prefix (here: none did) raises instead of returning its scores."""
    model, _ = load_model(ModelSpec(path=str(save_family("llama", tmp_path))))
    kv = encode_prefix(model, PREFIX)
    with pytest.raises(RuntimeError, match="attended by layers"):
        with shared_prefix_attention.shared_prefix(model, kv.keys, kv.values):
            pass
    assert model.config._attn_implementation == "sdpa"  # restored
