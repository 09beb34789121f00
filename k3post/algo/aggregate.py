"""Reducing per-token quantities to scalars, and the micro-batch normalisation pitfall.

All reductions select masked-in entries with `torch.where` before multiplying by the mask, so
a `nan`/`inf` sitting at a padding position (a logprob of a pad token, say) never leaks into the
result: `nan * 0` is `nan`, but `where(mask != 0, nan, 0)` is `0`.

The pitfall (TRL #4719, OpenRLHF `aggregate_loss`). An optimizer step often runs as several
micro-batches whose gradients are accumulated. The quantity we mean to minimise is the token
mean over the whole step,

    L = (1/N) Σ_{i,t} m_{it} ℓ_{it},      N = Σ_{i,t} m_{it}   (all micro-batches together).

Averaging inside each micro-batch k (token count N_k) and then averaging the K micro-batches
gives Σ_k (1/(K N_k)) Σ_{t∈k} m ℓ instead: each token is weighted 1/(K N_k), which equals 1/N
only when every micro-batch has the same number of tokens. With ragged completions the short
micro-batches are over-weighted. Dividing every micro-batch's masked *sum* by the global N
(`token_sum_normalized`) makes the summed micro-batch losses -- and so their summed
gradients -- exactly L and ∇L, whatever the split.
"""

from __future__ import annotations

import torch


def masked_sum(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Σ_{b,t} m_{bt} x_{bt}, a scalar; entries with m = 0 are ignored even if not finite."""
    # where() first so non-finite padding cannot become nan; the product keeps fractional weights.
    selected_BT = torch.where(mask_BT != 0, x_BT, torch.zeros_like(x_BT))
    return (selected_BT * mask_BT).sum()


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Σ m x / Σ m, a scalar; 0 (with a zero, finite gradient) when the mask is all zero."""
    denom = mask_BT.sum()
    # Dividing by a safe denominator, not where(denom > 0, num / denom, 0): the unselected
    # 0/0 branch would still put nan into the backward pass.
    safe_denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    return masked_sum(x_BT, mask_BT) / safe_denom


def token_sum_normalized(loss_BT: torch.Tensor, loss_mask_BT: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """Σ_{b,t} m_{bt} loss_{bt} / num_tokens, with num_tokens the GLOBAL token count of the step.

    Call it on every micro-batch with the same `num_tokens` = Σ m over all micro-batches of the
    optimizer step; then Σ_k token_sum_normalized(micro-batch k) = the token mean of the full
    batch, and accumulated gradients equal the full-batch gradient (module docstring).
    """
    if not num_tokens > 0:
        raise ValueError(f"num_tokens must be positive (the step's total loss-mask count), got {num_tokens}")
    return masked_sum(loss_BT, loss_mask_BT) / num_tokens
