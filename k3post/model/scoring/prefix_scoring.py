"""Scoring completions as continuations of key/value caches: a prefix shared by every row (a
teacher's system prompt and its chat template's fixed head) is encoded once per run, and a prompt
shared by a group of rows (`sampling.n` samples of it) once per batch.

Why it is exact. A causal decoder's hidden state at position i is a function of the tokens at
positions ≤ i only, and a layer's keys and values at position j depend only on tokens ≤ j. So
the keys and values of a prefix p, computed alone, are the ones a forward over `p + suffix`
computes for its first |p| positions; feeding the suffix with those keys and values as the
cache, the suffix's own positions (position ids |p|, |p| + 1, …: rotary embeddings are applied
to each key at its position when the key is made) and an attention mask over prefix + suffix
gives the suffix's hidden states of the full forward, up to float summation order.

The layout. `model/scoring/logprobs.py` scores rows right-padded (prompt, completion, pads), so every
row's real tokens sit at columns 0.. and pads only ever follow them; pads never precede a real
token. Here every row is laid out the same way after the prefix:

    [ prefix (cached, shared) | rest of the prompt, completion, right pads ]
      positions 0 .. P0-1        positions P0, P0+1, ...

With a shared prompt (a group), the prompt is encoded once, right-padded among the distinct
prompts of the batch, and each completion continues its own prompt's cache:

    [ prefix | prompt_u, pads (masked) | completion ]
                                         positions P0 + len(prompt_u) + t

The masked pads in the middle are keys the completion never attends to (mask 0); their queries
attended to the real tokens before them, so nothing is NaN. Positions count real tokens, as in
the uncached layout. tests/unit/test_prefix_scoring.py checks equality (fp32, 1e-5) per family.

What cannot take it. A recurrent state (Kimi Linear's KDA layers) is not a key/value list that a
mask can address per position; sliding-window layers are exact here only while a row's whole
sequence fits in the window (the cache holds every key; the window's mask is the model's own),
so a batch with a longer row goes the uncached way (`cache_unsupported`, `fits_window`; the
teacher names the sliding layers at start: `window_note`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from k3post.model.families import model_logit_transform
from k3post.model.scoring.logprobs import DEFAULT_CHUNK, completion_hidden_states, head_logprobs, pack_sequences
from k3post.model.scoring.shared_prefix_attention import shared_prefix, takes_split


def common_prefix(rows: list[list[int]]) -> list[int]:
    """The longest list of ids that every row starts with."""
    if not rows:
        return []
    first = rows[0]
    n = min(len(r) for r in rows)
    for row in rows[1:]:
        i = 0
        while i < n and row[i] == first[i]:
            i += 1
        n = i
    return list(first[:n])


def cache_unsupported(model: PreTrainedModel) -> str | None:
    """Why `model` cannot be scored from a cache here, or None when it can."""
    config = model.config
    if config.model_type == "kimi_linear":
        return "its KDA layers keep a recurrent state, not per-position keys and values"
    return None


def sliding_window(model: PreTrainedModel) -> int | None:
    """The model's attention window, when any of its layers slides."""
    config = model.config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    slides = "sliding_attention" in layer_types or (getattr(config, "use_sliding_window", True) and not layer_types)
    return int(window) if window and slides else None


def window_note(model: PreTrainedModel) -> str | None:
    """Which layers slide and over how many tokens (None when none does): what a teacher says at
    start, since a batch with a row longer than the window is scored the uncached way."""
    window = sliding_window(model)
    if window is None:
        return None
    config = model.config.get_text_config(decoder=True)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if layer_types:
        sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
        which = f"layers {_ranges(sliding)} of {len(layer_types)}"
    else:
        which = f"all {config.num_hidden_layers} layers"
    return (f"{which} attend within a sliding window of {window} tokens; a cache holds every key, so a batch "
            f"whose longest row (prompt + completion) passes {window} tokens is scored whole")


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def fits_window(model: PreTrainedModel, longest: int) -> bool:
    """Whether every row (`longest` tokens at most) is inside the window: then the window masks nothing."""
    window = sliding_window(model)
    return window is None or longest <= window


