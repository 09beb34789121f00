"""Batch-invariant forwards: the sampler's log μ(y_t) and the learner's log π(y_t) equal bit for bit.

Why they differ at all. The sampler records log μ(y_t) in its decode step (one new token per
row, keys and values from a cache, a batch of left-padded rows); the learner recomputes log π(y_t)
in one whole-sequence forward (right-padded rows, other rows beside them, micro-batches, a
chunked log-softmax). The weights are the same and so is the maths, but floating-point addition
is not associative: (a + b) + c ≠ a + (b + c) in the last bits. Every reduction (the dot products
of a matrix product, the mean of a norm, the sum of a softmax) rounds according to the order in
which it adds, and a kernel picks that order from the *shapes it is called with*:

- a matrix product [M, K]·[K, N] blocks K differently for M = 1 (a decode step: GEMV) and M = 800
  (a whole sequence: GEMM), and splits work between threads by M and N;
- a vectorised elementwise kernel (exp, tanh, cos, silu) runs the body of a tensor in SIMD lanes
  and its tail in scalar code, and the two can differ in the last bit: which elements fall in the
  tail depends on the tensor's total size, so on the batch and the padding;
- a reduction over a long row (the vocabulary's logsumexp) is split between threads when the
  output is a single row, and each thread's partial sum is added in another order;
- attention masks padding keys instead of removing them: a masked key is still a lane of the
  dot products and the softmax, so the valid keys sit in other lanes (and other blocks) with
  left padding than with right padding or none.

The result is a gap of ~1e-7 nats per token in fp32 on a CPU (1e-2 in bf16 on a GPU): small, but
an importance ratio that is not exactly 1, a drift figure that is never 0, and no way to tell a
numerical gap from a bug (a weight that did not arrive, a wrong temperature).

What this mode does. Inside `batch_invariant(model)` each token's values are computed by kernel
calls whose shapes and memory layout depend only on that token (and, for attention, on its own
valid keys), never on the batch, the padding, or how many positions one forward computes:

| piece            | override                                                                 | guarantee          |
|------------------|--------------------------------------------------------------------------|--------------------|
| every nn.Linear  | one call per fresh block of rows, `F.linear` on [R, K] (R: below)        | y_n depends on x_n |
| norms, MLPs      | the module's own forward on each fresh [R, H] block                      | same               |
| rotary embedding | cos/sin of each position computed alone, [1, 1] position at a time       | same per position  |
| attention        | per query: its valid keys *gathered* (padding sliced away, not masked),  | same per token and |
|                  | scores, fp32 softmax and values as [H, 1, S] products, S = its key count | its prefix         |
| output head      | `head_token_logprobs` / `token_logprobs`: one block of rows at a time,   | log μ == log π     |
|                  | z_y − logsumexp(z) of z = f(h·Wᵀ)/T, shared by sampler and learner       |                    |

and intra-op threads are pinned to 1 inside the mode, so that no kernel splits one row's work
between threads whose count differs between the sampler's process and the learner's. Every block
has R rows, the last one padded with zero rows, and is a fresh tensor (a clone): its memory is
aligned as any new tensor's, so a BLAS call always sees one shape at one alignment. With one
shape, a matrix product's K-loop adds a row's products in the same order wherever the row sits in
the block, and a reduction along a row (a norm's mean, the log-softmax) treats every row alike.
R is 1 or `CPU_ROWS` on a CPU (`_cpu_rows`: 16 where every width is divisible by 4, so that no
row meets an elementwise kernel's scalar tail) and `GPU_ROWS` on a GPU. Decode and prefill then
agree by induction: the embedding is a lookup; each layer's values of token t are the same calls
on the same inputs (its own row, and the keys and values of its own prefix, which the cache holds
exactly as the whole-sequence forward computed them); the same position ids (counted over real
tokens) give the same rotary angles.

Gradients. The learner differentiates through these values: `exact_values` returns the exact
(block-by-block) result as the value and takes its gradient from the ordinary batched computation,
recomputed in backward. The gradient is the usual one up to rounding; only the forward values,
which the importance ratio divides, are made batch-invariant.

On a GPU. The row-wise pieces take blocks of `GPU_ROWS` rows, so that cuBLAS and the reduction
kernels see one shape in every call and pick one kernel; attention is a Triton kernel with one
program per query and head walking its valid keys in fixed blocks (model/invariant_attention.py);
the rotary embedding is left as it is (one product per angle, elementwise cos/sin).

Cost. On a CPU, one thread, a call per 16-row block and a Python loop over the attention's
queries. On a GPU, the padding of the last block and one call per block (docs/on-policy.md has the
measured cost of both). Both HF samplers run in the mode (model/generation/sampling.py and
fast_sampling.py); vLLM's own batch-invariant mode is not covered.

Covered: the model families of `SUPPORTED` (decoder-only, RMSNorm, rotary positions with static
frequencies, softmax attention without dropout). Anything else is refused by `check_model`.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION = "k3post_batch_invariant"
GPU_ROWS = 256  # rows per call of a row-wise piece on a GPU: a whole number of any GEMM tile's rows
CPU_ROWS = 16  # on a CPU: one decode step's rows in one call, few calls for a whole sequence (`_cpu_rows`)
_CPU_ROWS: ContextVar[int] = ContextVar("k3post_cpu_rows", default=1)
_OPERANDS: ContextVar[dict | None] = ContextVar("k3post_quantised_operands", default=None)  # `_operands_shared`
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inverse frequencies that do not follow the sequence length


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A copy in new memory: contiguous and aligned like any new tensor, whatever x is a view of."""
    return x.clone(memory_format=torch.contiguous_format)


