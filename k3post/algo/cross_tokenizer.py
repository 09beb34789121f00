"""Sampled-token reverse KL between a student and a teacher that tokenize text differently.

The student drew a completion y as its own tokens y_1..y_T; the teacher reads the *same text* as
its own tokens u_1..u_U. Per-token log-ratios log μ(y_t) − log π_T(y_t) no longer exist (token t
of one side is no token of the other), but log-probabilities of *text spans* do: a span covered by
student tokens i..j and by teacher tokens k..l has

    L_S(c) = Σ_{t=i..j} log μ(y_t | s_t)        L_T(c) = Σ_{u=k..l} log π_T(u | ·)

and, since both sides condition on the same text before the span, L_S(c) − L_T(c) is a one-sample
estimate of that span's contribution to the sequence-level reverse KL
E_y[log π_S(y) − log π_T(y)] (each side's probability of the text under its own tokenization).

**Chunks.** Walk both tokenizations' byte end offsets and close a chunk wherever both sides end at
the same byte: the chunks partition both token sequences and pair spans of equal text
(`align_chunks`). A teacher boundary inside a character (byte-level BPE splits an emoji over two
tokens whose offsets both name the whole character) is not a boundary: a teacher token can close a
chunk only where the next one starts at or after its end. Chunks are 1:1 (the same token on both
sides, the common case), many-to-one (the student spelt a word in pieces), one-to-many or
many-to-many. Identical tokenizers on canonical text give all-1:1 chunks, and then every formula
below is exactly today's per-token k_t.

**From chunks back to student tokens** (`project_teacher_logprobs`). The sampled-token loss wants
one advantage per student token, A_t = −c·k_t. Each split mode picks the k_t of a chunk's tokens,
written as a projected teacher logprob τ_t with k_t = log μ(y_t) − τ_t:

- `uniform`: τ_t = L_T(c)/n_S(c): the chunk's teacher logprob shared evenly. Σ_{t∈c} k_t =
  L_S(c) − L_T(c): the chunk's advantages sum to −c·(L_S − L_T), and a token's own log μ still
  sets its share (a likelier piece is pushed less).
- `broadcast`: k_t = L_S(c) − L_T(c) for every token of the chunk (τ_t = log μ_t − (L_S − L_T)):
  each token is credited with the whole chunk's log-ratio (the chunk mean of k is L_S − L_T).
- `one_to_one`: only 1:1 chunks get a signal (τ_t = L_T); every other chunk is left out.

Chunks longer than `max_chunk_tokens` on either side, and tokens outside any chunk (the tail
after a teacher truncation or after bytes that are no valid UTF-8), get τ_t = log μ_t,
i.e. k_t = 0 and advantage 0. They stay in the loss's token count, like any token whose advantage
is 0: the step is still a token mean over the whole batch (docs/losses.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from k3post.algo.topk import TAIL_FLOOR, complement_logsumexp, log1mexp

SPLIT_MODES = ("uniform", "broadcast", "one_to_one")


@dataclass(frozen=True)
class Alignment:
    """One row's chunks: the chunk index of every student and teacher token (−1: in none)."""

    student_chunks: tuple[int, ...]
    teacher_chunks: tuple[int, ...]
    num_chunks: int


def closable(starts: Sequence[int], ends: Sequence[int]) -> list[bool]:
    """Whether a chunk may close after token j: the next token starts at or after token j's end
    (byte-level pieces of one character share its offsets, and no boundary lies between them)."""
    return [j == len(ends) - 1 or starts[j + 1] >= ends[j] for j in range(len(ends))]


def align_chunks(student_ends: Sequence[int], teacher_ends: Sequence[int],
                 teacher_closable: Sequence[bool] | None = None) -> Alignment:
    """Chunks of two tokenizations of one text, from each token's byte end offset (non-decreasing).

    Both pointers advance over the side that ends earlier; a chunk closes when both sides end at
    the same byte (and the teacher may close there). Tokens left over when one side has run out
    (the other side's text is longer: a truncated teacher) belong to no chunk."""
    can_close = teacher_closable if teacher_closable is not None else [True] * len(teacher_ends)
    s_chunk, t_chunk = [-1] * len(student_ends), [-1] * len(teacher_ends)
    i = j = chunk = 0
    s_open = t_open = 0  # the first token of the open chunk on each side
    while i < len(student_ends) and j < len(teacher_ends):
        s_end, t_end = student_ends[i], teacher_ends[j]
        if s_end == t_end and can_close[j]:
            s_chunk[s_open:i + 1] = [chunk] * (i + 1 - s_open)
            t_chunk[t_open:j + 1] = [chunk] * (j + 1 - t_open)
            chunk, i, j, s_open, t_open = chunk + 1, i + 1, j + 1, i + 1, j + 1
        elif s_end < t_end:
            i += 1
        else:  # the teacher ends earlier, or at the same byte inside a character: its next token
            j += 1
    return Alignment(tuple(s_chunk), tuple(t_chunk), chunk)


