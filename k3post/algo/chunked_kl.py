"""The exact reverse KL to a teacher that sent its final hidden states instead of its distributions.

A teacher's next-token distribution is log π_T = z − logsumexp(z) with logits z = h Wᵀ / τ (h its
final hidden state after the final norm, W [V, H] its output head, τ its temperature). Sending h
costs H floats a position instead of V (576 vs 49,152 for SmolLM2; 5,120 vs 151,936 for a Qwen
32B: 30-85× fewer bytes), and W travels once per run (teachers are frozen). The learner then needs
log π_T without ever holding [B, T, V] teacher logits. The reverse KL splits as

    KL(π_S‖π_T) = Σ_v p_S(v) log p_S(v)  −  Σ_v p_S(v) z_v  +  logsumexp_v z_v          (Σ_v p_S = 1)

and each vocabulary sum runs over chunks of C ids: pass 1 the teacher's logsumexp (a running
logaddexp over chunks; no gradient, the teacher is fixed), pass 2 the cross term Σ p_S z, each chunk
under activation checkpointing so backward recomputes z_chunk instead of keeping all of them
(its gradient w.r.t. log p_S(v) is p_S(v) z_v). The peak holds one [B, T, C] chunk of teacher logits.
The value and its gradient equal the full-vocabulary formula (opd.kl_divergence on log_softmax(z))
up to rounding, for chunks smaller than, not dividing and larger than V
(tests/unit/test_per_teacher_opd.py, test_the_chunked_kl_equals_the_full_vocabulary_kl_values_and_gradients);
from each model family's own hidden states and output head it is 0 at equal weights
(tests/unit/test_family_parity.py, check_hidden_state_head).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_VOCAB_CHUNK = 8192


def _logits(hidden_BTH: torch.Tensor, head_CH: torch.Tensor, temperature: float) -> torch.Tensor:
    """h Wᵀ / τ for one chunk of ids, in at least float32 (bf16 logits would round the KL)."""
    z = hidden_BTH @ head_CH.T
    return z.to(torch.promote_types(z.dtype, torch.float32)) / temperature


def teacher_logsumexp(hidden_BTH: torch.Tensor, head_VH: torch.Tensor, temperature: float,
                      chunk: int = DEFAULT_VOCAB_CHUNK) -> torch.Tensor:
    """logsumexp_v (h Wᵀ / τ)_v, [B, T], one chunk of the vocabulary at a time."""
    with torch.no_grad():
        lse_BT = None
        for start in range(0, head_VH.shape[0], chunk):
            z_BTC = _logits(hidden_BTH, head_VH[start:start + chunk], temperature)
            part_BT = torch.logsumexp(z_BTC, dim=-1)
            lse_BT = part_BT if lse_BT is None else torch.logaddexp(lse_BT, part_BT)
    return lse_BT


def _cross_chunk(student_logprobs_BTC: torch.Tensor, hidden_BTH: torch.Tensor, head_CH: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    z_BTC = _logits(hidden_BTH, head_CH, temperature)
    return (student_logprobs_BTC.exp() * z_BTC).sum(dim=-1)


def chunked_reverse_kl(student_logprobs_BTV: torch.Tensor, hidden_BTH: torch.Tensor, head_VH: torch.Tensor,
                       temperature: float = 1.0, chunk: int = DEFAULT_VOCAB_CHUNK) -> torch.Tensor:
    """KL(π_S‖π_T) at every position, [B, T], differentiable w.r.t. the student's logprobs; the
    teacher (hidden states and head) is a constant."""
    hidden_BTH, head_VH = hidden_BTH.detach(), head_VH.detach()
    p_BTV = student_logprobs_BTV.exp()
    # p log p with the 0·log 0 = 0 limit (a −inf student logprob would give 0·(−inf) = nan).
    finite = torch.isfinite(student_logprobs_BTV)
    safe = torch.where(finite, student_logprobs_BTV, torch.zeros_like(student_logprobs_BTV))
    neg_entropy_BT = torch.where(finite, p_BTV * safe, torch.zeros_like(safe)).sum(dim=-1)
    cross_BT = torch.zeros_like(neg_entropy_BT)
    for start in range(0, head_VH.shape[0], chunk):
        args = (student_logprobs_BTV[..., start:start + chunk], hidden_BTH, head_VH[start:start + chunk], temperature)
        if torch.is_grad_enabled() and student_logprobs_BTV.requires_grad:
            cross_BT = cross_BT + checkpoint(_cross_chunk, *args, use_reentrant=False)
        else:
            cross_BT = cross_BT + _cross_chunk(*args)
    return neg_entropy_BT - cross_BT + teacher_logsumexp(hidden_BTH, head_VH, temperature, chunk)
