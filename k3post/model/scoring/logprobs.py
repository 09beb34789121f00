"""Token log-probabilities of completions, computed without materialising [N, V] at once.

Sequences are laid out right-padded, prompt then completion, so that no query row is fully
masked (left padding makes pad rows attend to nothing, which can put NaN in the activations
and, through `0 * NaN`, in the weight gradients). Completion token t of row b sits at column
`len(prompt_b) + t` and is predicted by the hidden state at the column before it.

The head is applied to chunks of positions under activation checkpointing: the peak holds one
chunk's logits instead of all of them, at the cost of recomputing the head matmul in backward.

Logits are the family's, not bare h·Wᵀ: Gemma's soft-cap and Granite's and Cohere's logit scales
(model/families.py) are applied to every chunk, so log π here equals log_softmax of the model's
own forward logits (what the sampler drew from; tests/unit/test_family_parity.py).

`bitwise` (sampling.on_policy: bitwise): the forward in the batch-invariant mode and the head row
by row through the sampler's own function (model/batch_invariant.py), so log π equals the sampler's
recorded log μ bit for bit; the gradient is still the chunked head's.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from k3post.model.batch_invariant import batch_invariant, exact_values, head_token_logprobs
from k3post.model.families import IDENTITY, LogitTransform, model_logit_transform

DEFAULT_CHUNK = 1024


def pack_sequences(prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor,
                   pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + completion` rows.

    Returns input_ids [B, L], attention_mask [B, L] and the column of each completion
    token's *predictor* (the position whose logits give its distribution), [B, T].
    """
    B, T = completion_ids_BT.shape
    lengths = [len(p) + int(m.sum().item()) for p, m in zip(prompt_ids, loss_mask_BT)]
    L = max(len(p) for p in prompt_ids) + T
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    for b, prompt in enumerate(prompt_ids):
        P = len(prompt)
        input_ids[b, :P] = torch.tensor(prompt, dtype=torch.long)
        input_ids[b, P:P + T] = completion_ids_BT[b]
        attention_mask[b, :lengths[b]] = 1
    starts_B = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    predictor_cols_BT = starts_B[:, None] - 1 + torch.arange(T)[None, :]
    return input_ids, attention_mask, predictor_cols_BT