def chunk_tensors(alignments: Sequence[Alignment], student_width: int, teacher_width: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' chunk indices as [B, T] and [B, U] long tensors, −1 where no chunk (and at pads)."""
    s_BT = torch.full((len(alignments), student_width), -1, dtype=torch.long)
    t_BU = torch.full((len(alignments), teacher_width), -1, dtype=torch.long)
    for b, a in enumerate(alignments):
        s_BT[b, :len(a.student_chunks)] = torch.tensor(a.student_chunks, dtype=torch.long)
        t_BU[b, :len(a.teacher_chunks)] = torch.tensor(a.teacher_chunks, dtype=torch.long)
    return s_BT, t_BU


def chunk_sums(values_BN: torch.Tensor, chunks_BN: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Σ of `values` over each row's chunk, [B, C] (entries with chunk −1 dropped)."""
    rows = values_BN.shape[0]
    out = values_BN.new_zeros(rows * num_chunks + 1)  # the last slot collects the −1 entries
    flat = torch.where(chunks_BN >= 0, chunks_BN + num_chunks * torch.arange(rows)[:, None], rows * num_chunks)
    out.index_add_(0, flat.reshape(-1), values_BN.reshape(-1))
    return out[:-1].view(rows, num_chunks)


def aligned_logratios(student_BT: torch.Tensor, teacher_BU: torch.Tensor, student_chunks_BT: torch.Tensor,
                      teacher_chunks_BU: torch.Tensor, direction: str) -> torch.Tensor:
    """Per row, log π_S − log π_T of the aligned text (direction "reverse"; the negation for
    "forward"): each side's logprobs summed over its tokens inside chunks, in float64. [B]"""
    if direction not in ("reverse", "forward"):
        raise ValueError(f"direction must be 'reverse' or 'forward', got {direction!r}")
    student_B = torch.where(student_chunks_BT >= 0, student_BT.double(), 0.0).sum(1)
    teacher_B = torch.where(teacher_chunks_BU >= 0, teacher_BU.double(), 0.0).sum(1)
    return student_B - teacher_B if direction == "reverse" else teacher_B - student_B


@dataclass(frozen=True)
class Projection:
    """τ_t per student token ([B, T]; k_t = log μ_t − τ_t) and which tokens carry a signal."""

    teacher_logprobs_BT: torch.Tensor
    signal_BT: torch.Tensor  # bool


def project_teacher_logprobs(sampler_logprobs_BT: torch.Tensor, teacher_logprobs_BU: torch.Tensor,
                             student_chunks_BT: torch.Tensor, teacher_chunks_BU: torch.Tensor, split: str,
                             max_chunk_tokens: int) -> Projection:
    """The projected teacher logprobs τ_t of the module docstring, for every split mode.

    Chunk sums are taken in float64 (a chunk's L_S − L_T is a difference of sums); τ is returned
    in the sampler logprobs' dtype. Pads and unaligned tokens (chunk −1) get τ_t = log μ_t."""
    if split not in SPLIT_MODES:
        raise ValueError(f"split must be one of {SPLIT_MODES}, got {split!r}")
    num_chunks = int(max(student_chunks_BT.max(), teacher_chunks_BU.max(), -1)) + 1
    mu_BT = sampler_logprobs_BT.double()
    ones_BT, ones_BU = torch.ones_like(mu_BT), torch.ones_like(teacher_logprobs_BU, dtype=torch.float64)
    n_s_BC = chunk_sums(ones_BT, student_chunks_BT, num_chunks)
    n_t_BC = chunk_sums(ones_BU, teacher_chunks_BU, num_chunks)
    l_s_BC = chunk_sums(mu_BT, student_chunks_BT, num_chunks)
    l_t_BC = chunk_sums(teacher_logprobs_BU.double(), teacher_chunks_BU, num_chunks)
    keep_BC = (n_s_BC <= max_chunk_tokens) & (n_t_BC <= max_chunk_tokens) & (n_s_BC > 0) & (n_t_BC > 0)
    if split == "one_to_one":
        keep_BC &= (n_s_BC == 1) & (n_t_BC == 1)
    index_BT = student_chunks_BT.clamp(min=0)

    def per_token(values_BC: torch.Tensor) -> torch.Tensor:
        return values_BC.gather(1, index_BT) if num_chunks else torch.zeros_like(mu_BT)

    if split == "broadcast":
        tau_BT = mu_BT - per_token(l_s_BC - l_t_BC)
    else:  # uniform; one_to_one keeps only chunks of one token, where L_T / 1 = L_T
        tau_BT = per_token(l_t_BC / n_s_BC.clamp(min=1))
    signal_BT = (student_chunks_BT >= 0) & per_token(keep_BC.double()).bool()
    tau_BT = torch.where(signal_BT, tau_BT, mu_BT)
    return Projection(tau_BT.to(sampler_logprobs_BT.dtype), signal_BT)


def alignment_counts(alignments: Sequence[Alignment], signal_BT: torch.Tensor, loss_mask_BT: torch.Tensor
                     ) -> dict[str, float]:
    """Sums over a batch for the per-teacher metrics (sums, so replicas' answers add up):
    chunks, 1:1 chunks, student tokens inside chunks, tokens with a signal, student tokens."""
    chunks = one_to_one = covered = 0
    for a in alignments:
        sizes: dict[int, list[int]] = {}
        for c in a.student_chunks:
            if c >= 0:
                sizes.setdefault(c, [0, 0])[0] += 1
        for c in a.teacher_chunks:
            if c >= 0:
                sizes.setdefault(c, [0, 0])[1] += 1
        chunks += a.num_chunks
        one_to_one += sum(1 for s, t in sizes.values() if s == 1 and t == 1)
        covered += sum(s for s, _ in sizes.values())
    return {"chunks": float(chunks), "chunks_1to1": float(one_to_one), "tokens_in_chunks": float(covered),
            "tokens_signal": float((signal_BT & (loss_mask_BT != 0)).sum()),
            "tokens": float((loss_mask_BT != 0).sum())}


def alignment_metrics(counts: dict[str, float], teacher: str) -> dict[str, float]:
    """The per-teacher metrics from summed `alignment_counts`."""
    chunks, tokens = max(counts["chunks"], 1.0), max(counts["tokens"], 1.0)
    out = {f"align/one_to_one/{teacher}": counts["chunks_1to1"] / chunks,
           f"align/chunk_tokens/{teacher}": counts["tokens_in_chunks"] / chunks,
           f"align/signal/{teacher}": counts["tokens_signal"] / tokens}
    if "dense_positions" in counts:  # a topk_* loss on the mapped support (mapped_topk)
        out[f"align/dense_positions/{teacher}"] = counts["dense_positions"] / tokens
        out[f"align/mapped_mass/{teacher}"] = counts["mapped_mass"] / max(counts["dense_positions"], 1.0)
    return out


# -- Dense losses across tokenizers: the teacher's distribution on the student's ids, at 1:1 chunks
#
# Where a chunk is one token on each side, both models predict the next token from the same text,
# so their next-token distributions can be compared on the tokens that exist in both vocabularies
# (the same byte string: an exact map, built once per teacher). The teacher's k most likely *mapped*
# tokens become the student's ids of a top-k payload, and everything else of the teacher's mass
# (unmapped tokens and mapped ones beyond the k) its tail bucket: the top-k + tail maths of
# algo/topk.py on a mapped support. Tokens of other chunks (`signal_BT` 0) take the sampled-token
# term on their chunk's advantage instead (algo/objectives.py, _topk_term).


def vocabulary_map(student_bytes: Sequence[bytes], teacher_bytes: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens with the same byte string on both sides: (teacher ids [M], student ids [M]), each
    student id at most once (a teacher with two spellings of one string keeps its first)."""
    student_of: dict[bytes, int] = {}
    for i, piece in enumerate(student_bytes):
        if piece:
            student_of.setdefault(piece, i)
    teacher_ids, student_ids, taken = [], [], set()
    for j, piece in enumerate(teacher_bytes):
        i = student_of.get(piece)
        if i is not None and i not in taken:
            taken.add(i)
            teacher_ids.append(j)
            student_ids.append(i)
    return torch.tensor(teacher_ids, dtype=torch.long), torch.tensor(student_ids, dtype=torch.long)


def one_to_one_positions(student_chunks_BT: torch.Tensor, teacher_chunks_BU: torch.Tensor) -> torch.Tensor:
    """For every student token alone in its chunk with one teacher token: that teacher token's
    position; −1 elsewhere. [B, T] long."""
    num_chunks = int(max(student_chunks_BT.max(), teacher_chunks_BU.max(), -1)) + 1
    if num_chunks == 0:
        return torch.full_like(student_chunks_BT, -1)
    n_s_BC = chunk_sums(torch.ones_like(student_chunks_BT, dtype=torch.float64), student_chunks_BT, num_chunks)
    n_t_BC = chunk_sums(torch.ones_like(teacher_chunks_BU, dtype=torch.float64), teacher_chunks_BU, num_chunks)
    position_BU = torch.arange(teacher_chunks_BU.shape[1]).expand_as(teacher_chunks_BU).double()
    u_BC = chunk_sums(position_BU, teacher_chunks_BU, num_chunks).long()  # the position, where the chunk has one
    index_BT = student_chunks_BT.clamp(min=0)
    single_BT = (n_s_BC == 1).gather(1, index_BT) & (n_t_BC == 1).gather(1, index_BT) & (student_chunks_BT >= 0)
    return torch.where(single_BT, u_BC.gather(1, index_BT), torch.full_like(student_chunks_BT, -1))


@dataclass(frozen=True)
class MappedTopK:
    """The teacher's top-k on the student's ids at 1:1 positions ([B, T, k]), its tail [B, T], which
    positions carry the signal, and the teacher mass the whole mapped support holds there."""

    student_ids_BTK: torch.Tensor
    logprobs_BTK: torch.Tensor
    tail_logprobs_BT: torch.Tensor
    signal_BT: torch.Tensor  # bool
    mapped_mass_BT: torch.Tensor


def mapped_topk(teacher_full_BUV: torch.Tensor, u_of_t_BT: torch.Tensor, teacher_ids_M: torch.Tensor,
                student_ids_M: torch.Tensor, k: int) -> MappedTopK:
    """The mapped-support top-k of the block comment above; the tail is the exact log of the mass
    outside the k (algo/topk.py: complement_logsumexp). Positions without a 1:1 chunk get the
    teacher's values at its position 0 (finite; masked out by `signal_BT`)."""
    signal_BT = u_of_t_BT >= 0
    rows_BT1 = u_of_t_BT.clamp(min=0)[..., None].expand(-1, -1, teacher_full_BUV.shape[-1])
    full_BTV = teacher_full_BUV.gather(1, rows_BT1)  # the teacher's distribution at each student position
    mapped_BTM = full_BTV.index_select(-1, teacher_ids_M)
    values_BTK, slots_BTK = mapped_BTM.topk(min(k, mapped_BTM.shape[-1]), dim=-1)
    tail_BT = complement_logsumexp(full_BTV, teacher_ids_M[slots_BTK])
    return MappedTopK(student_ids_M[slots_BTK], values_BTK, tail_BT, signal_BT, mapped_BTM.logsumexp(-1).exp())


# An engine that returns only each position's top-K (vLLM's prompt logprobs) cannot rank the whole
# mapped support. From its top-K the k most likely *mapped* tokens are the payload, and the tail
# is 1 − their mass: exact for the tokens it names, the same as `mapped_topk` wherever the k most
# likely mapped tokens lie inside the top-K (always when K is the vocabulary). A position with fewer
# than k mapped tokens in its top-K sends fewer bins (the rest repeat its first id: empty bins,
# algo/topk.py `repeated_slots`) and one with none carries no signal.


def student_of_teacher(teacher_ids_M: torch.Tensor, student_ids_M: torch.Tensor, teacher_vocab: int) -> torch.Tensor:
    """The vocabulary map as a lookup: the student id of every teacher id, −1 where none. [V_T] long."""
    table_V = torch.full((teacher_vocab,), -1, dtype=torch.long)
    table_V[teacher_ids_M] = student_ids_M
    return table_V


def _chosen(values_BTN: torch.Tensor, student_BTN: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of `values` (logprobs on the student ids `student_BTN`) as (student ids, values);
    a slot with no mass (−inf) is an empty bin: the first id repeated (algo/topk.py `repeated_slots`)."""
    chosen_BTk, slots_BTk = values_BTN.topk(min(k, values_BTN.shape[-1]), dim=-1)
    first_BT1 = student_BTN.gather(-1, slots_BTk[..., :1]).clamp(min=0)
    ids_BTk = torch.where(chosen_BTk > float("-inf"), student_BTN.gather(-1, slots_BTk), first_BT1)
    return ids_BTk, chosen_BTk


def _rows_of_top(teacher_ids_BUK: torch.Tensor, teacher_logprobs_BUK: torch.Tensor, u_of_t_BT: torch.Tensor,
                 table_V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """At every student position, the teacher's top-K row of its 1:1 position (position 0 where it
    has none): each id looked up in `table_V` (−1: nothing; an engine's padded vocabulary rows map
    to nothing) and the logprobs. ([B, T, K] long, [B, T, K] fp32)."""
    rows_BTK = u_of_t_BT.clamp(min=0)[..., None].expand(-1, -1, teacher_ids_BUK.shape[-1])
    ids_BTK = teacher_ids_BUK.long().gather(1, rows_BTK)
    inside_BTK = ids_BTK < table_V.numel()
    looked_up_BTK = table_V[ids_BTK.clamp(max=table_V.numel() - 1)].masked_fill(~inside_BTK, -1)
    return looked_up_BTK, teacher_logprobs_BUK.float().gather(1, rows_BTK)


def _top_of_top(values_BTN: torch.Tensor, student_BTN: torch.Tensor, u_of_t_BT: torch.Tensor, k: int) -> MappedTopK:
    """The payload from an engine's top-K alone: the k largest `values` (−inf: no student id), the
    tail 1 − their mass, a signal where a 1:1 position found one, the mass `values` hold."""
    ids_BTk, chosen_BTk = _chosen(values_BTN, student_BTN, k)
    tail_BT = log1mexp(chosen_BTk.logsumexp(-1)).clamp(min=TAIL_FLOOR)
    signal_BT = (u_of_t_BT >= 0) & (chosen_BTk[..., 0] > float("-inf"))
    return MappedTopK(ids_BTk, chosen_BTk, tail_BT, signal_BT, values_BTN.logsumexp(-1).exp())


def mapped_topk_of_topk(teacher_ids_BUK: torch.Tensor, teacher_logprobs_BUK: torch.Tensor,
                        u_of_t_BT: torch.Tensor, student_of_teacher_V: torch.Tensor, k: int) -> MappedTopK:
    """The mapped-support top-k from a teacher's top-K alone (the block comment above). The
    mapped mass is that of the mapped tokens among the K: a lower bound of `mapped_topk`'s."""
    student_BTK, values_BTK = _rows_of_top(teacher_ids_BUK, teacher_logprobs_BUK, u_of_t_BT, student_of_teacher_V)
    return _top_of_top(values_BTK.masked_fill(student_BTK < 0, float("-inf")), student_BTK, u_of_t_BT, k)


# **The prefix projection** (`cross_tokenizer.dense_support: prefix`). The exact map above drops
# every teacher token whose string the student's vocabulary lacks: a teacher that writes
# " vaccine" as one token puts that mass outside the support of a student that spells it
# " v" + "ac" + "c" + "ine" (on the cross-tokenizer demo the mapped support held 77–87% of the
# teacher's mass). Text that goes on as " vaccine" goes on, in the student's tokens, with a token
# that is a byte prefix of it. Give each teacher token u the student token π(u) whose bytes are the
# longest prefix of u's bytes, and project the teacher's next-token distribution onto the student's
# vocabulary by summing over the teacher tokens each student token stands first for:
#
#     q_T(s | text) = Σ_{u : π(u) = s} π_T(u | text)
#
# A teacher token with the student's very string maps onto it, so where the two vocabularies agree
# q_T adds to the exact map's values only the mass of the longer teacher tokens that start with that
# string. q_T holds all of the teacher's mass but that of tokens no student token prefixes (none
# for a byte-level student, whose every single byte is a token); the teacher's end-of-turn tokens
# map onto the student's end token (set by the engine: the two end a turn whatever their strings,
# as in the chunk pairing above). It is an approximation: "the next student token is s" is not
# exactly "the text goes on with a teacher token that π maps to s" (a student token can be longer
# than the teacher token it starts, and the student's tokenizer may split u's text otherwise), and
# the student is taught to begin each teacher word with its longest piece. The top-k + tail maths
# then runs on q_T as on the exact map (algo/topk.py). BPM (arXiv 2607.22334) projects next-token
# mass across vocabularies by byte prefixes; this is a one-step, longest-prefix form of that.


def prefix_pieces(student_bytes: Sequence[bytes], teacher_bytes: Sequence[bytes],
                  student_added: Collection[int] = (), teacher_added: Collection[int] = ()) -> torch.Tensor:
    """π(u) for every teacher token: the student id whose bytes are the longest prefix of u's bytes
    (the first student id of that string), −1 where none is or u has no bytes. Added and special
    tokens (`*_added`: "<|im_end|>" is a marker, not its characters) map only to a student token
    with the same bytes, and no ordinary token maps onto one. [V_T] long."""
    ordinary: dict[bytes, int] = {}
    whole: dict[bytes, int] = {}
    for i, piece in enumerate(student_bytes):
        if piece:
            (whole if i in student_added else ordinary).setdefault(piece, i)
    longest = max(map(len, ordinary), default=0)
    pieces = []
    for u, piece in enumerate(teacher_bytes):
        if u in teacher_added:
            pieces.append(whole.get(piece, ordinary.get(piece, -1)) if piece else -1)
            continue
        found = (ordinary.get(piece[:n]) for n in range(min(len(piece), longest), 0, -1))
        pieces.append(next((i for i in found if i is not None), -1))
    return torch.tensor(pieces, dtype=torch.long)


def projected_topk(teacher_full_BUV: torch.Tensor, u_of_t_BT: torch.Tensor, piece_of_V: torch.Tensor,
                   student_vocab: int, k: int) -> MappedTopK:
    """The top-k of q_T (the prefix projection above) from the teacher's whole distribution at
    each 1:1 position: exact. Positions without a 1:1 chunk get the teacher's values at its
    position 0 (finite; masked out by `signal_BT`)."""
    rows_BT1 = u_of_t_BT.clamp(min=0)[..., None].expand(-1, -1, teacher_full_BUV.shape[-1])
    full_BTV = teacher_full_BUV.float().gather(1, rows_BT1)
    pieces_V = torch.full((full_BTV.shape[-1],), -1, dtype=torch.long)  # an engine's padded rows: no piece
    V = min(pieces_V.numel(), piece_of_V.numel())
    pieces_V[:V] = piece_of_V[:V]
    inside_V = pieces_V >= 0
    mass_BTS = full_BTV.new_zeros(*full_BTV.shape[:2], student_vocab)
    mass_BTS.index_add_(-1, pieces_V[inside_V], full_BTV[..., inside_V].exp())
    rest_BT = full_BTV[..., ~inside_V].logsumexp(-1)  # −inf where every teacher token has a piece
    projected_BTS = mass_BTS.log()
    ids_BTk, values_BTk = _chosen(projected_BTS, torch.arange(student_vocab).expand_as(projected_BTS), k)
    tail_BT = torch.logaddexp(complement_logsumexp(projected_BTS, ids_BTk), rest_BT).clamp(min=TAIL_FLOOR)
    return MappedTopK(ids_BTk, values_BTk, tail_BT, (u_of_t_BT >= 0) & (values_BTk[..., 0] > float("-inf")),
                      projected_BTS.logsumexp(-1).exp())


def projected_topk_of_topk(teacher_ids_BUK: torch.Tensor, teacher_logprobs_BUK: torch.Tensor,
                           u_of_t_BT: torch.Tensor, piece_of_V: torch.Tensor, k: int) -> MappedTopK:
    """The same from a teacher's top-K alone (vLLM): q_T of the K tokens it names, the tail 1 −
    the chosen mass. Where K is the whole vocabulary this is `projected_topk`. A position whose K
    tokens project onto fewer than k student tokens sends empty bins (−inf, the first id
    repeated: algo/topk.py `repeated_slots`)."""
    pieces_BTK, logprobs_BTK = _rows_of_top(teacher_ids_BUK, teacher_logprobs_BUK, u_of_t_BT, piece_of_V)
    probs_BTK = logprobs_BTK.exp().masked_fill(pieces_BTK < 0, 0.0)
    # Sum the mass of the tokens that project onto one student id: sort by id, add up each run.
    sorted_BTK, order_BTK = pieces_BTK.sort(-1)
    run_BTK = torch.ones_like(sorted_BTK)
    run_BTK[..., 1:] = (sorted_BTK[..., 1:] != sorted_BTK[..., :-1]).long()
    run_BTK = run_BTK.cumsum(-1) - 1
    mass_BTK = torch.zeros_like(probs_BTK).scatter_add_(-1, run_BTK, probs_BTK.gather(-1, order_BTK))
    student_BTK = torch.full_like(sorted_BTK, -1).scatter_(-1, run_BTK, sorted_BTK)
    return _top_of_top(mass_BTK.log().masked_fill(student_BTK < 0, float("-inf")), student_BTK, u_of_t_BT, k)
