"""Per-family parity of the three log-probabilities OPD relies on (issue 17, item 1).

For every model family k3post accepts (k3post/model/families.py), a tiny random model is built
from that family's own transformers config class, saved with a *realistic* generation_config
(repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7: what Qwen instruct checkpoints
ship) and loaded back through `load_model`, then on CPU in fp32:

(a) the sampler's recorded log μ equals the learner's log π (`completion_logprobs`) on the same
    tokens at the same weights, max |Δ| ≤ 1e-5: through the HF engine's `sample_completions`
    (`generate`) and the fast engine's `StaticSampler`;
(b) both equal the distribution the tokens were actually drawn from: `torch.multinomial` is
    observed, and the probabilities it was handed must equal softmax(top_p(logits / T)) of the
    model's own forward (row by row, no padding; the HF engine at top_p 0.8, the fast one at 1)
    - the recipe's parameters only, none of the model's
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

from dataclasses import dataclass

import pytest
import torch
import transformers as tf
from transformers import GenerationConfig

from k3post.algo.chunked_kl import chunked_reverse_kl
from k3post.algo.opd import kl_divergence
from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, TeacherSpec, VllmSpec
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.engine.vllm.vllm_engine import engine_options
from k3post.model.families import ACCEPTED, logit_transform
from k3post.algo.token_draws import top_p_filter
from k3post.model.generation.fast_sampling import StaticSampler
from k3post.model.loading.kimi import kimi_config
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import completion_full_logprobs, completion_logprobs
from k3post.model.generation.sampling import Completions, eos_ids, sample_completions
from k3post.model.loading.tiny import build_tiny_tokenizer
from k3post.types import Prompt, Rollouts, SamplingParams

V = 256
TOL = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # different lengths: padding is exercised
RECIPE = SamplingParams(max_new_tokens=5, temperature=0.9, top_p=1.0, seed=0)
HF_RECIPE = SamplingParams(max_new_tokens=5, temperature=0.9, top_p=0.8, seed=0)
MODEL_GENERATION = dict(do_sample=True, repetition_penalty=1.05, top_k=20, top_p=0.8, temperature=0.7)


def _common(tokenizer) -> dict:
    return dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
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


def tiny_config(model_type: str, tokenizer, head_dim: int = 16):
    """The family's tiny config; `head_dim` 32 for vLLM's CPU attention (multiples of 32)."""
    cls, extra = FAMILY_CONFIGS[model_type]
    heads = {"num_attention_heads": 64 // head_dim, "num_key_value_heads": max(1, 32 // head_dim)}
    if "head_dim" in extra:  # families that take it explicitly (Gemma also scales its queries by it)
        heads |= {"head_dim": head_dim}
        heads |= {"query_pre_attn_scalar": head_dim} if "query_pre_attn_scalar" in extra else {}
    config = _kimi(tokenizer) if cls is None else cls(**(_common(tokenizer) | extra | heads))
    assert config.model_type == model_type
    return config


def save_family(model_type: str, directory, head_dim: int = 16):
    """A seeded tiny model of the family, its generation_config and the tiny tokenizer, saved."""
    tokenizer = build_tiny_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(tiny_config(model_type, tokenizer, head_dim))
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


@dataclass
class Sampled:
    """One engine's completions, the probabilities of each draw, and the model's own forward
    logits at every completion position [B, T, V] (one unpadded row at a time, transforms included)."""

    out: Completions
    drawn: list[torch.Tensor]
    forward_logits_BTV: torch.Tensor


@torch.no_grad()
def sampled_with(model, sample, params: SamplingParams) -> Sampled:
    recorder = DrawRecorder()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "multinomial", recorder)
        out = sample(params)
    ids_BT, mask_BT = out.completion_ids_BT, out.loss_mask_BT
    logits_BTV = torch.zeros(*ids_BT.shape, model.config.vocab_size)
    for b, prompt in enumerate(PROMPTS):
        n = int(mask_BT[b].sum())
        ids = torch.tensor([prompt + ids_BT[b, :n].tolist()])
        logits_BTV[b, :n] = model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) - 1 + n].float()
    return Sampled(out, recorder.probs, logits_BTV)


def record(model_type: str, key: str, value: float) -> None:
    RESULTS.setdefault(model_type, {})[key] = value


def check_sampler(model_type: str, model, run: Sampled, params: SamplingParams, label: str) -> None:
    """(a) sampler log μ == learner log π and (b) the drawn-from probabilities == the recipe's
    distribution over the model's own forward logits, and log μ == that forward's log-softmax."""
    out, mask_BT, ids_BT = run.out, run.out.loss_mask_BT, run.out.completion_ids_BT
    with torch.no_grad():
        learner_BT = completion_logprobs(model, PROMPTS, ids_BT, mask_BT, model.config.pad_token_id,
                                         params.temperature)
    sampler_vs_learner = float(((out.logprobs_BT - learner_BT) * mask_BT).abs().max())
    reference_BTV = torch.log_softmax(run.forward_logits_BTV / params.temperature, dim=-1)
    reference_BT = reference_BTV.gather(-1, ids_BT[..., None]).squeeze(-1) * mask_BT
    sampler_vs_forward = float(((out.logprobs_BT - reference_BT) * mask_BT).abs().max())
    expected_BTV = torch.softmax(top_p_filter(reference_BTV, params.top_p), dim=-1)
    drawn_vs_recipe = max(float((run.drawn[t][b].float() - expected_BTV[b, t]).abs().max())
                          for b, t in mask_BT.nonzero().tolist())
    record(model_type, f"{label} sampler-learner", sampler_vs_learner)
    record(model_type, f"{label} drawn-recipe", drawn_vs_recipe)
    assert len(run.drawn) >= ids_BT.shape[1], "every token is a draw"
    assert sampler_vs_learner <= TOL, f"{model_type}: sampler log μ vs learner log π, max |Δ| {sampler_vs_learner}"
    assert sampler_vs_forward <= TOL, f"{model_type}: sampler log μ vs the model's forward, {sampler_vs_forward}"
    assert drawn_vs_recipe <= TOL, f"{model_type}: drawn-from probabilities vs the recipe's, {drawn_vs_recipe}"


@pytest.fixture(scope="module")
def hf_sampled(family) -> Sampled:
    """The HF engine's path (`generate`) at the recipe's top_p < 1: the draw must be the recipe's
    truncated distribution, with none of the model's top_k 20 / repetition penalty / temperature."""
    _, _, model, tokenizer = family
    return sampled_with(model, lambda p: sample_completions(model, tokenizer, PROMPTS, p), HF_RECIPE)