def hidden_states(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states [B, L, H] (before the LM head)."""
    base = getattr(model, model.base_model_prefix)
    return base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature; at temperature 1 the logits themselves (x / 1 is x exactly, and a
    division would be one more pass over [N, V])."""
    return logits if temperature == 1.0 else logits / temperature


def _chunk_logprobs(h_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor,
                    temperature: float, transform: LogitTransform) -> torch.Tensor:
    logits_NV = scaled(transform((h_NH @ weight_VH.T).float()), temperature)
    return logits_NV.gather(-1, targets_N[:, None]).squeeze(-1) - torch.logsumexp(logits_NV, dim=-1)


@functools.cache
def _compiled_chunk_logprobs():
    """`_chunk_logprobs` through torch.compile: the fp32 cast, the logit transform and logsumexp
    become one pass over each chunk's [N, V] logits (and one in backward) instead of an eager
    kernel - and an fp32 copy - each; at a 152k vocabulary those passes are a large share of a
    small student's step. Dynamic shapes: the last chunk's length changes every step."""
    return torch.compile(_chunk_logprobs, dynamic=True)


def head_logprobs(h_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor, temperature: float = 1.0,
                  chunk: int = DEFAULT_CHUNK, transform: LogitTransform = IDENTITY, compiled: bool = False
                  ) -> torch.Tensor:
    """log softmax(f(h·Wᵀ) / temperature)[target] for N positions, `chunk` positions at a time
    (f: the family's logit transform, identity for most); `compiled`: each chunk compiled."""
    fn = _compiled_chunk_logprobs() if compiled else _chunk_logprobs
    pieces = []
    for start in range(0, h_NH.shape[0], chunk):
        args = (h_NH[start:start + chunk], weight_VH, targets_N[start:start + chunk], temperature, transform)
        if torch.is_grad_enabled() and (h_NH.requires_grad or weight_VH.requires_grad):
            pieces.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            pieces.append(fn(*args))
    return torch.cat(pieces) if pieces else h_NH.new_zeros(0)


def completion_logprobs(model: PreTrainedModel, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor,
                        loss_mask_BT: torch.Tensor, pad_id: int, temperature: float = 1.0,
                        chunk: int = DEFAULT_CHUNK, compiled: bool = False, bitwise: bool = False) -> torch.Tensor:
    """log π(y_t | s_t) of every completion token, [B, T] (0 where loss_mask is 0).

    Differentiable when grad is enabled (the learner); call under no_grad to score. `compiled`:
    the head's chunks through torch.compile (`train.compile`). `bitwise` (sampling.on_policy:
    bitwise): the forward in the batch-invariant mode and the head through the sampler's own
    function (`bitwise_head_logprobs`), so the values equal the sampler's log μ bit for bit.
    """
    device = model.get_output_embeddings().weight.device
    input_ids, attention_mask, cols_BT = (t.to(device) for t in pack_sequences(prompt_ids, completion_ids_BT.cpu(),
                                                                            loss_mask_BT.cpu(), pad_id))
    completion_ids_BT, loss_mask_BT = completion_ids_BT.to(device), loss_mask_BT.to(device)
    with batch_invariant(model) if bitwise else nullcontext():
        h_BLH = hidden_states(model, input_ids, attention_mask)
    rows_BT = torch.arange(h_BLH.shape[0], device=device)[:, None].expand_as(cols_BT)
    valid = loss_mask_BT.bool()
    h_NH = h_BLH[rows_BT[valid], cols_BT[valid]]
    weight = model.get_output_embeddings().weight
    if bitwise:
        values_N = bitwise_head_logprobs(model, h_NH, completion_ids_BT[valid], temperature, chunk)
    else:
        values_N = head_logprobs(h_NH, weight, completion_ids_BT[valid], temperature, chunk,
                                 model_logit_transform(model), compiled)
    out_BT = torch.zeros(loss_mask_BT.shape, dtype=values_N.dtype, device=values_N.device)
    return out_BT.masked_scatter(valid, values_N)


def bitwise_head_logprobs(model: PreTrainedModel, h_NH: torch.Tensor, targets_N: torch.Tensor, temperature: float,
                          chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """log softmax(h·Wᵀ / T)[y] with the values of model/batch_invariant.py's `head_token_logprobs`
    (row by row, as the sampler records log μ) and the gradient of `head_logprobs` (chunked).
    The batch-invariant mode covers families whose logits are h·Wᵀ (no logit transform)."""
    weight = model.get_output_embeddings().weight
    with batch_invariant(model):
        return exact_values(lambda h, w: head_logprobs(h, w, targets_N, temperature, chunk),
                            lambda h, w: head_token_logprobs(h, w, targets_N, temperature), h_NH, weight)


def completion_full_logprobs(model: PreTrainedModel, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor,
                             loss_mask_BT: torch.Tensor, pad_id: int, temperature: float = 1.0) -> torch.Tensor:
    """The whole next-token distribution at every completion position, [B, T, V] log-probs.

    Used for the exact KL in evaluation (under no_grad) and the full-vocab loss (with grad);
    padding positions hold the distribution at whatever column they point to: mask them.
    """
    h_BTH = completion_hidden_states(model, prompt_ids, completion_ids_BT, loss_mask_BT, pad_id)
    return hidden_full_logprobs(model, h_BTH, temperature)


def hidden_full_logprobs(model: PreTrainedModel, h_BTH: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(f(h Wᵀ) / temperature) over the vocabulary, [B, T, V] in float32 (f: the family's
    logit transform)."""
    logits_BTV = model_logit_transform(model)((h_BTH @ model.get_output_embeddings().weight.T).float())
    return F.log_softmax(scaled(logits_BTV, temperature), dim=-1)


def completion_logprobs_and_full(model: PreTrainedModel, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor,
                                 loss_mask_BT: torch.Tensor, pad_id: int, temperature: float = 1.0,
                                 bitwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_logprobs` and `completion_full_logprobs` from ONE decoder forward.

    The learner of a full-vocabulary or top-k loss needs both; calling the two functions runs the
    decoder twice over the same tokens (a third more work per step than forward + backward).
    Here the [B, T, V] distributions are `completion_full_logprobs`' exactly (same
    operations on the same hidden states), and the sampled tokens' logprobs are gathered from
    them: log_softmax(z)[y] instead of z[y] − logsumexp(z), equal up to float rounding
    (tests/unit/test_learner_one_forward.py). 0 where loss_mask is 0, as `completion_logprobs`.
    `bitwise`: as `completion_logprobs`' (the distributions from the same invariant hidden states).
    """
    with batch_invariant(model) if bitwise else nullcontext():
        h_BTH = completion_hidden_states(model, prompt_ids, completion_ids_BT, loss_mask_BT, pad_id)
    full_BTV = hidden_full_logprobs(model, h_BTH, temperature)
    ids_BT = completion_ids_BT.to(full_BTV.device)
    valid_BT = loss_mask_BT.to(full_BTV.device).bool()
    if bitwise:  # the sampled tokens' values as the sampler records them (`completion_logprobs`)
        picked_N = bitwise_head_logprobs(model, h_BTH[valid_BT], ids_BT[valid_BT], temperature)
        return torch.zeros(valid_BT.shape, dtype=picked_N.dtype, device=picked_N.device).masked_scatter(
            valid_BT, picked_N), full_BTV
    picked_BT = full_BTV.gather(-1, ids_BT.clamp(min=0)[..., None]).squeeze(-1)
    return torch.where(valid_BT, picked_BT, torch.zeros_like(picked_BT)), full_BTV


def completion_hidden_states(model: PreTrainedModel, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor,
                             loss_mask_BT: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The final hidden state (after the final norm, before the LM head) that predicts every
    completion token, [B, T, H]: the distribution there is log_softmax(f(h Wᵀ) / temperature), f the
    family's logit transform (model/families.py)."""
    device = model.get_output_embeddings().weight.device
    input_ids, attention_mask, cols_BT = (t.to(device) for t in pack_sequences(prompt_ids, completion_ids_BT.cpu(),
                                                                            loss_mask_BT.cpu(), pad_id))
    h_BLH = hidden_states(model, input_ids, attention_mask)
    rows_BT = torch.arange(h_BLH.shape[0], device=device)[:, None].expand_as(cols_BT)
    return h_BLH[rows_BT, cols_BT.clamp(max=h_BLH.shape[1] - 1)]
