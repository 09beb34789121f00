"""Attention on a GPU whose every query is reduced alone, in one fixed order (the batch-invariant mode).

The mode (model/batch_invariant.py) needs each query's attention output to depend only on that
query and the keys and values it may see: not on the batch, the padding, the sequence length, or
whether the forward is a decode step (one query against a cache) or a whole sequence (every query
at once, causally). A fused attention kernel does not promise this: it tiles the queries and keys
by the shapes it is given and may split the keys of one query between thread blocks.

This kernel runs one program per (query, head). A query's valid keys are listed in order
(`key_order`: the positions its mask allows, padding removed, whatever the side or amount of
padding), and the program walks them in blocks of `BLOCK` from the first, keeping the online
softmax of FlashAttention in fp32:

    for each block j of its keys:   s_j = (q · k_j) · scale           (masked past the last key: −∞)
                                    m'  = max(m, max s_j)
                                    ℓ   = ℓ·e^(m − m') + Σ e^(s_j − m')
                                    acc = acc·e^(m − m') + Σ e^(s_j − m') · v_j
    out = acc / ℓ                   (0 for a query with no valid key: a padding row)

The j-th block of a query is the same keys in every call, and the program's arithmetic depends
only on the compile-time block sizes, so the same query over the same keys gives the same bits in
a decode step and in a whole-sequence forward. Integer arguments are not specialised on their
values (`do_not_specialize`), so every call runs the one compiled program whatever the shapes.

Forward values only: the learner's gradient comes from the ordinary batched attention
(`exact_values`). On a CPU the mode uses `batch_invariant.query_attention` instead; this kernel
runs there only under Triton's interpreter (TRITON_INTERPRET=1), for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 32  # keys per step of a query's walk


@triton.jit(do_not_specialize=["L", "S", "H", "groups", "stride_qb", "stride_qh", "stride_ql", "stride_kb",
                               "stride_kh", "stride_ks", "stride_ob", "stride_ol", "stride_oh"])
def _attend(q_ptr, k_ptr, v_ptr, order_ptr, count_ptr, out_ptr, L, S, H, groups, scale,
            stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_ks, stride_ob, stride_ol, stride_oh,
            D: tl.constexpr, BLOCK: tl.constexpr):
    row, h = tl.program_id(0), tl.program_id(1)  # row = b * L + l
    b, l = row // L, row % L
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + l * stride_ql + d).to(tl.float32)
    n = tl.load(count_ptr + row)
    k_base = k_ptr + b * stride_kb + (h // groups) * stride_kh
    v_base = v_ptr + b * stride_kb + (h // groups) * stride_kh
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for start in range(0, n, BLOCK):
        j = start + tl.arange(0, BLOCK)
        inside = j < n
        pos = tl.load(order_ptr + row * S + j, mask=inside, other=0)
        k = tl.load(k_base + pos[:, None] * stride_ks + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
        s = tl.where(inside, tl.sum(q[None, :] * k, axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_base + pos[:, None] * stride_ks + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + l * stride_ol + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def key_order(valid_BLS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's valid key positions in order, then the rest ([B, L, S] int32), and how many are
    valid ([B, L] int32). A stable sort of "not valid" puts the valid positions first, ascending."""
    order = torch.sort((~valid_BLS).to(torch.uint8), dim=-1, stable=True).indices
    return order.to(torch.int32).contiguous(), valid_BLS.sum(-1).to(torch.int32).contiguous()


def kernel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid_BLS: torch.Tensor,
                     groups: int, scaling: float) -> torch.Tensor:
    """softmax(q·Kᵀ·scaling)·V of every query over exactly its valid keys: [B, L, H, D] in the query's
    dtype. query [B, H, L, D]; key, value [B, H_kv, S, D]; a key head serves `groups` query heads."""
    B, H, L, D = query.shape
    S = key.shape[2]
    if D & (D - 1):
        raise ValueError(f"the batch-invariant attention kernel takes power-of-two head sizes, not {D}")
    order, count = key_order(valid_BLS.to(query.device))
    q, k, v = (t.contiguous() for t in (query, key, value))
    out = query.new_empty(B, L, H, D)
    _attend[(B * L, H)](q, k, v, order, count, out, L, S, H, groups, scaling,
                        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                        out.stride(0), out.stride(1), out.stride(2), D=D, BLOCK=BLOCK)
    return out
