"""Exact speculative rounds in the static-cache sampler (model/generation/fast_sampling.py).

The rule is algo/speculative.py's, as in the plain HF engine (model/generation/speculative_sampling.py): the MTP
head drafts K tokens, one student forward over K + 1 positions verifies them, and the accepted
drafts, the residual draw or the bonus token come out distributed exactly as plain sampling's.
What differs is the cache, and with it how a rejected draft is rolled back.

Per-row columns. The prompts are left-padded to a bucket P as the plain static path lays them out,
so row b's completion token j always sits at column P + j. Each row writes its new keys and values
at its *own* columns (`RowCache`: a scatter along the cache's length axis instead of one shared
write position), so rows that accept different counts never drift apart: after a round that
accepted n of K drafts, the row's real tokens end at column c + n and its next verify block starts
at column c + n + 1, over the rejected drafts' entries. Rolling back is not advancing the row's
length; nothing is copied or cropped. The cache is P + N + K columns long (the last verify block
of a row may run K columns past its budget N), allocated once per (batch, length) shape, so every
forward has a fixed shape and the compiled path can use CUDA graphs.

Masks. Every forward after the prefill passes its own 4D mask [B, 1, Q, L]: query q of row b (at
column c_bq) sees column c when c ≤ c_bq and c is not a prompt pad. Stale entries - a rejected
draft's, the head's speculative chain - lie only past the row's last real column, and each is
overwritten by the forward that writes that column again before any query can see it.

The head (model/generation/draft_head.py) keeps its own one-layer `RowCache` over the same columns. Its
prefill is the prompt block (the student's real h_t with the next real token); after a verify it
is fed the verify's block (real h_t with the token emitted after t), and its output at the row's
last real column drafts d_1; drafts 2..K chain its own output in place of the student's h, written
at the columns the next verify block overwrites.

What comes out is what the plain static path returns (tokens, loss mask, log μ of every emitted
token from the student's logits that verified it, never the draft's), plus `SpeculationStats`.
Greedy (T → 0): p and q one-hot, so a draft is accepted exactly when it is the student's argmax.
tests/unit/test_fast_speculation.py checks greedy against plain greedy, the logprobs against a
teacher-forced recompute, and the samples against the exact law (chi-square).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

from k3post.algo.speculative import verify_draft
from k3post.algo.token_draws import draw, sampling_probs
from k3post.model.generation.draft_head import MtpHead
from k3post.model.generation.fast_sampling import StaticSampler
from k3post.model.generation.fused_projections import step_compile_options
from k3post.model.generation.sampling import Completions
from k3post.model.generation.speculative_sampling import Emitted, SpeculationStats
from k3post.types import SamplingParams

# Attention implementations whose masks are boolean (True: attend) or additive floats.
BOOLEAN_MASKS = ("sdpa", "k3post_grouped_sdpa")
ADDITIVE_MASKS = ("eager",)


class _Columns:
    """Where the next forward writes, per row [B, J]; None: the static layer's own shared position."""

    at: torch.Tensor | None = None


class RowWriteLayer(StaticLayer):
    """A static layer whose `update` writes each row's J new entries at that row's columns."""

    def __init__(self, max_cache_len: int, columns: _Columns):
        super().__init__(max_cache_len)
        self.columns = columns

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        at_BJ = self.columns.at
        if at_BJ is None:  # the prefill: every row at 0..P-1, as the plain static cache writes it
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # keys[b, :, at[b, j]] = new[b, :, j]. An index_put, not a scatter along the length axis: the
        # compiler writes an index_put into the cache in place, where it lowers a scatter to a
        # scatter into a fresh tensor and a copy of the whole cache back (two kernels a write, their
        # cost growing with batch × cache length: a quarter of a round's GPU time on an H100).
        rows_BJ = torch.arange(at_BJ.shape[0], device=at_BJ.device)[:, None].expand_as(at_BJ)
        self.keys[rows_BJ, :, at_BJ] = key_states.transpose(1, 2)
        self.values[rows_BJ, :, at_BJ] = value_states.transpose(1, 2)
        return self.keys, self.values


class RowCache(Cache):
    """`layers` RowWriteLayers of `length` columns sharing one `_Columns`."""

    def __init__(self, layers: int, length: int):
        self.columns = _Columns()
        super().__init__(layers=[RowWriteLayer(length, self.columns) for _ in range(layers)])


