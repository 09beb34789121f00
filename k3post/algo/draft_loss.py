"""What a draft head learns, and how well it will be accepted.

Speculative sampling accepts a drafted token with probability min(1, p(x)/q(x)), so one drafted
position is accepted with probability

    α = Σ_x q(x) min(1, p(x)/q(x)) = Σ_v min(p(v), q(v)) = 1 − TV(p, q)

(algo/speculative.py). The draft must therefore match the *student's* distribution p (which
draws the rollouts), not the teacher's nor the data's tokens: it learns by the soft cross-entropy
against the student's own detached distribution,

    L(q) = −Σ_v p(v) log q(v) = H(p) + KL(p ‖ q),

whose gradient w.r.t. the draft's logits is q − p (zero exactly at q = p, where α = 1). Both are
taken at the sampling temperature, the distribution the draft will be verified against.
"""

from __future__ import annotations

import torch


def soft_cross_entropy(draft_logits_NV: torch.Tensor, target_logits_NV: torch.Tensor, temperature: float
                       ) -> torch.Tensor:
    """Σ over positions of −Σ_v p(v) log q(v), p = softmax(target / T) (no gradient), q = softmax(draft / T)."""
    p_NV = torch.softmax(target_logits_NV.detach().float() / temperature, dim=-1)
    log_q_NV = torch.log_softmax(draft_logits_NV.float() / temperature, dim=-1)
    return -(p_NV * log_q_NV).sum()


def acceptance_sum(draft_logits_NV: torch.Tensor, target_logits_NV: torch.Tensor, temperature: float
                   ) -> torch.Tensor:
    """Σ over positions of α = Σ_v min(p(v), q(v)): the expected accepted share of one drafted token each."""
    p_NV = torch.softmax(target_logits_NV.detach().float() / temperature, dim=-1)
    q_NV = torch.softmax(draft_logits_NV.detach().float() / temperature, dim=-1)
    return torch.minimum(p_NV, q_NV).sum()
