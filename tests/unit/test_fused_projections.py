"""model/generation/fused_projections.py: q/k/v and gate/up stacked into one GEMM each for compiled samplers.

Eagerly a fused model is the model it was (same state dict, same logits bit for bit); a weight
sync lands in the stacks; and compiled with Inductor (on the CPU here, as on a GPU) the pass keeps
one GEMM per group, with the eager model's logits."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from k3post.model.generation.fused_projections import ComputedOnce, RowsOf, fuse_projections

LAYERS = 2


def qwen2() -> Qwen2ForCausalLM:  # q, k and v with biases
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def llama() -> LlamaForCausalLM:  # no biases
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


IDS = torch.tensor([[5, 17, 3, 40, 41, 9, 2, 77], [1, 2, 3, 4, 5, 6, 7, 8]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("build", [qwen2, llama])
def test_a_fused_model_is_the_model_it_was_when_run_eagerly(build):
    plain = build()
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused) == 2 * LAYERS  # attention and MLP of every layer
    assert isinstance(fused.model.layers[0].self_attn.k_proj, RowsOf)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(fused.state_dict().values(), plain.state_dict().values()))
    assert torch.equal(logits(fused), logits(plain))


def test_a_weight_sync_lands_in_the_stacks():
    plain, fused = qwen2(), qwen2()
    fuse_projections(fused)
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in plain.state_dict().items()}
    plain.load_state_dict(new)
    fused.load_state_dict(new)  # what import_weights does: copies in place
    attention = fused.model.layers[1].self_attn
    stacked = torch.cat([new[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attention.q_proj.weight_stack, stacked)
    assert torch.equal(attention.v_proj.bias_stack, torch.cat([new[f"model.layers.1.self_attn.{n}_proj.bias"]
                                                               for n in "qkv"]))
    assert torch.equal(logits(fused), logits(plain))


def stacked_logits(model) -> torch.Tensor:
    """The logits the compiled path computes: each member from its group's stack (RowsOf under
    torch.compile), run eagerly here so that a stale stack shows as a difference."""
    from unittest import mock  # noqa: PLC0415

    with mock.patch("torch.compiler.is_compiling", return_value=True):
        return logits(model)


@pytest.mark.parametrize("build", [qwen2, llama])
def test_a_copy_of_a_fused_model_keeps_its_rows_in_its_own_stacks(build):
    """A deep copy (the draft head copies the sampler's last block, fused once the sampler compiles)
    has members that are views of one copied stack per group, as the original's: a weight sync into
    the copy reaches the stacks the compiled path reads, and the original keeps its own."""
    original = build()
    fuse_projections(original)
    before = logits(original)
    twin = copy.deepcopy(original)
    attention = twin.model.layers[1].self_attn
    assert attention.q_proj.weight_stack is attention.v_proj.weight_stack  # one stack per group, as fused
    assert attention.q_proj.weight_stack is not original.model.layers[1].self_attn.q_proj.weight_stack
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in original.state_dict().items()}
    twin.load_state_dict(new)
    assert torch.allclose(stacked_logits(twin), logits(twin), atol=1e-6)  # the stacks hold the synced rows
    assert not torch.allclose(logits(twin), before, atol=1e-3)
    assert torch.equal(logits(original), before) and torch.equal(stacked_logits(original), before)


def gemms(model, passes: bool) -> tuple[int, torch.Tensor]:
    """(GEMM calls in the code Inductor generates for the forward, the compiled logits)."""
    from torch._inductor.utils import run_and_get_code  # noqa: PLC0415

    torch._dynamo.reset()
    options = {"post_grad_custom_pre_pass": ComputedOnce()} if passes else {}
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(model, dynamic=False, options=options), input_ids=IDS)
    torch._dynamo.reset()
    return len(re.findall(r"extern_kernels\.(?:addmm|mm|bmm)\(", "\n".join(code))), out.logits


def test_compiled_the_pass_runs_each_groups_gemm_once():
    plain, fused = qwen2(), qwen2()
    fuse_projections(fused)
    unfused_count, _ = gemms(plain, passes=True)
    fused_count, fused_logits = gemms(fused, passes=True)
    without_pass, _ = gemms(fused, passes=False)
    # Seven projections a layer, then q/k/v and gate/up as one GEMM each: three fewer a layer.
    assert fused_count == unfused_count - 3 * LAYERS
    assert without_pass == unfused_count  # each member's GEMM of its whole group: the pass is what merges them
    torch.testing.assert_close(fused_logits, logits(plain), atol=1e-5, rtol=0)


def test_a_quantised_or_mismatched_group_is_left_alone():
    model = llama()
    attention = model.model.layers[0].self_attn
    attention.v_proj = torch.nn.Linear(64, 32, bias=True)  # one member with a bias: not stackable
    assert fuse_projections(model) == 2 * LAYERS - 1
    assert type(attention.q_proj) is torch.nn.Linear
