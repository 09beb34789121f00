"""Per-family parity of the three log-probabilities OPD relies on (issue 17, item 1).

For every model family k3post accepts (k3post/model/families.py), a tiny random model is built
from that family's own transformers config class, saved with a *realistic* generation_config
(repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7: what Qwen instruct checkpoints
ship) and loaded back through `load_model`, then on CPU in fp32:

(a) the sampler's recorded log μ equals the learner's log π (`completion_logprobs`) on the same
    tokens at the same weights, max |Δ| ≤ 1e-5: through the HF engine's `sample_completions`
    (`generate`) and the fast engine's `StaticSampler`;
(b) both equal the distribution the tokens were actually drawn from: `torch.multinomial` is
    observed, and the probabilities it was handed must equal softmax(logits / T) of the model's
    own forward (row by row, no padding) - the recipe's parameters only, none of the model's
    processors. The model's own forward is the reference, so a learner that skips a family's
    output transform (Gemma's soft-cap, Granite's and Cohere's logit scales) fails here;
(c) the teacher's scores (`TeacherScorer.score`, `score_topk`, `score_with_hidden` and the
    hidden-state head) equal the learner's on the same model.

Transforms are set larger than the shipped defaults (soft-cap 2 instead of 30, Granite's
logits_scaling 4) so that with logits of std ~0.8 a missing transform moves log-probs by far
more than the tolerance: at the default cap of 30 the tanh would differ from identity by ~x³/2700,
below 1e-5 for these tiny models, and the test could not fail.

`pytest -s` prints the table of max |Δ| per family.
"""

from __future__ import annotations


import pytest
import torch
import transformers as tf
from transformers import GenerationConfig

from k3post.algo.chunked_kl import chunked_reverse_kl
from k3post.algo.opd import kl_divergence
from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, TeacherSpec, VllmSpec
from k3post.engine.teacher import TeacherScorer
from k3post.engine.vllm_engine import engine_options
from k3post.model.families import ACCEPTED, logit_transform
from k3post.model.fast_sampling import StaticSampler, top_p_filter
from k3post.model.kimi import kimi_config
from k3post.model.load import load_model
from k3post.model.logprobs import completion_full_logprobs, completion_logprobs
from k3post.model.sampling import eos_ids, sample_completions
from k3post.model.tiny import build_tiny_tokenizer
from k3post.types import Prompt, Rollouts, SamplingParams

V = 256
TOL = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # different lengths: padding is exercised
RECIPE = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=1.0, seed=0)
MODEL_GENERATION = dict(do_sample=True, repetition_penalty=1.05, top_k=20, top_p=0.8, temperature=0.7)


def _common(tokenizer) -> dict:
    return dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, bos_token_id=None, initializer_range=0.1)


def _kimi(tokenizer):
    from k3post.config.schema import KimiSpec, TinyModelSpec

    spec = KimiSpec(tokenizer_from=ModelSpec(tiny=TinyModelSpec()), num_layers=2, full_attention_every=2,
                    first_k_dense=0, init_std=0.1)
    config = kimi_config(spec, tokenizer)  # one KDA + one MLA layer, both MoE
    config.vocab_size = V
    return config


# model_type -> (config class, family-specific arguments); Kimi Linear through k3post's own builder.
FAMILY_CONFIGS = {
    "llama": (tf.LlamaConfig, {}),
    "qwen2": (tf.Qwen2Config, {}),
    "qwen3": (tf.Qwen3Config, dict(head_dim=16)),
    "qwen3_moe": (tf.Qwen3MoeConfig, dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32)),
    "mistral": (tf.MistralConfig, dict(head_dim=16)),
    "gemma2": (tf.Gemma2Config, dict(head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=2.0)),
    "gemma3_text": (tf.Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=2.0)),
    "phi3": (tf.Phi3Config, {}),
    "granite": (tf.GraniteConfig, dict(logits_scaling=4.0)),
    "cohere": (tf.CohereConfig, dict(logit_scale=0.25)),
    "olmo2": (tf.Olmo2Config, {}),
    "kimi_linear": (None, {}),
}
FAMILIES = sorted(FAMILY_CONFIGS)
RESULTS: dict[str, dict[str, float]] = {}


def tiny_config(model_type: str, tokenizer):
    cls, extra = FAMILY_CONFIGS[model_type]
    config = _kimi(tokenizer) if cls is None else cls(**(_common(tokenizer) | extra))
    assert config.model_type == model_type
    return config


