"""vLLM serves a `draft.hidden: residual` head exported by `k3post export-draft` exactly: its
`mtp` method (MiMo MTP layer) drafts what k3post's head drafts.

The student: a tiny Llama (head size 32, as the CPU attention kernels need) whose LM head makes
greedy text follow a successor cycle through context-dependent states; the head: a residual MTP
head whose projection is the identity on the embedding plus noise and whose block's attention is
scaled up, so it is right about half the time and its attention over its own KV cache matters.
Greedy decoding makes every round deterministic, so the two engines must agree exactly on:
the tokens (the target: the student as MiMoForCausalLM, Qwen2 layers with zero q/k/v biases), the
number of draft rounds, drafted tokens and accepted tokens (vLLM's spec-decode counters against
k3post's SpeculativeDecoder with the same head), for K = 1 and for K = 2, where the second draft
chains the layer's normalised output. Opt-in: K3POST_SLOW=1 (an engine start is ~70 s on a CPU).
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from k3post.model.draft_head import MtpHead, residual_stream
from k3post.model.mimo_export import write_mimo_checkpoint
from k3post.model.speculative_sampling import SpeculativeDecoder
from k3post.types import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

V, D, STOP = 64, 64, 0  # STOP is never anyone's successor: rows run to their budget in both engines
PROMPTS = [[3, 7, 11, 19, 23], [5, 9], [40, 41, 42, 43, 44, 45, 46]]
BUDGET = 24


@torch.no_grad()
def student_and_head(seed: int = 0, noise: float = 2.0, attention: float = 20.0):
    g = torch.Generator().manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=STOP, pad_token_id=STOP)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    embed_VD = torch.randn(V, D, generator=g)
    model.model.embed_tokens.weight.copy_(embed_VD)
    successor = torch.cat([torch.tensor([1]), 1 + torch.randperm(V - 1, generator=g)])
    head_VD = torch.zeros(V, D)
    head_VD[successor] = embed_VD / embed_VD.norm(dim=-1, keepdim=True) * 4.0
    model.lm_head.weight.copy_(head_VD)
    head = MtpHead(model, seed, hidden="residual")
    identity = torch.cat([torch.eye(D), torch.zeros(D, D)], 1)
    head.eh_proj.weight.copy_(identity + noise * torch.randn(D, 2 * D, generator=g) / D**0.5)
    head.block.self_attn.o_proj.weight.mul_(attention)
    return model, head


def k3post_rounds(model, head, K: int):
    decoder = SpeculativeDecoder(model, head, STOP, [STOP], K)
    with residual_stream(model):
        out, stats = decoder.sample(PROMPTS, SamplingParams(BUDGET, 1.0, 1.0, 0), greedy=True)
    tokens = [row[:int(n)] for row, n in zip(out.completion_ids_BT.tolist(), out.loss_mask_BT.sum(1).tolist())]
    return tokens, {"drafts": stats.row_rounds, "draft_tokens": stats.drafted, "accepted": stats.accepted}


def vllm_rounds(directory, K: int):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(directory), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
              kv_cache_memory_bytes=2**28, generation_config="vllm", disable_log_stats=False, seed=0,
              speculative_config={"method": "mtp", "num_speculative_tokens": K})
    params = VllmParams(max_tokens=BUDGET, temperature=0.0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num")
                and hasattr(m, "value")}
    tokens = [list(out.outputs[0].token_ids) for out in outs]
    return tokens, {"drafts": counters["vllm:spec_decode_num_drafts"],
                    "draft_tokens": counters["vllm:spec_decode_num_draft_tokens"],
                    "accepted": counters["vllm:spec_decode_num_accepted_tokens"]}


@pytest.mark.parametrize("K", [1, 2])
def test_vllm_mtp_drafts_exactly_what_the_k3post_head_drafts(tmp_path, K):
    model, head = student_and_head()
    write_mimo_checkpoint(model, {k: v.detach() for k, v in head.state_dict().items()}, None, tmp_path / "mimo")
    want_tokens, want = k3post_rounds(model, head, K)
    got_tokens, got = vllm_rounds(tmp_path / "mimo", K)
    print(f"\nK={K}: k3post {want}, vLLM {got}")
    assert got_tokens == want_tokens
    assert 0 < want["accepted"] < want["draft_tokens"]  # both accepted and rejected drafts
    assert got == want
