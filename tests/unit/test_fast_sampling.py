"""The fast HF engine (static KV cache; compiled decode on GPUs) on a CPU, where it runs eagerly:
it must give the plain `generate` path's tokens and logprobs, and fall back cleanly."""

from __future__ import annotations

import pytest
import torch

from k3post.config.schema import ModelSpec, SamplingSpec, TinyModelSpec
from k3post.engine.samplers.fast_sampler import FastHFSampler
from k3post.engine.samplers.sampler import HFSampler
from k3post.algo.token_draws import draw_exponential_race, top_p_filter
from k3post.model.generation.fast_sampling import StaticSampler, prompt_bucket
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import completion_logprobs
from k3post.model.generation.sampling import eos_ids, sample_completions
from k3post.types import Prompt, SamplingParams

# Peaked (init_std 0.2), so some rows stop early at EOS and the padding after it is exercised.
SPEC = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3, init_std=0.2))
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20]]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model(SPEC)


def static_sampler(model, tokenizer, min_bucket: int = 4) -> StaticSampler:
    return StaticSampler(model, tokenizer.pad_token_id, eos_ids(tokenizer, model.generation_config),
                         compile=True, min_bucket=min_bucket)  # compile is ignored on a CPU


@pytest.mark.parametrize("seed, temperature", [(7, 0.9), (1, 1.0), (3, 1.3)])
def test_seeded_sampling_equals_the_plain_generate_path(model_and_tokenizer, seed, temperature):
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_new_tokens=24, temperature=temperature, top_p=1.0, seed=seed)
    plain = sample_completions(model, tokenizer, PROMPTS, params)
    fast = static_sampler(model, tokenizer).sample(PROMPTS, params)
    assert torch.equal(fast.completion_ids_BT, plain.completion_ids_BT)
    assert torch.equal(fast.loss_mask_BT, plain.loss_mask_BT)
    torch.testing.assert_close(fast.logprobs_BT, plain.logprobs_BT, atol=1e-5, rtol=0)


def test_some_rows_stop_early_and_are_padded(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    out = static_sampler(model, tokenizer).sample(PROMPTS * 4, SamplingParams(40, 1.0, 1.0, seed=0))
    lengths = out.loss_mask_BT.sum(dim=1)
    assert lengths.min() < lengths.max()  # the test exercises rows of different lengths
    assert (out.logprobs_BT[out.loss_mask_BT == 0] == 0).all()


def test_greedy_equals_generate_and_logprobs_equal_teacher_forcing(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    fast = static_sampler(model, tokenizer, min_bucket=16).sample(PROMPTS, SamplingParams(16, 1.0, 1.0, 0),
                                                                 greedy=True)
    P = max(len(p) for p in PROMPTS)
    ids = torch.full((len(PROMPTS), P), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(PROMPTS):
        ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(p), 1
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids(tokenizer, model.generation_config))
    assert torch.equal(fast.completion_ids_BT, out[:, P:])
    # log μ recorded while sampling = the learner's teacher-forced logprob: importance ratios are 1.
    scored = completion_logprobs(model, PROMPTS, fast.completion_ids_BT, fast.loss_mask_BT, tokenizer.pad_token_id)
    torch.testing.assert_close(fast.logprobs_BT, scored, atol=1e-5, rtol=0)


def test_prompt_buckets_are_powers_of_two_above_the_minimum():
    assert [prompt_bucket(n, 64) for n in (1, 64, 65, 128, 129, 700)] == [64, 64, 128, 128, 256, 1024]


def test_top_p_keeps_the_smallest_set_reaching_p():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = top_p_filter(scores, 0.7).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, then 0.8 ≥ 0.7
    assert top_p_filter(scores, 0.5).isfinite().tolist() == [[True, False, False, False]]
    assert top_p_filter(scores, 1.0) is scores


def test_the_exponential_race_draws_from_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draws = draw_exponential_race(probs.expand(40_000, 4).contiguous())
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)


def test_fast_engine_on_cpu_matches_the_plain_engine_and_syncs_weights():
    plain, fast = HFSampler(SPEC), FastHFSampler(SPEC, compile=True)
    prompts = [Prompt(str(i), "s", "t", (("user", text),)) for i, text in enumerate(["hi", "what is 2+2?", "a"])]
    params = SamplingParams(12, 1.0, 1.0, seed=5)
    a, b = plain.sample(prompts, params), fast.sample(prompts, params)
    assert torch.equal(a.completion_ids_BT, b.completion_ids_BT) and a.texts == b.texts
    # New weights reach the generating model (through the engine's worker thread).
    weights = {k: v + 0.01 for k, v in plain.model.state_dict().items() if k != "lm_head.weight"}
    assert fast.load_weights(weights, version=3) == 3 and fast.weight_version == 3
    assert torch.equal(fast.model.model.norm.weight, weights["model.norm.weight"])
    fast.close()


def test_recipe_options_choose_the_engine():
    from k3post.config.load import load_distill_recipe
    from k3post.launch.engines import sampler_spec

    recipe = load_distill_recipe("recipes/smoke/tiny.yaml")
    assert sampler_spec(recipe).cls is HFSampler  # the default stays the plain engine
    fast = recipe.model_copy(update={"sampling": SamplingSpec(max_new_tokens=8, cache="static", compile=True)})
    engine = sampler_spec(fast)
    assert engine.cls is FastHFSampler and engine.kwargs["device"] == "cpu" and engine.kwargs["compile"] is True
    with pytest.raises(ValueError, match="needs sampling.cache: static"):
        SamplingSpec(compile=True)


@pytest.mark.parametrize("temperature, top_p, greedy", [(1.0, 1.0, False), (0.8, 0.9, False), (1.0, 1.0, True)])
def test_the_decode_step_and_its_pick_trace_as_one_graph(model_and_tokenizer, monkeypatch, temperature, top_p, greedy):
    """On a GPU the decode step is compiled with its pick (the exponential race) as one CUDA graph:
    a graph break would split it and launch the pick's kernels from Python again. Traced here
    whole (fullgraph: a break raises) with the GPU's draw, it samples what the eager step samples."""
    import k3post.model.generation.fast_sampling as fast_sampling

    model, tokenizer = model_and_tokenizer
    monkeypatch.setattr(fast_sampling, "draw", draw_exponential_race)  # the draw a GPU makes
    params = SamplingParams(12, temperature, top_p, seed=5)
    eager = static_sampler(model, tokenizer).sample(PROMPTS, params, greedy=greedy)
    traced = static_sampler(model, tokenizer)
    torch._dynamo.reset()
    traced._step = torch.compile(traced._step_eager, fullgraph=True, backend="eager", dynamic=False)
    out = traced.sample(PROMPTS, params, greedy=greedy)
    assert torch.equal(out.completion_ids_BT, eager.completion_ids_BT)
    torch.testing.assert_close(out.logprobs_BT, eager.logprobs_BT, atol=1e-6, rtol=0)
    torch._dynamo.reset()