@dataclass(frozen=True)
class PrefixKV:
    """One prefix's ids and its keys and values, per layer [1, H, P, D] (detached, never written)."""

    ids: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    def __len__(self) -> int:
        return len(self.ids)


def _base(model: PreTrainedModel):
    return getattr(model, model.base_model_prefix)


@torch.no_grad()
def encode_prefix(model: PreTrainedModel, ids: list[int]) -> PrefixKV:
    """One forward of `ids` alone; its keys and values kept (what every row continues)."""
    device = model.get_output_embeddings().weight.device
    cache = DynamicCache()
    _base(model)(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True)
    keys = tuple(layer.keys.detach() for layer in cache.layers)
    values = tuple(layer.values.detach() for layer in cache.layers)
    return PrefixKV(tuple(ids), keys, values)


class ReadOnlyLayer(DynamicLayer):
    """A cache layer that hands the attention its stored keys and values followed by the new ones
    but keeps only the stored ones: a scoring pass over B rows then holds one layer's
    concatenation at a time instead of every layer's (the memory of an uncached forward)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def continuation_cache(keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...],
                       rows_B: torch.Tensor | int, keep: bool = False) -> DynamicCache:
    """A fresh cache whose layers hold `keys`/`values` for B rows: `rows_B` an int expands one
    stored row (a view: nothing is copied until attention concatenates the new keys), a tensor
    of row indices selects each row's own. The stored tensors are never written. `keep`: the
    forward's keys and values are appended (to continue again), else only read (ReadOnlyLayer)."""
    cache = DynamicCache()
    cache.layers = []
    for k, v in zip(keys, values):
        layer = DynamicLayer() if keep else ReadOnlyLayer()
        layer.lazy_initialization(k, v)
        if isinstance(rows_B, int):
            layer.keys, layer.values = k.expand(rows_B, -1, -1, -1), v.expand(rows_B, -1, -1, -1)
        else:
            layer.keys, layer.values = k.index_select(0, rows_B), v.index_select(0, rows_B)
        cache.layers.append(layer)
    return cache


