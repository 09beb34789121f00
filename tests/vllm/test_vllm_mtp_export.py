"""vLLM serves a `draft.hidden: residual` head exported by `k3post export-draft` exactly: its
`mtp` method (MiMo MTP layer) drafts what k3post's head drafts.

The student: a tiny Llama, Qwen2 (its q/k/v biases random) or Qwen3 (its q_norm/k_norm random)
of head size 32 (the CPU attention kernels need it) whose LM head makes greedy text follow a
successor cycle through context-dependent states; the head: a residual MTP head whose projection
is the identity on the embedding plus noise and a random map of the hidden state, and whose block's
attention is scaled up, so it is right about half the time and both its input state and its
attention over its own KV cache matter. Greedy decoding makes
every round deterministic, so the two engines must agree exactly on the tokens (the target: the
student as MiMoForCausalLM, Qwen2 layers with zero q/k/v biases for Llama and `qk_norm` for
Qwen3) and on the number of draft rounds, drafted tokens and accepted tokens (vLLM's spec-decode
counters against k3post's SpeculativeDecoder with the same head), at K = 1 and at K = 2, where the
second draft chains the layer's normalised output. A `final_norm` head written the same way must
not agree (the negative control). Opt-in: K3POST_SLOW=1 (an engine start is
~70 s on a CPU).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from k3post.model.generation.draft_head import MtpHead, residual_stream
from k3post.model.export.mimo_export import write_mimo_checkpoint
from k3post.model.generation.speculative_sampling import SpeculativeDecoder
from k3post.types import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

V, D, STOP = 64, 64, 0  # STOP is never anyone's successor: rows run to their budget in both engines
PROMPTS = [[34, 47, 29], [49, 54, 45, 46, 52, 61, 34], [42, 41, 4, 16], [43, 19, 9, 8, 2],
           [4, 21, 13, 46, 6, 27, 4, 17], [55, 41, 6], [33, 50, 38], [51, 10, 21, 24, 26]]
BUDGET = 24


def family_config(family: str):
    shapes = dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None,
                  eos_token_id=STOP, pad_token_id=STOP)
    if family == "qwen3":
        return Qwen3Config(head_dim=D // 2, **shapes)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](**shapes)


@torch.no_grad()
def perturb_family_parts(module, g: torch.Generator) -> None:
    """Qwen2's q/k/v biases and Qwen3's q_norm/k_norm away from their zeros and ones, so they count."""
    for name, p in module.named_parameters():
        if name.endswith("_proj.bias"):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))


@torch.no_grad()
def student_and_head(family: str = "llama", hidden: str = "residual", seed: int = 0, attention: float = 20.0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family)).eval()
    perturb_family_parts(model, g)
    embed_VD = torch.randn(V, D, generator=g)
    model.model.embed_tokens.weight.copy_(embed_VD)
    successor = torch.cat([torch.tensor([1]), 1 + torch.randperm(V - 1, generator=g)])
    head_VD = torch.zeros(V, D)
    head_VD[successor] = embed_VD / embed_VD.norm(dim=-1, keepdim=True) * 4.0
    model.lm_head.weight.copy_(head_VD)
    # A final norm far from 1: the states before and after it differ in more than their scale.
    model.model.norm.weight.copy_(0.5 + torch.rand(D, generator=g))
    head = MtpHead(model, seed, hidden=hidden)
    # eh_proj: the identity on the embedding plus noise, and a larger random part on the hidden
    # state, so the drafts depend on which state the head reads (the negative control below).
    noise = torch.cat([1.0 * torch.randn(D, D, generator=g), 4.0 * torch.randn(D, D, generator=g)], 1) / D**0.5
    head.eh_proj.weight.copy_(torch.cat([torch.eye(D), torch.zeros(D, D)], 1) + noise)
    head.block.self_attn.o_proj.weight.mul_(attention)
    return model, head


def k3post_rounds(model, head, K: int):
    decoder = SpeculativeDecoder(model, head, STOP, [STOP], K)
    with residual_stream(model) if head.hidden == "residual" else contextlib.nullcontext():
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


@pytest.mark.parametrize("family, K", [("llama", 1), ("llama", 2), ("qwen2", 2), ("qwen3", 2)])
def test_vllm_mtp_drafts_exactly_what_the_k3post_head_drafts(tmp_path, family, K):
    model, head = student_and_head(family)
    write_mimo_checkpoint(model, {k: v.detach() for k, v in head.state_dict().items()}, None, tmp_path / "mimo")
    want_tokens, want = k3post_rounds(model, head, K)
    got_tokens, got = vllm_rounds(tmp_path / "mimo", K)
    print(f"\n{family} K={K}: k3post {want}, vLLM {got}")
    assert got_tokens == want_tokens
    assert 0 < want["accepted"] < want["draft_tokens"]  # both accepted and rejected drafts
    assert got == want


def test_a_final_norm_head_written_the_same_way_drafts_differently_in_vllm(tmp_path):
    """The negative control: the same tensors of a head that reads the states after the final norm
    (what `k3post export-draft` refuses to write) draft otherwise in vLLM than in k3post, and as
    k3post's head drafts when it reads them as a residual head."""
    model, head = student_and_head("llama", hidden="final_norm")
    write_mimo_checkpoint(model, {k: v.detach() for k, v in head.state_dict().items()}, None, tmp_path / "mimo")
    want_tokens, want = k3post_rounds(model, head, 2)
    got_tokens, got = vllm_rounds(tmp_path / "mimo", 2)
    head.hidden = "residual"  # the same tensors read as vLLM reads them
    _, as_vllm_reads_it = k3post_rounds(model, head, 2)
    print(f"\nfinal_norm head K=2: k3post {want}, vLLM {got}, k3post reading it as residual {as_vllm_reads_it}")
    assert got_tokens == want_tokens  # the target is the student either way
    assert got["accepted"] != want["accepted"] and got == as_vllm_reads_it
