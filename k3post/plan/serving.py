"""Device memory of the engines that do not train: teachers, samplers, reward models (pure maths).

HF engine (transformers, `engine: hf`), bytes per actor, w = bytes of the model's dtype:
    weights                      params · w
    a scoring forward (teachers, reward models; no_grad) over its rows × sequence length: the
        layers run one after another and keep nothing, so the transient is the larger of one
        layer's working set per token (residual stream and norm output 2·2h; gate, up and
        SiLU(gate) 3·2i at once) and the head's moment: the final hidden states 2h per token
        plus one 1,024-position chunk of logits (bf16 2V, fp32 4V, logsumexp's 4V = 10V each);
        a teacher of a full_vocab loss that sends log-probabilities also holds them, fp32
        [rows, new tokens, V], until the learner has them;
    a sampler: its weights, the KV cache of its rows at prompt bucket + max_new_tokens (the
        static cache pads prompts to a power of two ≥ 128; the dynamic cache grows to the same
        length), K and V per KV head per full-attention layer (MLA: its compressed latent; KDA
        layers a fixed state per row), the prefill's working set as above, and, when new
        weights arrive over `collective`, one receive bucket of learner.weight_bucket_mb.
vLLM engine (`engine: vllm`): vLLM reserves gpu_memory_utilization × the actor's share of its
    GPU (config/vllm_resources.py) whatever the batch; the weights must fit in it, and what is
    left is its KV cache. The planner reports the reservation and how many tokens of KV cache
    remain (`kv_tokens`), so a batch that would wait for cache blocks shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3post.plan.memory import HEAD_CHUNK, Breakdown
from k3post.plan.shapes import ModelShape

MIN_BUCKET = 128  # model/generation/fast_sampling.py StaticSampler's min_bucket


@dataclass(frozen=True)
class ServeSetup:
    """One serving actor's work: `rows` sequences of `prompt_len` + `new_tokens` tokens."""

    dtype_bytes: int
    rows: int
    prompt_len: int
    new_tokens: int
    sync_bucket_bytes: float = 0.0  # a sampler receiving weights over collective
    full_vocab_out: bool = False  # a full_vocab teacher sending log-probabilities: [rows, new, V] fp32


def prompt_bucket(length: int, minimum: int = MIN_BUCKET) -> int:
    bucket = max(1, minimum)
    while bucket < length:
        bucket *= 2
    return bucket


def forward_transient(shape: ModelShape, tokens: int, head_positions: int) -> float:
    """The no-grad forward's largest moment over `tokens` tokens (module docstring)."""
    mlp = shape.intermediate
    if shape.moe_experts:
        mlp = max(shape.intermediate, (shape.moe_top_k + shape.moe_shared) * shape.moe_intermediate)
    layer = tokens * (4 * shape.hidden + 6 * mlp)
    head = tokens * 2 * shape.hidden + min(HEAD_CHUNK, head_positions) * 10 * shape.vocab
    return max(layer, head)


def scorer_peak(shape: ModelShape, s: ServeSetup) -> Breakdown:
    """An HF teacher or reward model scoring its rows in one forward."""
    tokens = s.rows * (s.prompt_len + s.new_tokens)
    out = Breakdown({"weights": shape.params * s.dtype_bytes,
                     "scoring forward": forward_transient(shape, tokens, s.rows * s.new_tokens)})
    if s.full_vocab_out:
        out.parts["full-vocab output"] = s.rows * s.new_tokens * shape.vocab * 4
    return out


def kv_cache_bytes(shape: ModelShape, rows: int, length: int, dtype_bytes: int) -> float:
    return rows * (length * shape.kv_per_token + shape.linear_state) * dtype_bytes


def sampler_peak(shape: ModelShape, s: ServeSetup) -> Breakdown:
    """An HF sampler: weights, the KV cache of its rows, the prefill, a weight-sync bucket."""
    length = prompt_bucket(s.prompt_len) + s.new_tokens
    prefill = forward_transient(shape, s.rows * prompt_bucket(s.prompt_len), s.rows)
    return Breakdown({"weights": shape.params * s.dtype_bytes,
                      "KV cache": kv_cache_bytes(shape, s.rows, length, s.dtype_bytes),
                      "prefill": prefill, "weight-sync bucket": s.sync_bucket_bytes})


def vllm_peak(shape: ModelShape, s: ServeSetup, reserved: float) -> tuple[Breakdown, float]:
    """What a vLLM engine reserves, and the KV-cache tokens left after its weights (negative:
    the weights alone do not fit the reservation)."""
    weights = shape.params * s.dtype_bytes
    per_token = max(shape.kv_per_token * s.dtype_bytes, 1)
    return Breakdown({"vLLM reservation": reserved}), (reserved - weights) / per_token
