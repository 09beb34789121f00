"""Decode attention that reads each grouped key/value head once.

Why. In grouped-query attention (GQA) H query heads share KV < H key/value heads: query head
h reads kv head h // G, with G = H / KV. transformers' SDPA path gives PyTorch the grouping
(`enable_gqa`) only when there is no attention mask; a decode step over a left-padded static
cache always has one, so it calls `repeat_kv` instead, which *copies* every layer's whole cache
G times before attending: at batch 32 over a 384-slot cache a 0.40B Qwen2 student (14 query
heads, 2 kv heads) writes 2 × 22 MB per layer, ≈ 1 GB a decode step, more than its weights.

How. With one query position, the G query heads of a group can stand in the *query-length*
axis instead: q [B, H, 1, D] viewed as [B, KV, G, D] attends k, v [B, KV, L, D] as they lie,

    out[b, kv·G + g] = softmax(q[b, kv, g] · k[b, kv]ᵀ · scale + mask[b]) · v[b, kv],

which is exactly what each head computes after `repeat_kv` (the same dot products, the same
mask row, broadcast over the group). Nothing is copied; the mask [B, 1, 1, L] broadcasts over
(KV, G). Prefill (more than one query position), models without grouping and any extra input
(a position bias, dropout) take transformers' own SDPA function unchanged.

`use_grouped_decode_attention(model)` switches a model that runs SDPA to it (the masks stay
SDPA's); any other implementation (eager for soft-capped families, flash kernels) is left alone.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "k3post_grouped_sdpa"


def grouped_decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: returns ([B, Q, H, D], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    B, H, Q, D = query.shape
    if groups == 1 or Q != 1 or dropout or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    grouped = query.reshape(B, H // groups, groups, D)  # query head kv·G + g → [kv, g]: repeat_kv's order
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                                           scale=scaling)
    return out.reshape(B, 1, H, D), None  # [B, KV, G, D] → [B, Q = 1, H, D]


def use_grouped_decode_attention(model: PreTrainedModel) -> bool:
    """Switch `model` from SDPA to the grouped decode attention; False (nothing changed) when it
    does not run SDPA."""
    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, grouped_decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