def save_family(model_type: str, directory):
    """A seeded tiny model of the family, its generation_config and the tiny tokenizer, saved."""
    tokenizer = build_tiny_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(tiny_config(model_type, tokenizer))
    model.generation_config = GenerationConfig(**MODEL_GENERATION, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    directory = save_family(request.param, tmp_path_factory.mktemp(request.param))
    model, tokenizer = load_model(ModelSpec(path=str(directory)))
    return request.param, directory, model, tokenizer


class DrawRecorder:
    """Stands in for torch.multinomial and keeps the probabilities each draw was made from."""

    def __init__(self):
        self.real, self.probs = torch.multinomial, []

    def __call__(self, probs, *args, **kwargs):
        self.probs.append(probs.detach().clone())
        return self.real(probs, *args, **kwargs)


def own_forward_logprobs(model, prompt_ids, completion_ids_BT, mask_BT, temperature):
    """log_softmax(model(prompt + completion).logits / T) at every completion position, [B, T, V],
    one unpadded row at a time: the model's own forward, transforms included."""
    out = torch.zeros(*completion_ids_BT.shape, model.config.vocab_size)
    for b, prompt in enumerate(prompt_ids):
        n = int(mask_BT[b].sum())
        ids = torch.tensor([prompt + completion_ids_BT[b, :n].tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float() / temperature
        out[b, :n] = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + n], dim=-1)
    return out


def record(model_type: str, key: str, value: float) -> None:
    RESULTS.setdefault(model_type, {})[key] = value


def check_sampler(model_type, model, sample, params, monkeypatch, label):
    """Sample, then (a) sampler log μ == learner log π and (b) the drawn-from probabilities ==
    the recipe's distribution over the model's own forward logits."""
    recorder = DrawRecorder()
    monkeypatch.setattr(torch, "multinomial", recorder)
    out = sample(params)
    monkeypatch.undo()
    ids_BT, mask_BT = out.completion_ids_BT, out.loss_mask_BT
    learner_BT = completion_logprobs(model, PROMPTS, ids_BT, mask_BT, model.config.pad_token_id, params.temperature)
    sampler_vs_learner = float(((out.logprobs_BT - learner_BT) * mask_BT).abs().max())
    reference_BTV = own_forward_logprobs(model, PROMPTS, ids_BT, mask_BT, params.temperature)
    reference_BT = reference_BTV.gather(-1, ids_BT[..., None]).squeeze(-1) * mask_BT
    sampler_vs_forward = float(((out.logprobs_BT - reference_BT) * mask_BT).abs().max())
    expected_BTV = torch.softmax(top_p_filter(reference_BTV, params.top_p), dim=-1)
    drawn_vs_recipe = 0.0
    for t in range(ids_BT.shape[1]):
        for b in range(ids_BT.shape[0]):
            if mask_BT[b, t]:
                drawn_vs_recipe = max(drawn_vs_recipe,
                                      float((recorder.probs[t][b].float() - expected_BTV[b, t]).abs().max()))
    record(model_type, f"{label} sampler-learner", sampler_vs_learner)
    record(model_type, f"{label} drawn-recipe", drawn_vs_recipe)
    assert len(recorder.probs) >= ids_BT.shape[1], "every token is a draw"
    assert sampler_vs_learner <= TOL, f"{model_type}: sampler log μ vs learner log π, max |Δ| {sampler_vs_learner}"
    assert sampler_vs_forward <= TOL, f"{model_type}: sampler log μ vs the model's forward, {sampler_vs_forward}"
    assert drawn_vs_recipe <= TOL, f"{model_type}: drawn-from probabilities vs the recipe's, {drawn_vs_recipe}"
    return out


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_hf_sampler_records_what_it_draws_from_and_the_learner_agrees(family, top_p, monkeypatch):
    model_type, _, model, tokenizer = family
    params = SamplingParams(RECIPE.max_new_tokens, RECIPE.temperature, top_p, RECIPE.seed)
    check_sampler(model_type, model, lambda p: sample_completions(model, tokenizer, PROMPTS, p), params,
                  monkeypatch, f"hf top_p={top_p}")


def test_fast_sampler_records_what_it_draws_from_and_the_learner_agrees(family, monkeypatch):
    model_type, _, model, tokenizer = family
    engine = StaticSampler(model, tokenizer.pad_token_id, eos_ids(tokenizer, model.generation_config), min_bucket=4)
    check_sampler(model_type, model, lambda p: engine.sample(PROMPTS, p), RECIPE, monkeypatch, "fast")


def _rollouts(model, tokenizer) -> Rollouts:
    out = sample_completions(model, tokenizer, PROMPTS, RECIPE)
    prompts = [Prompt(str(i), "s", "t", (("user", "x"),)) for i in range(len(PROMPTS))]
    return Rollouts(prompts, PROMPTS, out.completion_ids_BT, out.loss_mask_BT, out.logprobs_BT)


def test_teacher_scores_equal_the_learners(family):
    model_type, directory, model, tokenizer = family
    teacher = TeacherScorer("t", TeacherSpec(model=ModelSpec(path=str(directory))))
    rollouts = _rollouts(model, tokenizer)
    ids_BT, mask_BT, pad = rollouts.completion_ids_BT, rollouts.loss_mask_BT, tokenizer.pad_token_id
    with torch.no_grad():
        learner_BT = completion_logprobs(model, PROMPTS, ids_BT, mask_BT, pad)
        learner_BTV = completion_full_logprobs(model, PROMPTS, ids_BT, mask_BT, pad)
    reference_BTV = own_forward_logprobs(model, PROMPTS, ids_BT, mask_BT, 1.0)
    valid = mask_BT.bool()
    full_vs_forward = float((learner_BTV[valid] - reference_BTV[valid]).abs().max())
    score_vs_learner = float((teacher.score(rollouts) - learner_BT).abs().max())
    token_BT, topk = teacher.score_topk(rollouts, k=8)
    topk_vs_learner = max(float((token_BT - learner_BT).abs().max()),
                          float((topk.logprobs_BTK[valid] - learner_BTV.topk(8, dim=-1).values[valid]).abs().max()))
    hidden_BT, hidden = teacher.score_with_hidden(rollouts)
    hidden_vs_learner = float((hidden_BT - learner_BT).abs().max())
    record(model_type, "teacher-learner", max(score_vs_learner, topk_vs_learner, hidden_vs_learner))
    record(model_type, "learner full-forward", full_vs_forward)
    assert full_vs_forward <= TOL, f"{model_type}: learner's full distribution vs the model's forward"
    assert score_vs_learner <= TOL and topk_vs_learner <= TOL and hidden_vs_learner <= TOL, RESULTS[model_type]
    check_hidden_state_head(teacher, learner_BTV, hidden.hidden_BTH, valid)


def check_hidden_state_head(teacher, learner_BTV, hidden_BTH, valid):
    """`send: hidden`: the learner's chunked KL from the teacher's hidden states and output head is
    KL(learner‖teacher) = 0 at equal weights; a soft-capping teacher is refused (not linear in W)."""
    if logit_transform(teacher.model.config).softcap is not None:
        with pytest.raises(UserError, match="soft-caps its logits"):
            teacher.output_head()
        return
    kl_BT = chunked_reverse_kl(learner_BTV, hidden_BTH, teacher.output_head(), chunk=100)
    assert float(kl_BT[valid].abs().max()) <= TOL
    assert float(kl_divergence(learner_BTV, learner_BTV)[valid].abs().max()) <= TOL


def test_the_table_is_the_tested_families():
    assert set(ACCEPTED) == set(FAMILY_CONFIGS)


def test_a_family_not_in_the_table_is_refused_at_load(tmp_path):
    tokenizer = build_tiny_tokenizer()
    config = tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    tf.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UserError) as info:
        load_model(ModelSpec(path=str(tmp_path)))
    for words in (str(tmp_path), "'gpt2'", "llama, mistral, olmo2", "qwen3_moe"):
        assert words in str(info.value)