# -- values exact, gradients ordinary --

class _ExactValues(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fast, exact, *tensors):
        ctx.fast, ctx.tensors = fast, tensors
        return exact(*tensors)

    @staticmethod
    def backward(ctx, grad):
        # Parameters (leaves) are used as they are, so that a `fast` that reads a module's own
        # parameters gets their gradients; every other input is differentiated as a new leaf.
        inputs = [t if t.is_leaf else t.detach().requires_grad_(t.requires_grad) for t in ctx.tensors]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.fast(*inputs)
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True)) if wanted else iter(())
        return (None, None, *[next(found) if t.requires_grad else None for t in inputs])


def exact_values(fast: Callable[..., torch.Tensor], exact: Callable[..., torch.Tensor],
                 *tensors: torch.Tensor) -> torch.Tensor:
    """exact(*tensors) as the value; the gradient is fast's (the same function computed the usual
    way, recomputed in backward). Without gradients, just exact(*tensors)."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        with torch.no_grad():
            return exact(*tensors)
    return _ExactValues.apply(fast, exact, *tensors)


# -- row-by-row pieces --

def rows_per_call(device: torch.device) -> int:
    """How many rows each call of a row-wise piece takes: `GPU_ROWS` on a GPU; on a CPU
    `CPU_ROWS` inside the mode for a model whose widths allow it (`_cpu_rows`), else 1."""
    return GPU_ROWS if device.type == "cuda" else _CPU_ROWS.get()


def _cpu_rows(model: nn.Module) -> int:
    """`CPU_ROWS` when every Linear's input and output width is a multiple of 4, else 1.

    A CPU's elementwise kernels run a contiguous tensor as one flat loop in SIMD vectors of up to
    64 bytes, and its scalar tail (the last elements, when the size is not a whole number of
    vectors) may round differently. A block of 16 rows of a width divisible by 4 holds a multiple
    of 64 elements, a whole number of vectors of any width: no element, in any row, falls in a
    tail. The matrix products and the per-row reductions (a norm's mean, the log-softmax) treat
    every row of a fixed-shape block alike with one thread: measured, a row gives the same bits
    at every position of the block beside any other rows (tests/unit/test_batch_invariant.py)."""
    widths = {d for m in model.modules() if isinstance(m, nn.Linear) for d in (m.in_features, m.out_features)}
    return CPU_ROWS if all(w % 4 == 0 for w in widths) else 1


def row_blocks(x: torch.Tensor) -> Iterator[torch.Tensor]:
    """The rows of a 2-D x in fresh [R, H] blocks, R = `rows_per_call`, the last one padded with
    zero rows: every call of a piece then sees the one shape (and the same alignment). An x that
    is one such block already (an enclosing module's block, or a new tensor made from one: R rows,
    contiguous, at the start of its memory) is used as it is: a copy would be the same bits at the
    same alignment."""
    rows = rows_per_call(x.device)
    if x.shape[0] == rows and x.is_contiguous() and x.storage_offset() == 0:
        yield x
        return
    for start in range(0, x.shape[0], rows):
        block = x[start:start + rows]
        if block.shape[0] < rows:  # the concatenation is a new tensor already
            yield torch.cat([block, block.new_zeros(rows - block.shape[0], *block.shape[1:])])
        else:
            yield _fresh(block)


def each_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn applied to every row of x (all dimensions but the last flattened), in fresh blocks of
    `rows_per_call` rows (`row_blocks`): the call, and so its reduction order and SIMD lanes, is
    the same for every row, wherever the row sits in the batch."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        return fn(flat).reshape(*x.shape[:-1], -1)
    out = torch.cat([fn(block) for block in row_blocks(flat)])[:flat.shape[0]]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def product_rows(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A matrix product's rows, in fixed blocks (`each_row`): every Linear of the mode goes through
    here. A GEMM whose reduction order does not follow the row count could take all rows in one
    call instead (bench/learner/mode_variants_gpu.py tries that on a GPU)."""
    return each_row(product, x)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·Wᵀ + b, each row alone (no gradient: see `exact_values`)."""
    return product_rows(lambda row: F.linear(row, weight, bias), x)


def token_logprobs(logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(z / T)[y] of each row, z = the row's logits in fp32: z_y/T − logsumexp(z/T), one
    fresh [1, V] row at a time. The sampler applies it to the logits its forward returned, the
    learner (`head_token_logprobs`) to the logits of the same hidden state: the one function on
    identical logits."""
    out = []
    for z, targets in zip(row_blocks(logits_NV), row_blocks(targets_N[:, None])):
        z = z.float()
        if temperature != 1.0:
            z = z / temperature
        out.append(z.gather(1, targets)[:, 0] - torch.logsumexp(z, dim=-1))
    return torch.cat(out)[:logits_NV.shape[0]] if out else logits_NV.new_empty(0, dtype=torch.float32)


def head_token_logprobs(h_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor,
                        temperature: float) -> torch.Tensor:
    """log softmax(h·Wᵀ / T)[y] per position: the head's logits of each row exactly as the model's
    own (patched) output Linear computes them, then `token_logprobs`. No [N, V] block is held."""
    rows = rows_per_call(h_NH.device)
    out = [token_logprobs(linear_rows(h_NH[n:n + rows], weight_VH), targets_N[n:n + rows], temperature)
           for n in range(0, h_NH.shape[0], rows)]
    return torch.cat(out) if out else h_NH.new_empty(0, dtype=torch.float32)


# -- attention: each query over exactly its valid keys --

def _valid_keys(mask: torch.Tensor | None, B: int, L: int, S: int) -> torch.Tensor:
    """[B, L, S] booleans, True where query l of row b attends to key s (no mask: causal, the
    queries being the last L of the S positions)."""
    if mask is None:
        return torch.ones(L, S, dtype=torch.bool).tril(S - L).expand(B, L, S)
    mask = mask if mask.dtype == torch.bool else mask == 0
    return mask[:, 0].expand(B, L, S)  # on the model's device: the CPU reference and the GPU kernel each read it there


def query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid_BLS: torch.Tensor,
                    groups: int, scaling: float) -> torch.Tensor:
    """softmax(q·Kᵀ·scaling)·V for every query over exactly its valid keys, gathered in order:
    [B, L, H, D] (a query with no valid key, a padding row, gets zeros). query [B, H, L, D];
    key, value [B, H_kv, S, D]; a key head serves `groups` query heads."""
    B, H, L, D = query.shape
    out = query.new_zeros(B, L, H, D)
    for b in range(B):
        for q in range(L):
            keys = valid_BLS[b, q].nonzero().squeeze(-1).to(key.device)
            if keys.numel() == 0:
                continue
            k_HSD = _fresh(key[b][:, keys].repeat_interleave(groups, dim=0))
            v_HSD = _fresh(value[b][:, keys].repeat_interleave(groups, dim=0))
            scores_H1S = torch.bmm(_fresh(query[b, :, q:q + 1]), k_HSD.transpose(1, 2)) * scaling
            probs_H1S = F.softmax(scores_H1S, dim=-1, dtype=torch.float32).to(query.dtype)
            out[b, q] = torch.bmm(probs_H1S, v_HSD)[:, 0]
    return out


