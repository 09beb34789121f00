"""Stops inside speculative rounds, on the real decoders (the plain HF engine's and the static-cache
engine's) with a draft that is always accepted.

The student is a real one-layer LlamaForCausalLM whose weights make it a bigram table: attention
and MLP outputs are zero, so the hidden state at t is the normalised embedding of x_t, and its
LM head puts logit 4·10 on one successor of each token (p(successor) = 1 − O(e^-40)). The head
copies it: eh_proj picks the embedding of x_{t+1}, its block (a copy of the student's) adds
nothing, so q(x_{t+2}) is the student's own p(x_{t+2} | x_{t+1}) at every draft depth. Greedy
drafts are then accepted with certainty, so the rounds are known in advance:

- EOS as an accepted draft ends the row there (the later drafts and the bonus are dropped) while
  another row of the batch goes on;
- `max_new_tokens` reached inside a round of accepted drafts truncates the row exactly at the
  budget, for every K and budget.

Expected outputs come from the successor table (closed form); stored logprobs from a teacher-forced
recompute of the student.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from k3post.model.generation.draft_head import MtpHead
from k3post.model.generation.fast_sampling import StaticSampler
from k3post.model.generation.fast_speculation import StaticSpeculativeDecoder
from k3post.model.scoring.logprobs import completion_logprobs
from k3post.model.generation.speculative_sampling import SpeculativeDecoder
from k3post.types import SamplingParams

V, D, EOS, PAD = 12, 16, 3, 0
# 1 → 5 → 6 → EOS (→ 7): a reply that ends; 2 → 8 → 9 → 10 → 8 → ...: one that never does.
SUCCESSOR = {1: 5, 5: 6, 6: EOS, EOS: 7, 7: 7, 2: 8, 8: 9, 9: 10, 10: 8, 4: 4, 11: 11, PAD: PAD}


@torch.no_grad()
def bigram_student() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS,
                         bos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).double().eval()
    layer = model.model.layers[0]
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.down_proj.weight.zero_()
    model.model.embed_tokens.weight.copy_(torch.eye(V, D))
    head_VD = torch.zeros(V, D, dtype=torch.float64)
    for token, successor in SUCCESSOR.items():
        head_VD[successor, token] = 10.0
    model.lm_head.weight.copy_(head_VD)
    return model


@torch.no_grad()
def copying_head(model) -> MtpHead:
    head = MtpHead(model, 0)
    head.eh_proj.weight.copy_(torch.cat([torch.eye(D), torch.zeros(D, D)], 1))  # [enorm(E x_{t+1}); hnorm(h_t)]
    return head


def greedy_reply(prompt: list[int], budget: int) -> list[int]:
    reply, token = [], prompt[-1]
    while len(reply) < budget and (not reply or reply[-1] != EOS):
        token = SUCCESSOR[token]
        reply.append(token)
    return reply


@pytest.fixture(params=["dynamic", "static"])
def cache(request) -> str:
    """Each stop test runs on the plain engine's decoder and on the static-cache engine's."""
    return request.param


def sample(prompts: list[list[int]], K: int, budget: int, cache: str, greedy: bool = True):
    model = bigram_student()
    decoder = (SpeculativeDecoder(model, copying_head(model), PAD, [EOS], K) if cache == "dynamic" else
               StaticSpeculativeDecoder(StaticSampler(model, PAD, [EOS], min_bucket=1), copying_head(model), K))
    out, stats = decoder.sample(prompts, SamplingParams(budget, 1.0, 1.0, seed=0), greedy=greedy)
    recomputed = completion_logprobs(model, prompts, out.completion_ids_BT, out.loss_mask_BT, PAD, 1.0)
    return out, stats, recomputed


def replies(out) -> list[list[int]]:
    lengths = out.loss_mask_BT.sum(1).long().tolist()
    return [row[:n] for row, n in zip(out.completion_ids_BT.tolist(), lengths)]


def test_the_copying_head_always_agrees_with_the_student():
    model = bigram_student()
    head = copying_head(model)
    ids = torch.tensor([[1, 5, 6, EOS, 7, 2, 8, 9, 10]])
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state
        g = head(h[:, :-1], ids[:, 1:], torch.arange(ids.shape[1] - 1)[None])
        draft, student = head.logits(g[0]), head.student_logits(h[0, 1:])
    assert torch.allclose(torch.softmax(draft, -1), torch.softmax(student, -1), atol=1e-9)
    assert [SUCCESSOR[t] for t in ids[0, 1:].tolist()] == draft.argmax(-1).tolist()


def test_an_eos_drawn_as_an_accepted_draft_ends_its_row_while_the_other_row_goes_on(cache):
    """K = 3: the prefill emits 5; the first round drafts 6, EOS, 7, all accepted: the row keeps
    6, EOS and stops; the other row runs on to its budget of 7 tokens, which it reaches inside its
    second round (9 + 10, 8, 9 + bonus 10 would be 8 tokens)."""
    out, stats, recomputed = sample([[1], [2]], K=3, budget=7, cache=cache)
    assert replies(out) == [[5, 6, EOS], [8, 9, 10, 8, 9, 10, 8]]
    assert stats.accepted == stats.drafted == 3 * stats.row_rounds  # every draft accepted: EOS was one of them
    assert stats.row_rounds == 3  # row 1: one round; row 2: two
    assert (recomputed - out.logprobs_BT).abs().max() < 1e-9
    assert (out.logprobs_BT[out.loss_mask_BT == 0] == 0).all()


@pytest.mark.parametrize("K", [1, 2, 3])
def test_max_new_tokens_reached_inside_a_round_truncates_at_the_budget(K, cache):
    """Every budget from 1 to 8 tokens: each lands at a different slot of a round of accepted
    drafts (or on its bonus token); the reply is the greedy one cut at the budget, no longer."""
    for budget in range(1, 9):
        out, stats, recomputed = sample([[2], [4, 2]], K=K, budget=budget, cache=cache)
        assert replies(out) == [greedy_reply([2], budget), greedy_reply([4, 2], budget)], budget
        assert stats.accepted == stats.drafted
        assert stats.emitted == 2 * (budget - 1)  # the prefill emitted the first token of each row
        assert (recomputed - out.logprobs_BT).abs().max() < 1e-9


def test_sampled_rounds_stop_the_same_way(cache):
    """At temperature 1 the student is still near-certain (p(successor) = 1 − 11·e^-40), and q = p,
    so min(1, p/q) = 1: the sampled rounds emit what the greedy ones do, EOS and budgets included."""
    out, stats, _ = sample([[1], [2], [6]], K=2, budget=5, cache=cache, greedy=False)
    assert replies(out) == [[5, 6, EOS], [8, 9, 10, 8, 9], [EOS]]
    assert stats.accepted == stats.drafted