def test_hf_sampler_records_what_it_draws_from_and_the_learner_agrees(family, hf_sampled):
    model_type, _, model, _ = family
    check_sampler(model_type, model, hf_sampled, HF_RECIPE, "hf")


def test_fast_sampler_records_what_it_draws_from_and_the_learner_agrees(family):
    model_type, _, model, tokenizer = family
    engine = StaticSampler(model, tokenizer.pad_token_id, eos_ids(tokenizer, model.generation_config), min_bucket=4)
    check_sampler(model_type, model, sampled_with(model, lambda p: engine.sample(PROMPTS, p), RECIPE), RECIPE, "fast")


def rollouts_of(out: Completions) -> Rollouts:
    """Completions of PROMPTS as the Rollouts a teacher scores (the prompts' text is not used)."""
    prompts = [Prompt(str(i), "s", "t", (("user", "x"),)) for i in range(len(PROMPTS))]
    return Rollouts(prompts, PROMPTS, out.completion_ids_BT, out.loss_mask_BT, out.logprobs_BT)


def test_teacher_scores_equal_the_learners(family, hf_sampled):
    model_type, directory, model, tokenizer = family
    teacher = TeacherScorer("t", TeacherSpec(model=ModelSpec(path=str(directory))))
    rollouts = rollouts_of(hf_sampled.out)
    ids_BT, mask_BT, pad = rollouts.completion_ids_BT, rollouts.loss_mask_BT, tokenizer.pad_token_id
    with torch.no_grad():
        learner_BT = completion_logprobs(model, PROMPTS, ids_BT, mask_BT, pad)
        learner_BTV = completion_full_logprobs(model, PROMPTS, ids_BT, mask_BT, pad)
    reference_BTV = torch.log_softmax(hf_sampled.forward_logits_BTV, dim=-1)
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
    with caplog.at_level("WARNING", logger="k3post.model.generation.sampling"):
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