def own_mask(past_mask_BQ: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
    """The 4-D boolean mask [B, 1, L, Q + L] of L new positions over a per-row past of Q keys and
    themselves: a past key where `past_mask_BQ` is 1, a new key at or before the query where
    `mask_BL` is 1 (what the model builds from the 2-D mask, the past all before the queries)."""
    B, L = mask_BL.shape
    causal_LL = torch.ones((L, L), dtype=torch.bool, device=mask_BL.device).tril()
    new_BLL = causal_LL[None] & mask_BL.bool()[:, None, :]
    past_BLQ = past_mask_BQ.bool()[:, None, :].expand(B, L, past_mask_BQ.shape[1])
    return torch.cat([past_BLQ, new_BLL], dim=-1)[:, None]


def continue_forward(model: PreTrainedModel, cache: DynamicCache, past_mask_BQ: torch.Tensor,
                     input_ids_BL: torch.Tensor, mask_BL: torch.Tensor, positions_BL: torch.Tensor,
                     shared: PrefixKV | None = None) -> torch.Tensor:
    """Hidden states [B, L, H] of `input_ids_BL` after the `cache` (its Q positions masked by
    `past_mask_BQ`), at positions `positions_BL`. `shared`: a prefix every row sees whole before
    its cache, held once and attended once for all rows (model/scoring/shared_prefix_attention.py), not
    in `cache` nor in `past_mask_BQ`."""
    if shared is None:
        out = _base(model)(input_ids=input_ids_BL, attention_mask=torch.cat([past_mask_BQ, mask_BL], dim=1),
                           position_ids=positions_BL, past_key_values=cache, use_cache=True)
        return out.last_hidden_state
    with shared_prefix(model, shared.keys, shared.values):
        out = _base(model)(input_ids=input_ids_BL, attention_mask=own_mask(past_mask_BQ, mask_BL),
                           position_ids=positions_BL, past_key_values=cache, use_cache=True)
    return out.last_hidden_state


@dataclass
class PrefixStats:
    """What one scoring call encoded and what it took from caches, in tokens."""

    prompt_tokens: int = 0       # prompt tokens of the rows scored
    encoded_prompt_tokens: int = 0  # of them, those run through the decoder in this call
    fallback_rows: int = 0       # rows scored the uncached way (not starting with the prefix)
    extra: dict = field(default_factory=dict)

    @property
    def reused(self) -> int:
        return self.prompt_tokens - self.encoded_prompt_tokens

    def add(self, other: "PrefixStats") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.encoded_prompt_tokens += other.encoded_prompt_tokens
        self.fallback_rows += other.fallback_rows


def _groups(rests: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct prompts in first-seen order, and each row's index among them."""
    index: dict[tuple[int, ...], int] = {}
    of_row = [index.setdefault(r, len(index)) for r in rests]
    return list(index), of_row


def _right_padded(rows: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [N, L] and mask [N, L] of right-padded rows, and their lengths [N]."""
    L = max(len(r) for r in rows)
    ids_NL = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask_NL = torch.zeros((len(rows), L), dtype=torch.long)
    for n, row in enumerate(rows):
        ids_NL[n, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask_NL[n, :len(row)] = 1
    return ids_NL, mask_NL, torch.tensor([len(r) for r in rows], dtype=torch.long)


# How the rows attend a shared prefix: "split" (attended once for all rows and merged,
# model/scoring/shared_prefix_attention.py) where the family's attention allows, else "concat" (the prefix
# expanded in front of each row's keys in every layer). Both are exact; "auto" splits on a CPU,
# where it was measured faster, and concatenates elsewhere until timed there (bench scripts set it:
# bench/teachers/teacher_prefix_cache.py --attention).
PREFIX_ATTENTION = "auto"


def _shared(model: PreTrainedModel, prefix: PrefixKV | None) -> PrefixKV | None:
    """The prefix to attend once for all rows (split), or None when the cache carries it."""
    if prefix is None or not takes_split(model):
        return None
    mode = PREFIX_ATTENTION
    if mode == "auto":
        mode = "split" if prefix.keys[0].device.type == "cpu" else "concat"
    return prefix if mode == "split" else None


def _prefix_cache(prefix: PrefixKV | None, rows: int, keep: bool, shared: PrefixKV | None) -> DynamicCache:
    """The cache the rows continue: the prefix expanded to them, or (split, or no prefix) empty."""
    if prefix is None:
        return DynamicCache()
    if shared is not None:  # the layers start empty; the shared prefix goes to the attention
        return continuation_cache(tuple(k[:, :, :0] for k in prefix.keys), tuple(v[:, :, :0] for v in prefix.values),
                                  rows, keep)
    return continuation_cache(prefix.keys, prefix.values, rows, keep)


def one_pass(model: PreTrainedModel, prefix: PrefixKV | None, rests: list[tuple[int, ...]],
             completion_ids_RT: torch.Tensor, loss_mask_RT: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Every row's rest of the prompt and completion in one forward after the shared prefix:
    the hidden states that predict each completion token, [R, T, H]."""
    device = model.get_output_embeddings().weight.device
    P0 = 0 if prefix is None else len(prefix)
    ids_RL, mask_RL, cols_RT = (t.to(device) for t in pack_sequences([list(r) for r in rests], completion_ids_RT,
                                                                   loss_mask_RT, pad_id))
    R, L = ids_RL.shape
    positions_RL = (P0 + torch.arange(L, device=device)).expand(R, L)
    shared = _shared(model, prefix)
    past_mask = torch.ones((R, 0 if shared is not None else P0), dtype=torch.long, device=device)
    h_RLH = continue_forward(model, _prefix_cache(prefix, R, False, shared), past_mask, ids_RL, mask_RL, positions_RL,
                             shared)
    rows_RT = torch.arange(R, device=device)[:, None].expand_as(cols_RT)
    return h_RLH[rows_RT, cols_RT.clamp(max=L - 1)]


def group_pass(model: PreTrainedModel, prefix: PrefixKV | None, rests: list[tuple[int, ...]],
               completion_ids_RT: torch.Tensor, loss_mask_RT: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, int]:
    """Each distinct prompt encoded once (after the shared prefix), then every row's completion
    as a continuation of its own prompt's cache: the predicting hidden states [R, T, H] and the
    number of prompt tokens encoded. Token t ≥ 1 is predicted by completion position t − 1, token
    0 by the prompt's last position."""
    device = model.get_output_embeddings().weight.device
    P0 = 0 if prefix is None else len(prefix)
    distinct, of_row = _groups(rests)
    ids_UL, mask_UL, lengths_U = (t.to(device) for t in _right_padded(distinct, pad_id))
    U, Lp = ids_UL.shape
    shared = _shared(model, prefix)
    Q0 = 0 if shared is not None else P0  # prefix positions the cache holds (split: none, it is shared)
    cache = _prefix_cache(prefix, U, True, shared)
    h_ULH = continue_forward(model, cache, torch.ones((U, Q0), dtype=torch.long, device=device), ids_UL, mask_UL,
                             (P0 + torch.arange(Lp, device=device)).expand(U, Lp), shared)
    u_R = torch.tensor(of_row, dtype=torch.long, device=device)
    first_RH = h_ULH[u_R, lengths_U[u_R] - 1]
    T = completion_ids_RT.shape[1]
    if T == 1:
        return first_RH[:, None], int(lengths_U.sum())
    keys = tuple(layer.keys for layer in cache.layers)
    values = tuple(layer.values for layer in cache.layers)
    past_mask = torch.cat([torch.ones((len(rests), Q0), dtype=torch.long, device=device), mask_UL[u_R]], dim=1)
    positions_RT = (P0 + lengths_U[u_R])[:, None] + torch.arange(T - 1, device=device)
    h_RTH = continue_forward(model, continuation_cache(keys, values, u_R), past_mask,
                             completion_ids_RT[:, :T - 1].to(device), loss_mask_RT[:, :T - 1].long().to(device),
                             positions_RT, shared)
    return torch.cat([first_RH[:, None], h_RTH], dim=1), int(lengths_U.sum())


def prefixed_hidden_states(model: PreTrainedModel, prefix: PrefixKV | None, prompt_ids: list[list[int]],
                           completion_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor, pad_id: int,
                           groups: bool = True) -> tuple[torch.Tensor, PrefixStats]:
    """`completion_hidden_states` (model/scoring/logprobs.py), computed after `prefix`'s cached keys and
    values for the rows that start with it (and have a token after it), and, with `groups`, each
    distinct prompt once; the other rows the uncached way. Returns [B, T, H] and the counts.

    Exactness needs the layout described at the top of this module; a family that cannot take
    it (`cache_unsupported`, or a row longer than its sliding window) is scored uncached whole."""
    B, T = completion_ids_BT.shape
    stats = PrefixStats(prompt_tokens=sum(len(p) for p in prompt_ids))
    longest = max(len(p) for p in prompt_ids) + T
    P0 = 0 if prefix is None else len(prefix)
    takes = cache_unsupported(model) is None and fits_window(model, longest)
    ok = [takes and len(p) > P0 and tuple(p[:P0]) == (prefix.ids if prefix is not None else ()) for p in prompt_ids]
    rows = [b for b in range(B) if ok[b]]
    rests = [tuple(prompt_ids[b][P0:]) for b in rows]
    grouped = groups and len(set(rests)) < len(rests)
    if len(rows) == B and P0 == 0 and not grouped:  # nothing to reuse: the uncached forward itself
        stats.encoded_prompt_tokens = stats.prompt_tokens
        return completion_hidden_states(model, prompt_ids, completion_ids_BT, loss_mask_BT, pad_id), stats
    parts: list[tuple[list[int], torch.Tensor]] = []
    if rows:
        idx = torch.tensor(rows, dtype=torch.long)
        if grouped:
            h, encoded = group_pass(model, prefix, rests, completion_ids_BT[idx], loss_mask_BT[idx], pad_id)
        else:
            h, encoded = one_pass(model, prefix, rests, completion_ids_BT[idx], loss_mask_BT[idx], pad_id), \
                sum(len(r) for r in rests)
        parts.append((rows, h))
        stats.encoded_prompt_tokens += encoded
    others = [b for b in range(B) if not ok[b]]
    if others:
        idx = torch.tensor(others, dtype=torch.long)
        parts.append((others, completion_hidden_states(model, [prompt_ids[b] for b in others], completion_ids_BT[idx],
                                                       loss_mask_BT[idx], pad_id)))
        stats.encoded_prompt_tokens += sum(len(prompt_ids[b]) for b in others)
        stats.fallback_rows += len(others)
    return _merged(parts, B), stats


def _merged(parts: list[tuple[list[int], torch.Tensor]], B: int) -> torch.Tensor:
    """Rows computed in parts, back in batch order."""
    if len(parts) == 1 and parts[0][0] == list(range(B)):
        return parts[0][1]
    first = parts[0][1]
    out = first.new_zeros((B, *first.shape[1:]))
    for rows, h in parts:
        out[torch.tensor(rows, dtype=torch.long, device=out.device)] = h
    return out


def hidden_logprobs(model: PreTrainedModel, h_BTH: torch.Tensor, completion_ids_BT: torch.Tensor,
                    loss_mask_BT: torch.Tensor, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK,
                    compiled: bool = False) -> torch.Tensor:
    """log π(y_t | s_t) [B, T] from the hidden states that predict each token (0 where the mask
    is 0): the operations of `completion_logprobs` on the same hidden states."""
    device = h_BTH.device
    valid = loss_mask_BT.to(device).bool()
    values_N = head_logprobs(h_BTH[valid], model.get_output_embeddings().weight, completion_ids_BT.to(device)[valid],
                             temperature, chunk, model_logit_transform(model), compiled)
    out_BT = torch.zeros(valid.shape, dtype=values_N.dtype, device=device)
    return out_BT.masked_scatter(valid, values_N)


@torch.no_grad()
def grouped_logprobs(model: PreTrainedModel, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor,
                     loss_mask_BT: torch.Tensor, pad_id: int, temperature: float = 1.0, compiled: bool = False
                     ) -> torch.Tensor:
    """`completion_logprobs` without gradients, each distinct prompt of the batch encoded once
    (a reference forward over groups of `sampling.n` samples of one prompt); `compiled`: the
    head's chunks through torch.compile."""
    h_BTH, _ = prefixed_hidden_states(model, None, prompt_ids, completion_ids_BT, loss_mask_BT, pad_id)
    return hidden_logprobs(model, h_BTH, completion_ids_BT, loss_mask_BT, temperature, compiled=compiled)


class PrefixStore:
    """The run's cached prefix: the keys and values of one list of ids, encoded on first use and
    again whenever the ids asked for differ (the cache is keyed on the ids themselves, so a
    changed system prompt can never be served another prompt's keys). The model is frozen."""

    def __init__(self, model: PreTrainedModel):
        self.model, self.kv, self.builds = model, None, 0

    def get(self, ids: list[int]) -> PrefixKV | None:
        if not ids:
            return None
        if self.kv is None or self.kv.ids != tuple(ids):
            self.kv = encode_prefix(self.model, ids)
            self.builds += 1
        return self.kv