def emit_block(out: Emitted, tokens_BJ: torch.Tensor, logprobs_BJ: torch.Tensor, valid_BJ: torch.Tensor,
               stops: torch.Tensor, budget: int) -> torch.Tensor:
    """Append each running row's valid tokens (a prefix of the J slots) up to and including its first
    stop id and within `budget` tokens; returns how many each row took [B]. No host sync: the
    slots not taken are written to the scratch column past the budget (out.tokens_BN has one)."""
    J = tokens_BJ.shape[1]
    stop_BJ = torch.isin(tokens_BJ, stops) & valid_BJ
    no_stop_before_BJ = (stop_BJ.long().cumsum(1) - stop_BJ.long()) == 0
    at_BJ = out.count_B[:, None] + torch.arange(J, device=tokens_BJ.device)
    take_BJ = valid_BJ & no_stop_before_BJ & out.running_B[:, None] & (at_BJ < budget)
    where_BJ = torch.where(take_BJ, at_BJ, out.tokens_BN.shape[1] - 1)
    out.tokens_BN.scatter_(1, where_BJ, tokens_BJ)
    out.logprobs_BN.scatter_(1, where_BJ, logprobs_BJ.to(out.logprobs_BN.dtype))
    taken_B = take_BJ.sum(1)
    out.count_B += taken_B
    out.running_B &= ~(take_BJ & stop_BJ).any(1) & (out.count_B < budget)
    return taken_B