def batched_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid_BLS: torch.Tensor,
                      groups: int, scaling: float) -> torch.Tensor:
    """The same attention the usual batched way (masked keys), for gradients: [B, L, H, D]. A
    query with no valid key gets zeros here too (and finite gradients)."""
    valid = valid_BLS.to(query.device)[:, None]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling
    scores = scores.float().masked_fill(~valid, torch.finfo(torch.float32).min)
    probs = (F.softmax(scores, dim=-1) * valid.any(-1, keepdim=True)).to(query.dtype)
    return torch.matmul(probs, v).transpose(1, 2)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function the mode registers (transformers' AttentionInterface)."""
    if dropout:
        raise ValueError("the batch-invariant mode computes attention without dropout (attention_dropout 0)")
    B, H, L, D = query.shape
    valid_BLS = _valid_keys(attention_mask, B, L, key.shape[2])
    groups = H // key.shape[1]
    scale = D ** -0.5 if scaling is None else scaling
    if query.is_cuda:  # one Triton program per query and head (model/invariant_attention.py)
        from k3post.model.invariant_attention import kernel_attention as exact
    else:
        exact = query_attention
    out = exact_values(lambda q, k, v: batched_attention(q, k, v, valid_BLS, groups, scale),
                       lambda q, k, v: exact(q, k, v, valid_BLS, groups, scale), query, key, value)
    return out, None


def _materialized_mask(*args, **kwargs):
    """sdpa's boolean mask, always built: the attention needs every query's valid keys (sdpa may
    otherwise return None for a plain causal batch and rely on its own is_causal)."""
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


AttentionInterface.register(ATTENTION, _attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _materialized_mask)


# -- the mode --

def unsupported(model: nn.Module) -> str | None:
    """Why the mode cannot make `model`'s forward batch-invariant (None when it can)."""
    config = model.config
    if config.model_type not in SUPPORTED:
        return f"model_type {config.model_type!r} (covered: {', '.join(SUPPORTED)})"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rotary scaling {rope!r}, whose frequencies follow the sequence length (covered: {STATIC_ROPE})"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    return None


def _positions(original: Callable) -> Callable:
    """A rotary embedding's forward, each distinct position's cos/sin computed alone."""
    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, index = position_ids.unique(return_inverse=True)
        cos, sin = zip(*(original(x, values[i:i + 1].reshape(1, 1)) for i in range(len(values))))
        cos, sin = torch.cat(cos)[:, 0], torch.cat(sin)[:, 0]  # [U, D]
        return cos[index], sin[index]
    return forward


def _rows_of(module: nn.Module, original: Callable) -> Callable:
    """A token-wise module's forward (norm, MLP) computed one block of rows at a time; the
    quantised weights of the Linears inside are formed once for all the blocks (`_operands_shared`)."""
    params = [p for p in module.parameters()]

    def exact(x: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        with _operands_shared():
            return each_row(original, x)
    return lambda x: exact_values(lambda x_, *_: original(x_), exact, x, *params)


@contextmanager
def _operands_shared() -> Iterator[None]:
    """Inside: each fake-quantised Linear forms its quantised weight once and reuses it, instead of
    once per block of rows that an enclosing module (an MLP) passes it. The weight does not change
    within one forward call, so the values are the same; the memo goes with the call (it holds one
    MLP's quantised weights, never the model's)."""
    token = _OPERANDS.set({})
    try:
        yield
    finally:
        _OPERANDS.reset(token)


def _linear(module: nn.Linear) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        tensors = (x, module.weight) + ((module.bias,) if module.bias is not None else ())
        return exact_values(F.linear, linear_rows, *tensors)
    return forward


def _fake_quantised_linear(module: nn.Linear) -> Callable:
    """A fake-quantised Linear (torchao's FakeQuantizedLinear of model/quant/qat.py, the learner's
    under QAT, or the sampler's Fp8Linear of model/quant/fp8_linear.py in either form): x̃·W̃ᵀ + b
    with each row alone. Both quantisations are row-local already: W̃ is the same in every call, and
    x̃ takes one scale per token, from the row's amax (a max, exact in any order), then rounds each
    element alone. So only the product needs the rows alone, and both sides form it from equal
    operands: the sampler's dequantised e4m3 weight is the learner's fake-quantised one bit for bit,
    its per-token input grid torchao's. The gradient is the layer's own forward's (the
    straight-through estimator of model/quant/qat.py)."""
    own = type(module).forward

    def form() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
        if getattr(module, "holds_fp8", False):
            return module.quantise_input, module.dequantised_weight()
        act, weight_q = module.activation_fake_quantizer, module.weight_fake_quantizer
        return (act or (lambda t: t)), (module.weight if weight_q is None else weight_q(module.weight))

    def quantised() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
        memo = _OPERANDS.get()
        if memo is None:
            return form()
        if module not in memo:
            memo[module] = form()
        return memo[module]

    def exact(x: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        # The input grid is row-local (a max and correctly rounded elementwise steps), so it is
        # formed over all rows at once; only the product needs the rows in fixed blocks.
        quantise, weight = quantised()
        return product_rows(lambda row: F.linear(row, weight, module.bias), quantise(x))

    params = [p for p in (module.weight, module.bias) if p is not None]
    return lambda x: exact_values(lambda x_, *_: own(module, x_), exact, x, *params)


def _override(module: nn.Module, on_gpu: bool) -> Callable | None:
    """The batch-invariant forward of a module the mode replaces, None for one it leaves (its
    children are replaced instead, or it is exact as it is: an embedding is a lookup). On a GPU
    the rotary embedding is exact as it is: each angle is one product, position × frequency
    (a matrix product over a dimension of 1), and cos and sin are elementwise kernels whose
    arithmetic does not depend on where an element sits (no vector body and scalar tail)."""
    name = type(module).__name__
    if isinstance(module, nn.Linear):
        return _fake_quantised_linear(module) if hasattr(module, "weight_fake_quantizer") else _linear(module)
    if name.endswith(("RMSNorm", "MLP")) or isinstance(module, nn.LayerNorm):
        return _rows_of(module, module.forward)
    if name.endswith("RotaryEmbedding") and not on_gpu:
        return _positions(module.forward)
    return None


@contextmanager
def batch_invariant(model: nn.Module) -> Iterator[None]:
    """Inside: `model`'s forward is batch-invariant (module docstring), with one intra-op thread;
    everything is restored on the way out. Raises ValueError for a model it does not cover."""
    why = unsupported(model)
    if why is not None:
        raise ValueError(f"the batch-invariant mode does not cover this model: {why}")
    on_gpu = next(model.parameters()).is_cuda
    replaced = [(m, m.__dict__.get("forward"), forward) for m in model.modules()
                if (forward := _override(m, on_gpu)) is not None]
    saved_attention, threads = model.config._attn_implementation, torch.get_num_threads()
    rows = _CPU_ROWS.set(_cpu_rows(model))
    try:
        for module, _, forward in replaced:
            module.forward = forward
        model.config._attn_implementation = ATTENTION
        torch.set_num_threads(1)
        yield
    finally:
        _CPU_ROWS.reset(rows)
        torch.set_num_threads(threads)
        model.config._attn_implementation = saved_attention
        for module, own, _ in replaced:
            if own is None:
                del module.forward
            else:
                module.forward = own
