"""Speculative rollouts on transformers: the MTP head drafts K tokens, one student forward verifies
them, and the rule of algo/speculative.py keeps the samples distributed exactly as plain sampling's.

The layout: columns, the same for every row. The prompts are left-padded (as `generate` lays
them out). Every round appends K + 1 columns to every row: the pending token y (drawn last round)
and the drafts d_1..d_K. Of these, y and the n accepted drafts are real; the K − n rejected ones
become holes: their keys and values stay in the KV cache but the attention mask is 0 there for
ever after, and position ids count real tokens only. That is the rollback: rows accept different
counts, yet share one cache of one length (a DynamicCache grown by K + 1 per round), and a hole is
invisible to every later query, so each row computes exactly what it would alone.

The head (model/generation/draft_head.py) keeps its own KV cache over the same columns. At a round's start
it is fed the last round's block with the student's real hidden states (h_t with the next real
token after t); its output at the row's last real column drafts d_1. Drafts 2..K chain its own
output in place of the student's hidden state; those entries are speculative and cropped away
before the next block is fed.

What is recorded. Each emitted token's logprob is the student's log_softmax(logits / T) at the
position that predicts it (from the verify forward, or the prefill for the first token): the same
log μ the plain engines record (model/generation/sampling.py), never the draft's, whether the token was an
accepted draft, a residual draw or the bonus. Greedy (T → 0): p and q one-hot on their argmax, so
a draft is accepted exactly when it is the student's argmax and the output is greedy decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from k3post.algo.speculative import verify_draft
from k3post.algo.token_draws import draw, sampling_probs
from k3post.model.generation.draft_head import MtpHead
from k3post.model.generation.sampling import Completions, completion_mask
from k3post.types import SamplingParams


@dataclass
class SpeculationStats:
    """One call's figures, summed over the rows still running at each round: verify rounds,
    draft tokens proposed and accepted, tokens emitted by the rounds; and the rounds the call ran
    (its batched verify forwards: what its time is divided by to get the seconds of a round)."""

    row_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    rounds: int = 0

    @property
    def acceptance_length(self) -> float:
        """Tokens a row gets per student verify forward (accepted drafts + the residual or bonus
        token; fewer where a row stops inside a round)."""
        return self.emitted / max(self.row_rounds, 1)


@dataclass
class Emitted:
    """The rows' outputs so far: tokens and logprobs [B, N], how many each has, which still run."""

    tokens_BN: torch.Tensor
    logprobs_BN: torch.Tensor
    count_B: torch.Tensor
    running_B: torch.Tensor


def emit_round(out: Emitted, tokens_BJ: torch.Tensor, logprobs_BJ: torch.Tensor, valid_BJ: torch.Tensor,
               stop_ids: torch.Tensor) -> int:
    """Append each row's valid tokens of the round in order, stopping a row at its first stop id
    or when it holds N tokens (what comes after is dropped: truncation keeps the law of the prefix).
    Returns how many tokens were appended."""
    N, added = out.tokens_BN.shape[1], 0
    rows_B = torch.arange(out.tokens_BN.shape[0], device=out.tokens_BN.device)
    for j in range(tokens_BJ.shape[1]):
        take_B = out.running_B & valid_BJ[:, j] & (out.count_B < N)
        at_B = out.count_B.clamp(max=N - 1)
        out.tokens_BN[rows_B[take_B], at_B[take_B]] = tokens_BJ[take_B, j]
        out.logprobs_BN[rows_B[take_B], at_B[take_B]] = logprobs_BJ[take_B, j]
        out.count_B += take_B.long()
        added += int(take_B.sum())
        out.running_B &= ~(take_B & torch.isin(tokens_BJ[:, j], stop_ids)) & (out.count_B < N)
    return added