def visible(columns_BQ: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
    """[B, 1, Q, L]: query q (at column columns_BQ[b, q]) sees column c ≤ it that is not a pad."""
    c_L = torch.arange(mask_BL.shape[1], device=mask_BL.device)
    return ((c_L[None, None] <= columns_BQ[..., None]) & mask_BL[:, None].bool())[:, None]


class StaticSpeculativeDecoder:
    """Samples with `sampler`'s model and layout, drafting `tokens` (K) at a time with `head`.

    A round is K head steps and one verify step, each a forward with its draws; compiled, the whole
    round is one CUDA graph (one launch from the host, where a launch per step and its guard checks
    cost more host time than the GPU spends on a head step), then the emit, compiled on its own.
    Nothing in a round waits for the GPU: whether any row still runs is read one round late
    (`_LaggedFlag`), so the host prepares round r + 1 while the GPU runs round r, at the price of
    one idle round at the end (it emits nothing and counts in no statistic)."""

    def __init__(self, sampler: StaticSampler, head: MtpHead, tokens: int):
        self.sampler, self.head, self.K = sampler, head, tokens
        self.model: PreTrainedModel = sampler.model
        self.base = getattr(self.model, self.model.base_model_prefix)
        impl = self.model.config._attn_implementation
        if impl not in BOOLEAN_MASKS + ADDITIVE_MASKS:
            raise ValueError(f"speculation in the static-cache sampler needs 4D attention masks; attention "
                             f"implementation {impl!r} takes none (use sdpa or eager, or sampling.cache: dynamic)")
        self._additive = impl in ADDITIVE_MASKS
        self.stops = torch.tensor(sampler.stop_ids, dtype=torch.long, device=sampler.device)
        self._caches: dict[tuple[int, int, int], RowCache] = {}
        # One CUDA graph per (batch, block length, cache length). The emit mutates the outputs in
        # place, which CUDA graphs cannot: compiled without them.
        compiled = sampler.compiled
        self._round = (torch.compile(self._round_eager, dynamic=False, options=step_compile_options())
                       if compiled else self._round_eager)
        self._emit = torch.compile(self._emit_eager, dynamic=False) if compiled else self._emit_eager

    def _cache(self, layers: int, batch: int, length: int) -> RowCache:
        key = (layers, batch, length)
        if key not in self._caches:
            self._caches[key] = RowCache(layers, length)
        cache = self._caches[key]
        for layer in cache.layers:
            layer.reset()
        cache.columns.at = None
        return cache

    def _mask(self, columns_BQ: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        seen = visible(columns_BQ, mask_BL)
        if not self._additive:
            return seen
        dtype = self.model.get_output_embeddings().weight.dtype
        return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)

    def _draft_eager(self, h_BJH, next_BJ, positions_BJ, columns_BJ, last_B, mask_BL, params: SamplingParams,
                     greedy: bool, cache: RowCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head over a block (h_t with the token after t) written at `columns_BJ`, then a draft
        from its output at each row's position `last_B`: (g [B, H], the draft [B], q it was drawn
        from [B, V])."""
        cache.columns.at = columns_BJ
        g_BJH = self.head(h_BJH, next_BJ, positions_BJ, self._mask(columns_BJ, mask_BL), cache)
        g_BH = g_BJH[torch.arange(g_BJH.shape[0], device=g_BJH.device), last_B]
        q_BV = sampling_probs(self.head.logits(g_BH), params.temperature, params.top_p, greedy)
        return g_BH, draw(q_BV), q_BV

    def _verify_eager(self, y_B, drafts_BK, q_BKV, positions_BJ, columns_BJ, mask_BL, params: SamplingParams,
                      greedy: bool, cache: RowCache) -> tuple[torch.Tensor, ...]:
        """The student over [y, d_1..d_K] written at `columns_BJ`, and the round's draws: (h [B, K+1,
        H], n accepted [B], the residual or bonus token y [B], the K + 1 slots emitted [B, K+1]
        (d_1..d_n, then y at slot n), their log μ [B, K+1])."""
        cache.columns.at = columns_BJ
        ids_BJ = torch.cat([y_B[:, None], drafts_BK], 1)
        h_BJH = self.base(input_ids=ids_BJ, attention_mask=self._mask(columns_BJ, mask_BL), position_ids=positions_BJ,
                          past_key_values=cache, use_cache=True).last_hidden_state
        logits_BJV = self.head.student_logits(h_BJH)
        n_B, y_B = verify_draft(sampling_probs(logits_BJV, params.temperature, params.top_p, greedy), q_BKV, drafts_BK)
        emitted_BJ = torch.cat([drafts_BK, drafts_BK[:, :1]], 1).scatter(1, n_B[:, None], y_B[:, None])
        lp_BJ = torch.log_softmax(logits_BJV / params.temperature, -1).gather(-1, emitted_BJ[..., None]).squeeze(-1)
        return h_BJH, n_B, y_B, emitted_BJ, lp_BJ

    def _round_eager(self, block, y_B, count_B, lengths_B, P: int, mask_BL, params: SamplingParams, greedy: bool,
                     head_cache: RowCache, cache: RowCache) -> tuple[torch.Tensor, ...]:
        """One round's forwards and draws, from the last verify block (or the prompt's) and the
        pending token y: K drafts, the head's chain written at the columns after the row's last real
        one and the verify block from y's column on. Returns the verify's outputs and the block's
        positions and columns (what the next round's head reads)."""
        h_BJH, next_BJ, positions_BJ, columns_BJ, last_B = block
        last_col_B, last_pos_B = P + count_B - 2, lengths_B + count_B - 2  # the row's last real token, before y
        g_BH, d_B, q_BV = self._draft_eager(h_BJH, next_BJ, positions_BJ, columns_BJ, last_B, mask_BL, params, greedy,
                                            head_cache)
        drafts, qs = [d_B], [q_BV]
        for j in range(1, self.K):  # g in place of the student's h, at y's column and the drafts' after it
            g_BH, d_B, q_BV = self._draft_eager(g_BH[:, None], d_B[:, None], (last_pos_B + j)[:, None],
                                                (last_col_B + j)[:, None], torch.zeros_like(last_B), mask_BL, params,
                                                greedy, head_cache)
            drafts.append(d_B)
            qs.append(q_BV)
        slots_J = torch.arange(self.K + 1, device=y_B.device)
        cols_BJ, pos_BJ = (last_col_B + 1)[:, None] + slots_J, (last_pos_B + 1)[:, None] + slots_J
        verified = self._verify_eager(y_B, torch.stack(drafts, 1), torch.stack(qs, 1), pos_BJ, cols_BJ, mask_BL,
                                      params, greedy, cache)
        return (*verified, pos_BJ, cols_BJ)

    def _emit_eager(self, out: Emitted, emitted_BJ, lp_BJ, n_B, totals: torch.Tensor, budget: int) -> None:
        """The round's tokens into `out`, and its figures into `totals` (row rounds, drafted, accepted,
        emitted, rounds), counted over the rows running at its start."""
        running_B = out.running_B.long()
        slots_J = torch.arange(emitted_BJ.shape[1], device=n_B.device)
        taken_B = emit_block(out, emitted_BJ, lp_BJ, slots_J[None] <= n_B[:, None], self.stops, budget)
        rows = running_B.sum()
        totals += torch.stack([rows, self.K * rows, (n_B * running_B).sum(), taken_B.sum(), (rows > 0).long()])

    def _run_round(self, head_cache: RowCache, cache: RowCache, *inputs) -> tuple[torch.Tensor, ...]:
        """`_round_eager`, compiled where both caches hold their tensors.

        A cache layer allocates its tensors at its first write, and marks them as fixed addresses (which
        CUDA graphs need to write into them) only outside a compiled region; allocated inside one, the
        compiled update fails (dynamo, at `RowWriteLayer`'s scatter). So a round that writes a cache for
        the first time runs eager: the head's first block, in a call's first round."""
        graphs = self.sampler.compiled and all(layer.is_initialized for c in (head_cache, cache) for layer in c.layers)
        if graphs:  # the last outputs are consumed (or cloned): the graph may reuse them
            torch.compiler.cudagraph_mark_step_begin()
        out = (self._round if graphs else self._round_eager)(*inputs, head_cache, cache)
        head_cache.columns.at = cache.columns.at = None
        return tuple(t.clone() for t in out) if graphs else out

    def _start(self, prompt_ids: list[list[int]], params: SamplingParams, greedy: bool, groups: bool):
        """Prefill, the first token, and the head's first block."""
        s, N, K = self.sampler, params.max_new_tokens, self.K
        ids_BP, positions_BP, mask_BL, lengths_B = s._layout(prompt_ids, N + K)
        B, P = ids_BP.shape
        cache = self._cache(len(self.base.layers), B, P + N + K)
        h_BPH, prefilled = s._prefill(ids_BP, positions_BP, mask_BL, cache, groups, hidden=True)
        logits_BV = self.head.student_logits(h_BPH[:, -1])
        y_B = draw(sampling_probs(logits_BV, params.temperature, params.top_p, greedy))
        out = Emitted(torch.full((B, N + 1), s.pad_id, dtype=torch.long, device=s.device),
                      torch.zeros((B, N + 1), device=s.device), torch.zeros(B, dtype=torch.long, device=s.device),
                      torch.ones(B, dtype=torch.bool, device=s.device))
        lp_B1 = torch.log_softmax(logits_BV / params.temperature, -1).gather(-1, y_B[:, None])
        emit_block(out, y_B[:, None], lp_B1, torch.ones_like(y_B[:, None], dtype=torch.bool), self.stops, N)
        columns_BP = torch.arange(P, device=s.device)[None].expand(B, -1)
        block = (h_BPH, torch.cat([ids_BP[:, 1:], y_B[:, None]], 1), positions_BP, columns_BP, torch.full_like(y_B, P - 1))
        return out, y_B, block, (cache, mask_BL, lengths_B, P, prefilled)

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, greedy: bool = False,
               groups: bool = True) -> tuple[Completions, SpeculationStats]:
        """A `residual` head reads the student's states before its final norm: the student runs
        inside `residual_stream` here (MtpHead.reading), as everywhere the head drafts."""
        with self.head.reading():
            return self._sample(prompt_ids, params, greedy, groups)

    def _sample(self, prompt_ids: list[list[int]], params: SamplingParams, greedy: bool,
                groups: bool) -> tuple[Completions, SpeculationStats]:
        torch.manual_seed(params.seed)
        N, device = params.max_new_tokens, self.sampler.device
        out, y_B, block, (cache, mask_BL, lengths_B, P, prefilled) = self._start(prompt_ids, params, greedy, groups)
        head_cache = self._cache(1, len(prompt_ids), cache.layers[0].max_cache_len)
        totals = torch.zeros(5, dtype=torch.long, device=device)  # row rounds, drafted, accepted, emitted, rounds
        running = _LaggedFlag(out.running_B)
        while running.last():
            h_BJH, n_B, y_B, emitted_BJ, lp_BJ, pos_BJ, cols_BJ = self._run_round(
                head_cache, cache, block, y_B, out.count_B, lengths_B, P, mask_BL, params, greedy)
            self._emit(out, emitted_BJ, lp_BJ, n_B, totals, N)
            running.record(out.running_B)
            block = (h_BJH, emitted_BJ, pos_BJ, cols_BJ, n_B)
        row_rounds, drafted, accepted, emitted, rounds = totals.tolist()
        done = self.sampler._completions(out.tokens_BN[:, :N].cpu(), out.logprobs_BN[:, :N].cpu(), prefilled)
        return done, SpeculationStats(row_rounds, drafted, accepted, emitted, rounds)


class _LaggedFlag:
    """Whether any row ran at the end of the round before the last, read without draining the GPU's
    queue: each round's flag is copied to pinned host memory behind an event, and the host waits
    for the previous round's event only, while the GPU still runs the latest round. On a CPU the
    copy is immediate and the wait nothing."""

    def __init__(self, running_B: torch.Tensor):
        cuda = running_B.device.type == "cuda"
        self.slots = [torch.ones((), dtype=torch.bool, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.round = 0
        self.record(running_B)

    def record(self, running_B: torch.Tensor) -> None:
        slot = self.round % 2
        self.slots[slot].copy_(running_B.any(), non_blocking=self.events is not None)
        if self.events is not None:
            self.events[slot].record()
        self.round += 1

    def last(self) -> bool:
        """The flag recorded two `record`s ago (the round before the last); True before there is one."""
        if self.round < 2:
            return True
        slot = self.round % 2  # the older of the two slots
        if self.events is not None:
            self.events[slot].synchronize()
        return bool(self.slots[slot])