def test_the_models_processors_are_named_once_at_load(tmp_path, caplog):
    directory = save_family("qwen2", tmp_path)
    with caplog.at_level("WARNING", logger="k3post.model.sampling"):
        load_model(ModelSpec(path=str(directory)))
        load_model(ModelSpec(path=str(directory)))
    lines = [r.getMessage() for r in caplog.records if "generation_config sets" in r.getMessage()]
    assert len(lines) == 1
    for words in ("repetition_penalty=1.05", "top_k=20", "temperature=0.7", "recipe's sampling parameters only"):
        assert words in lines[0]


def test_vllm_engines_take_no_sampling_defaults_from_the_model():
    """vLLM's generation_config="auto" would make the model's file the requests' defaults."""
    assert engine_options("/m", VllmSpec(), num_gpus=0.0)["generation_config"] == "vllm"


@pytest.fixture(scope="module", autouse=True)
def family_table():
    """Not a check: prints the measured max |Δ| per family after the module (pytest -s)."""
    yield
    keys = sorted({k for row in RESULTS.values() for k in row})
    print("\nfamily | " + " | ".join(keys))
    for model_type in sorted(RESULTS):
        print(model_type + " | " + " | ".join(f"{RESULTS[model_type].get(k, float('nan')):.1e}" for k in keys))
