"""A transplant's output head that keeps the old model's next-token probabilities (`head: chain`).

With the tied mean head (model/tokenizers/transplant.py) the logit of a new token t whose text the old
tokenizer splits into o_1 … o_k is the mean of its pieces' logits. That is a poor guess of
log P(t): a digit run "2026" scores like one average digit, and a 12k BPE trained on text with
numbers holds ~300 such runs, so together they take ~16% of the first token's probability and
the transplanted model writes digits. What the head should give is the chain rule over the old
tokens,

    log P_new(t | ctx) ≈ log P_old(o_1 | ctx) + Σ_{j≥2} log P_old(o_j | ctx, o_<j),

whose first term is the old logit of o_1 (up to the normaliser, which softmax ignores) and whose
sum we approximate without the context: c(t) = Σ_{j≥2} log P_old(o_j | o_<j), the old model
scoring t's own pieces (c = 0 for a one-piece token). A head has no bias, but the final hidden
states of a trained LM have a direction u with h·u ≈ 1 at every position (fitted by least squares
on corpus text: on SmolLM2, 1 ± 0.04 on held-out positions), so a per-token constant fits into
the row itself:

    W_new[t] = W_old[o_1] + c(t) · u        ⇒   h·W_new[t] ≈ h·W_old[o_1] + c(t).

The head is then its own matrix (tie_word_embeddings false); the input rows stay the means.
Tokens with no old counterpart get the mean old row, as on the input side.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

FIT_TEXTS, FIT_TOKENS = 64, 128  # corpus texts (their first tokens) the direction u is fitted on
RIDGE = 1e-3


def constant_direction(hidden_N_H: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """u minimising Σ_n (h_n·u − 1)² + ridge·|u|² (fp64 normal equations) over final hidden states."""
    h = hidden_N_H.double()
    eye = torch.eye(h.shape[1], dtype=h.dtype)
    return torch.linalg.solve(h.T @ h + ridge * eye, h.T @ torch.ones(h.shape[0], dtype=h.dtype))


@torch.no_grad()
def final_hidden_states(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str],
                        max_tokens: int = FIT_TOKENS) -> torch.Tensor:
    """The hidden states the head reads (after the final norm) at every position of `texts`
    (each cut to `max_tokens`), as one [N, H] matrix."""
    rows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :max_tokens]
        if ids.shape[1]:
            rows.append(model.get_decoder()(input_ids=ids).last_hidden_state[0].float())
    return torch.cat(rows)


@torch.no_grad()
def continuation_logprobs(model: PreTrainedModel, pieces: list[list[int]], pad_id: int, batch: int = 64
                          ) -> torch.Tensor:
    """c[t] = Σ_{j≥2} log P(o_j | o_1 … o_{j-1}) under `model` for each list of ids (0 for lists
    of fewer than two ids): the pieces scored as a text of their own, batched right-padded (a
    batch holds [batch, longest, vocabulary] logits: 64 keeps that ~0.2 GB at 49k tokens)."""
    out = torch.zeros(len(pieces))
    todo = sorted((i for i, p in enumerate(pieces) if len(p) > 1), key=lambda i: len(pieces[i]))  # little padding
    for start in range(0, len(todo), batch):
        chunk = todo[start:start + batch]
        L = max(len(pieces[i]) for i in chunk)
        ids = torch.tensor([pieces[i] + [pad_id] * (L - len(pieces[i])) for i in chunk])
        mask = torch.tensor([[1] * len(pieces[i]) + [0] * (L - len(pieces[i])) for i in chunk])
        logprobs = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float().log_softmax(-1)
        picked = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
        out[chunk] = picked.sum(-1)
    return out


def chain_head_rows(old_head_V_H: torch.Tensor, old_ids: list[list[int]], continuation: torch.Tensor,
                    direction_H: torch.Tensor) -> torch.Tensor:
    """Row t = old_head[o_1(t)] + continuation[t] · u; a token with no old piece gets the mean old
    row (no continuation term). [len(old_ids), H] in old_head's dtype."""
    old = old_head_V_H.detach().float()
    first = torch.tensor([ids[0] if ids and ids[0] < old.shape[0] else -1 for ids in old_ids])
    rows = torch.where((first >= 0)[:, None], old[first.clamp(min=0)], old.mean(0))
    rows += continuation.float()[:, None] * direction_H.float()[None]
    return rows.to(old_head_V_H.dtype)


def chain_head(model: PreTrainedModel, old_tokenizer: PreTrainedTokenizerBase, old_ids: list[list[int]],
               texts: list[str]) -> torch.Tensor:
    """The `head: chain` rows for the new vocabulary from the untouched old `model` (call before
    resizing): the direction fitted on the first FIT_TEXTS of `texts`, the continuations of every
    new token's old pieces."""
    direction_H = constant_direction(final_hidden_states(model, old_tokenizer, texts[:FIT_TEXTS]))
    pad = old_tokenizer.pad_token_id if old_tokenizer.pad_token_id is not None else old_tokenizer.eos_token_id
    rows = model.get_output_embeddings().weight.shape[0]
    continuation = continuation_logprobs(model, [[j for j in ids if j < rows] for ids in old_ids], pad_id=pad)
    return chain_head_rows(model.get_output_embeddings().weight, old_ids, continuation, direction_H)
