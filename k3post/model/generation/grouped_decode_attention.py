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
(KV, G). A block of Q queries with its own mask rows [B, 1, Q, L] (a speculative verify, model/
fast_speculation.py) stands in the same axis as G·Q rows, each query's mask row repeated for the
G heads of its group (a few kB, not the cache). A prefill (more than 16 queries, or no mask),
models without grouping and any extra input (a position bias, dropout) take transformers' own
SDPA function unchanged.

`use_grouped_decode_attention(model)` switches a model that runs SDPA to it (the masks stay
SDPA's); any other implementation (eager for soft-capped families, flash kernels) is left alone.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "k3post_grouped_sdpa"
# The longest block of queries the grouped path takes (a verify block is K + 1 ≤ 9 long); a
# prefill is longer, and its mask repeated G times would be a copy worth avoiding.
BLOCK_QUERIES = 16


def grouped_decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: returns ([B, Q, H, D], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    B, H, Q, D = query.shape
    if (groups == 1 or dropout or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
            or not _grouped_mask(attention_mask, Q)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    # query head kv·G + g at position q → [kv, (g, q)]: repeat_kv's head order, the group's queries in a row
    grouped = query.reshape(B, H // groups, groups * Q, D)
    if Q > 1:  # each query's mask row once per query head of the group
        L = attention_mask.shape[-1]
        attention_mask = attention_mask[:, :, None].expand(B, 1, groups, Q, L).reshape(B, 1, groups * Q, L)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                                           scale=scaling)
    return out.reshape(B, H, Q, D).transpose(1, 2).contiguous(), None  # [B, KV, G·Q, D] → [B, Q, H, D]


def _grouped_mask(mask: torch.Tensor | None, queries: int) -> bool:
    """Whether the grouped path takes this mask: one query with any mask SDPA takes, or a short
    block of queries (a speculative verify) with an explicit [B, 1, Q, L] mask, one row per query."""
    if queries == 1:
        return True
    return (queries <= BLOCK_QUERIES and mask is not None and mask.dim() == 4 and mask.shape[1] == 1
            and mask.shape[2] == queries)


def use_grouped_decode_attention(model: PreTrainedModel) -> bool:
    """Switch `model` from SDPA to the grouped decode attention; False (nothing changed) when it
    does not run SDPA."""
    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, grouped_decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