class SpeculativeDecoder:
    """Samples completions of `model`, drafting `tokens` (K) at a time with `head`."""

    def __init__(self, model: PreTrainedModel, head: MtpHead, pad_id: int, stop_ids: list[int], tokens: int):
        self.model, self.head, self.pad_id, self.K = model, head, pad_id, tokens
        self.device = model.get_output_embeddings().weight.device
        self.stops = torch.tensor(stop_ids, dtype=torch.long, device=self.device)
        self.stop_ids = stop_ids

    def _student(self, ids_BL, mask_BC, positions_BL, cache) -> torch.Tensor:
        base = getattr(self.model, self.model.base_model_prefix)
        return base(input_ids=ids_BL, attention_mask=mask_BC, position_ids=positions_BL, past_key_values=cache,
                    use_cache=True).last_hidden_state

    def _layout(self, prompt_ids: list[list[int]]):
        P = max(len(p) for p in prompt_ids)
        ids_BP = torch.tensor([[self.pad_id] * (P - len(p)) + list(p) for p in prompt_ids], dtype=torch.long)
        lengths_B = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
        mask_BP = (torch.arange(P)[None] >= (P - lengths_B)[:, None]).long()
        positions_BP = (mask_BP.cumsum(-1) - 1).masked_fill(mask_BP == 0, 1)
        return ids_BP.to(self.device), mask_BP.to(self.device), positions_BP.to(self.device)

    def _draft(self, g_BH, y_B, y_pos_B, mask_BC, head_cache, params, greedy):
        """K draft tokens and the distributions they were drawn from ([B, K], [B, K, V])."""
        drafts, qs = [], []
        for j in range(self.K):
            q_BV = sampling_probs(self.head.logits(g_BH), params.temperature, params.top_p, greedy)
            d_B = draw(q_BV)
            drafts.append(d_B)
            qs.append(q_BV)
            if j + 1 < self.K:  # chain: g in place of the student's h at the last token's position
                mask_BC = torch.cat([mask_BC, torch.ones_like(mask_BC[:, :1])], dim=1)
                g_BH = self.head(g_BH[:, None], d_B[:, None], (y_pos_B + j)[:, None], mask_BC, head_cache)[:, 0]
        return torch.stack(drafts, 1), torch.stack(qs, 1)

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, greedy: bool = False
               ) -> tuple[Completions, SpeculationStats]:
        with self.head.reading():  # a `residual` head reads the states before the final norm
            return self._sample(prompt_ids, params, greedy)

    def _sample(self, prompt_ids: list[list[int]], params: SamplingParams, greedy: bool
                ) -> tuple[Completions, SpeculationStats]:
        torch.manual_seed(params.seed)
        B, N, K, T = len(prompt_ids), params.max_new_tokens, self.K, params.temperature
        ids_BP, mask_BC, positions_BP = self._layout(prompt_ids)
        cache, head_cache = DynamicCache(config=self.model.config), DynamicCache()
        h_BPH = self._student(ids_BP, mask_BC, positions_BP, cache)
        logits_BV = self.head.student_logits(h_BPH[:, -1])
        y_B = draw(sampling_probs(logits_BV, T, params.top_p, greedy))
        out = Emitted(torch.full((B, N), self.pad_id, dtype=torch.long, device=self.device),
                      torch.zeros((B, N), device=self.device), torch.zeros(B, dtype=torch.long, device=self.device),
                      torch.ones(B, dtype=torch.bool, device=self.device))
        lp_B = torch.log_softmax(logits_BV / T, -1).gather(-1, y_B[:, None])
        stats = SpeculationStats()
        emit_round(out, y_B[:, None], lp_B, torch.ones_like(y_B[:, None], dtype=torch.bool), self.stops)
        # The block the head is fed next: columns with real h, the next real token after each, positions.
        block = (h_BPH, torch.cat([ids_BP[:, 1:], y_B[:, None]], 1), positions_BP,
                 torch.full_like(y_B, h_BPH.shape[1] - 1))
        y_pos_B = mask_BC.sum(-1)
        while bool(out.running_B.any()):
            h_blk, next_blk, pos_blk, last_B = block
            if K > 1 and head_cache.get_seq_length() > 0:
                head_cache.crop(-(K - 1))  # the last round's speculative entries
            g_BLH = self.head(h_blk, next_blk, pos_blk, mask_BC, head_cache)
            g_BH = g_BLH[torch.arange(B, device=self.device), last_B]
            drafts_BK, q_BKV = self._draft(g_BH, y_B, y_pos_B, mask_BC, head_cache, params, greedy)
            new_ids_BK1 = torch.cat([y_B[:, None], drafts_BK], 1)
            new_pos_BK1 = y_pos_B[:, None] + torch.arange(K + 1, device=self.device)
            verify_mask_BC = torch.cat([mask_BC, torch.ones_like(new_ids_BK1)], 1)
            h_BK1H = self._student(new_ids_BK1, verify_mask_BC, new_pos_BK1, cache)
            logits_BK1V = self.head.student_logits(h_BK1H)
            n_B, y_B = verify_draft(sampling_probs(logits_BK1V, T, params.top_p, greedy), q_BKV, drafts_BK)
            # Emitted this round: d_1..d_n, then y (the residual draw or the bonus) at slot n.
            slots_BK1 = torch.arange(K + 1, device=self.device)[None]
            emitted_BK1 = torch.cat([drafts_BK, drafts_BK[:, :1]], 1).scatter(1, n_B[:, None], y_B[:, None])
            lp_BK1 = torch.log_softmax(logits_BK1V / T, -1).gather(-1, emitted_BK1[..., None]).squeeze(-1)
            running_B = out.running_B.clone()
            stats.emitted += emit_round(out, emitted_BK1, lp_BK1, slots_BK1 <= n_B[:, None], self.stops)
            stats.row_rounds += int(running_B.sum())
            stats.rounds += 1
            stats.drafted += K * int(running_B.sum())
            stats.accepted += int(n_B[running_B].sum())
            mask_BC = torch.cat([mask_BC, (slots_BK1 <= n_B[:, None]).long()], 1)  # rejected drafts: holes
            # The head's next block: column i holds token new_ids[i]; the next real token after it is
            # the one emitted at slot i (d_{i+1}, or y at slot n); its real h is the verify's.
            block = (h_BK1H, emitted_BK1, new_pos_BK1, n_B)
            y_pos_B = y_pos_B + n_B + 1
        return self._completions(out), stats

    def _completions(self, out: Emitted) -> Completions:
        tokens_BN, logprobs_BN = out.tokens_BN.cpu(), out.logprobs_BN.cpu()
        mask_BN = completion_mask(tokens_BN, self.stop_ids)
        mask_BN = mask_BN * (torch.arange(tokens_BN.shape[1])[None] < out.count_B.cpu()[:, None])
        width = max(1, int(mask_BN.sum(dim=1).max()))
        mask_BT = mask_BN[:, :width]
        return Completions(tokens_BN[:, :width].contiguous(), mask_BT, logprobs_BN[:, :width] * mask_BT)
