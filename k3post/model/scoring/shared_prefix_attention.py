"""Attention over a prefix that every row shares, without copying the prefix to every row.

A scoring pass after a cached prefix (model/scoring/prefix_scoring.py) gives each of its R rows the same
P0 prefix keys and values. Concatenating them in front of each row's own keys, as a cache does,
writes R copies of the prefix in every layer (and, for grouped-query attention, the attention
then repeats them to every query head: G·R copies). Attention is a softmax over the keys, and a
softmax over a union of key sets is a weighted merge of the softmaxes over each set:

    o = Σ_j softmax(s)_j v_j  over  j ∈ prefix ∪ own
      = (e^{A} o_A + e^{B} o_B) / (e^{A} + e^{B}),     A = logsumexp_{j∈prefix} s_j,
                                                       B = logsumexp_{j∈own} s_j,

with o_A, o_B the attention outputs over each set alone. So each layer attends the prefix once
for all rows, as one batch of R·G·L queries against the single stored copy of the prefix (every
query sees all of the prefix: no mask, and the G query heads of a key head folded into the query
axis, so no key is repeated), attends each row's own keys (the rest of its prompt, its completion)
under its own mask, and merges the two by their log-sum-exps. Nothing of size R × P0 is written
except the scores themselves.

It is the model's attention exactly (up to float summation order) when the model's attention is
softmax(q·k·scale + mask)·v: `sdpa` or `eager` attention with no logit soft-capping, no sinks and
no dropout (`takes_split`). The prefix keys are handed to the attention through a context
variable set around one forward (`shared_prefix`), under the registered implementation name
`IMPLEMENTATION`; the mask of the own keys is the 4-D boolean mask the caller passes in, which
the model hands through unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
from transformers import AttentionInterface, PreTrainedModel

IMPLEMENTATION = "k3post_shared_prefix"
_PREFIX: ContextVar["_Shared | None"] = ContextVar("k3post_shared_prefix", default=None)


class _Shared:
    """The stored prefix per layer, and which layers attended it in this forward."""

    def __init__(self, keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...]):
        self.keys, self.values, self.seen = keys, values, []


def takes_split(model: PreTrainedModel) -> bool:
    """Whether the model's attention is plain softmax attention that the split reproduces."""
    config = model.config.get_text_config(decoder=True)
    return (model.config._attn_implementation in ("sdpa", "eager")
            and getattr(config, "attn_logit_softcapping", None) is None
            and not getattr(config, "use_sinks", False)
            and not any(hasattr(m, "sinks") for m in model.modules()))


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """PyTorch's fused attention kernels that also return the log-sum-exp, where one applies: the
    CPU flash kernel (any mask), and on CUDA without a mask the flash kernel (16-bit) or the
    memory-efficient one (fp32; its log-sum-exp is padded past the queries). None elsewhere."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~mask, float("-inf"))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                          scale=scale)
    if q.device.type == "cuda" and mask is None:
        if q.dtype in (torch.float16, torch.bfloat16):
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                                      scale=scale)[:2]
    return None


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scale, masked)·v and the log-sum-exp of each query's scores, [B, H, N, D] and
    [B, H, N] (fp32): a fused kernel where one runs, else the scores written out (exact either
    way). A query must see at least one key."""
    fused = _fused(q, k, v, mask, scale)
    if fused is not None:
        out, lse = fused
        return out, lse[..., :q.shape[-2]].float()
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v)
    return out, lse


def _prefix_part(q_RHLD: torch.Tensor, k_1KPD: torch.Tensor, v_1KPD: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's queries against the one stored prefix: the G = H / K query heads of each key
    head and the R rows folded into the query axis ([1, K, R·G·L, D]), then unfolded."""
    R, H, L, D = q_RHLD.shape
    K = k_1KPD.shape[1]
    G = H // K
    q_1KND = q_RHLD.view(R, K, G, L, D).transpose(0, 1).reshape(1, K, R * G * L, D)
    out_1KND, lse_1KN = attend_with_lse(q_1KND, k_1KPD, v_1KPD, None, scale)
    out_RHLD = out_1KND.view(K, R, G, L, D).transpose(0, 1).reshape(R, H, L, D)
    return out_RHLD, lse_1KN.view(K, R, G, L).transpose(0, 1).reshape(R, H, L)


def _repeat_heads(x_RKSD: torch.Tensor, G: int) -> torch.Tensor:
    """Each key head repeated for its G query heads (query head h reads key head h // G)."""
    return x_RKSD if G == 1 else x_RKSD.repeat_interleave(G, dim=1)


def shared_prefix_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function registered as `IMPLEMENTATION`: `key`/`value` are each row's own
    keys ([R, K, S, D]) under `attention_mask` ([R, 1, L, S] boolean), the prefix the layer's
    entry of the context variable. Returns [R, L, H, D] as the transformers attention functions do."""
    shared = _PREFIX.get()
    if shared is None:
        raise RuntimeError(f"{IMPLEMENTATION} attention runs only inside shared_prefix()")
    shared.seen.append(module.layer_idx)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    G = query.shape[1] // key.shape[1]
    out_a, lse_a = _prefix_part(query, shared.keys[module.layer_idx], shared.values[module.layer_idx], scale)
    out_b, lse_b = attend_with_lse(query, _repeat_heads(key, G), _repeat_heads(value, G), attention_mask, scale)
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    out = (w_a * out_a.float() + w_b * out_b.float()) / (w_a + w_b)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(IMPLEMENTATION, shared_prefix_attention)


@contextmanager
def shared_prefix(model: PreTrainedModel, keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...]
                  ) -> Iterator[None]:
    """Within the block (one forward), `model`'s attention layers also attend the stored prefix
    (per layer [1, K, P0, D]) for every row; the model's attention implementation is restored
    after. A forward in which not every layer attended the prefix once (a layer that reads
    another config than the model's) raises rather than return scores without it."""
    shared = _Shared(keys, values)
    token = _PREFIX.set(shared)
    before = model.config._attn_implementation
    model.config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        model.config._attn_implementation = before
        _PREFIX.reset(token)
    if sorted(shared.seen) != list(range(len(keys))):
        raise RuntimeError(f"the shared prefix was attended by layers {sorted(shared.seen)} of {len(keys)}")
