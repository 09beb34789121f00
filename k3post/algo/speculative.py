"""Exact speculative sampling: a cheap draft proposes K tokens, the student verifies them in one
forward, and the tokens that come out are distributed exactly as the student's own samples.

The rule (Leviathan, Kalman & Matias 2023; Chen et al. 2023). At a prefix s the draft proposes
x_1 ~ q_1(· | s), x_2 ~ q_2(· | s, x_1), ..., x_K; one student forward over s, x_1..x_K gives the
target conditionals p_1, ..., p_{K+1} at every drafted position and one past it. Then, for
i = 1..K in order: accept x_i with probability a_i = min(1, p_i(x_i) / q_i(x_i)); at the first
rejection emit a token drawn from the residual r_i = norm(max(0, p_i − q_i)) and stop; if all K
are accepted, emit a bonus token drawn from p_{K+1}. A round emits between 1 and K + 1 tokens.

Why the output is distributed as p (one position). P(emit v) = P(draft v, accept) + P(reject) r(v).
The first term is q(v) min(1, p(v)/q(v)) = min(p(v), q(v)). The rejection probability is
1 − Σ_x min(p(x), q(x)) = Σ_x max(0, p(x) − q(x)), exactly r's normaliser, so the second term is
max(0, p(v) − q(v)) = p(v) − min(p(v), q(v)). The sum is p(v), whatever q is.
Several positions: position i is looked at only when x_1..x_{i−1} were all accepted, i.e. when the
emitted prefix is the drafted one, and there q_i and p_i are conditionals given that same prefix; so
every emitted token, given all tokens emitted before it, is distributed as the student's
conditional, and the bonus is the plain draw from p_{K+1} given K accepted tokens. The chain rule
makes the joint distribution of the emitted tokens the student's product of conditionals. Drafted
tokens after a rejection are thrown away (they were conditioned on a token not emitted), and the
caches roll back to the last emitted token. Stopping early (EOS, a token budget) only truncates.

Edge cases fall out of the same two lines: q(v) = 0 < p(v) is never drafted and comes only from the
residual (max(0, p − 0) = p); p(v) = 0 < q(v) is drafted but never accepted (a = 0); p = q accepts
everything (the residual then has zero mass and is never drawn; `residual_probs` returns p so that
nothing divides by zero). What is preserved is the p the verifier uses: temperature and top-p must be
applied to p exactly as the plain sampler applies them (algo/token_draws.py: `sampling_probs`), and
q must be the distribution the draft tokens were really drawn from.

Every function takes probabilities and returns probabilities or branch weights; the only random
steps (which count of tokens is accepted, which next token is drawn) are two categorical draws in
`verify_draft`. tests/unit/test_speculative_exact.py replaces those draws by weighted branches and
enumerates every branch on toy tables, driving these same functions, to check the joint
distribution to 1e-12.
"""

from __future__ import annotations

import torch

from k3post.algo.token_draws import draw


def acceptance_probs(p_BKV: torch.Tensor, q_BKV: torch.Tensor, draft_BK: torch.Tensor) -> torch.Tensor:
    """a_i = min(1, p_i(x_i) / q_i(x_i)) per drafted token, [B, K]; 0 where q_i(x_i) = 0 (such a token
    is never drafted, so the value only has to be finite)."""
    p_BK = p_BKV.gather(-1, draft_BK[..., None]).squeeze(-1)
    q_BK = q_BKV.gather(-1, draft_BK[..., None]).squeeze(-1)
    ratio_BK = p_BK / torch.where(q_BK > 0, q_BK, torch.ones_like(q_BK))
    return torch.where(q_BK > 0, ratio_BK.clamp(max=1.0), torch.zeros_like(q_BK))


def accept_count_probs(a_BK: torch.Tensor) -> torch.Tensor:
    """P(exactly n of the K drafted tokens are accepted), n = 0..K, [B, K + 1].

    Tokens are tested in order and the first rejection ends the round, so
    P(n) = a_1 ... a_n (1 − a_{n+1}) for n < K and P(K) = a_1 ... a_K: the same law as K
    sequential coins, drawn here as one categorical."""
    ones_B1 = torch.ones_like(a_BK[:, :1])
    reached_BK1 = torch.cumprod(torch.cat([ones_B1, a_BK], dim=1), dim=1)  # P(first n accepted)
    stop_BK1 = torch.cat([1.0 - a_BK, ones_B1], dim=1)  # P(the round stops right after n accepted)
    return reached_BK1 * stop_BK1


def residual_probs(p_BV: torch.Tensor, q_BV: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)): what a rejection draws from. Where p ≤ q everywhere (p = q) the mass is
    zero and a rejection has probability zero; p is returned there so nothing divides by zero."""
    excess_BV = (p_BV - q_BV).clamp(min=0.0)
    total_B1 = excess_BV.sum(dim=-1, keepdim=True)
    safe_B1 = torch.where(total_B1 > 0, total_B1, torch.ones_like(total_B1))
    return torch.where(total_B1 > 0, excess_BV / safe_B1, p_BV)


def next_token_probs(p_BK1V: torch.Tensor, q_BKV: torch.Tensor, accepted_B: torch.Tensor) -> torch.Tensor:
    """What the round's last token is drawn from, [B, V]: the residual at the first rejected position
    (n < K), or the bonus p_{K+1} after K acceptances, which is the residual against an empty draft
    (q = 0 past the draft)."""
    q_BK1V = torch.cat([q_BKV, torch.zeros_like(q_BKV[:, :1])], dim=1)
    at_B11 = accepted_B[:, None, None]
    p_BV = p_BK1V.gather(1, at_B11.expand(-1, 1, p_BK1V.shape[-1])).squeeze(1)
    q_BV = q_BK1V.gather(1, at_B11.expand(-1, 1, q_BK1V.shape[-1])).squeeze(1)
    return residual_probs(p_BV, q_BV)


def verify_draft(p_BK1V: torch.Tensor, q_BKV: torch.Tensor, draft_BK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One round's random steps, per row: (n accepted drafted tokens [B], the token emitted after
    them [B]). The row emits draft[:n] then that token. p holds the student's sampling
    distributions at the K + 1 positions (`sampling_probs` of its logits), q the draft's at K."""
    counts_BK1 = accept_count_probs(acceptance_probs(p_BK1V[:, :-1], q_BKV, draft_BK))
    accepted_B = draw(counts_BK1)
    return accepted_B, draw(next_token_probs(p_BK1V, q_BKV, accepted_B))
