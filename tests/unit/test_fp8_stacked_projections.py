"""FP8 rollout Linears stacked by group (model/quant/fp8_linear.py `Fp8Linear.stack_group`), on a CPU.

After an FP8 sync, q/k/v and gate/up hold their e4m3 bytes and scales as views of one stack per
group. Eagerly the model is the model it was (same state dict, same logits bit for bit); a weight
sync lands in the stacks; compiled with Inductor, the common-subexpression pass leaves one GEMM
and one quantisation of the input per group, with both FP8 products (the dequantised one a CPU
runs, and torch._scaled_mm, which runs on a CPU in torch 2.13 too)."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import Qwen2ForCausalLM

from k3post.model.quant.fp8_linear import Fp8Linear, hold_own_weights_in_fp8, hold_payload_forms
from k3post.model.quant.fp8_sync import fp8_payload
from k3post.model.generation.fused_projections import ComputedOnce
from k3post.model.training.weights import import_weights, unique_state
from tests.unit.test_fused_projections import IDS, LAYERS, logits
from tests.unit.test_fused_projections import qwen2 as qwen2_fp32


def qwen2(dtype=torch.float32) -> Qwen2ForCausalLM:  # q, k and v with biases
    return qwen2_fp32().to(dtype)


def unstacked(monkeypatch, model) -> Qwen2ForCausalLM:
    """`model` held in FP8 with no group stacked (each layer its own bytes and scales)."""
    with monkeypatch.context() as m:
        m.setattr(Fp8Linear, "stack_group", classmethod(lambda cls, members: False))
        hold_own_weights_in_fp8(model)
    return model


def test_an_fp8_sync_stacks_each_group_and_the_model_is_the_model_it_was(monkeypatch):
    stacked, plain = qwen2(), unstacked(monkeypatch, qwen2())
    hold_own_weights_in_fp8(stacked)
    attention, mlp = stacked.model.layers[0].self_attn, stacked.model.layers[0].mlp
    assert [attention.q_proj.rows, attention.k_proj.rows, attention.v_proj.rows] == [(0, 64), (64, 96), (96, 128)]
    assert mlp.gate_proj.rows == (0, 96) and mlp.up_proj.rows == (96, 192)
    assert attention.o_proj.rows is None and mlp.down_proj.rows is None  # alone in their input
    assert attention.k_proj.weight_stack.dtype == torch.uint8 and attention.k_proj.scale_stack.shape == (128, 1)
    assert stacked.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(stacked.state_dict().values(), plain.state_dict().values()))
    assert torch.equal(logits(stacked), logits(plain))


def test_a_weight_sync_lands_in_the_stacks_and_a_full_form_leaves_them(monkeypatch):
    stacked, plain = qwen2(), unstacked(monkeypatch, qwen2())
    hold_own_weights_in_fp8(stacked)
    source = qwen2()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.01 * torch.randn_like(p))
    layers = [n for n, m in stacked.named_modules() if isinstance(m, Fp8Linear)]
    payload = {k: torch.as_tensor(v) for k, v in fp8_payload(unique_state(source), layers).items()}
    import_weights(stacked, payload)
    import_weights(plain, payload)
    mlp = stacked.model.layers[1].mlp
    want = torch.cat([payload[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    assert torch.equal(mlp.gate_proj.weight_stack, want)
    assert torch.equal(mlp.up_proj.scale_stack, torch.cat([payload[f"model.layers.1.mlp.{n}_proj.weight_scale"]
                                                           for n in ("gate", "up")]))
    assert torch.equal(logits(stacked), logits(plain))
    hold_payload_forms(stacked, unique_state(source))
    assert mlp.gate_proj.rows is None and not hasattr(mlp.gate_proj, "weight_stack")


def test_a_copy_of_a_stacked_model_syncs_into_its_own_stacks():
    """A deep copy's members are views of its own copied stacks (one per group), as the original's:
    a sync into the copy reaches what its compiled path reads, and leaves the original alone."""
    import copy  # noqa: PLC0415

    from tests.unit.test_fused_projections import stacked_logits  # noqa: PLC0415

    original = qwen2()
    hold_own_weights_in_fp8(original)
    before, twin = logits(original), copy.deepcopy(original)
    attention = twin.model.layers[0].self_attn
    assert attention.q_proj.weight_stack is attention.k_proj.weight_stack is not original.model.layers[
        0].self_attn.q_proj.weight_stack
    source = qwen2()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    layers = [n for n, m in twin.named_modules() if isinstance(m, Fp8Linear)]
    import_weights(twin, {k: torch.as_tensor(v) for k, v in fp8_payload(unique_state(source), layers).items()})
    assert torch.equal(stacked_logits(twin), logits(twin)) and not torch.allclose(logits(twin), before, atol=1e-3)
    assert torch.equal(logits(original), before) and torch.equal(stacked_logits(original), before)


class Counted(ComputedOnce):
    """The pass (or none), then a count of the input quantisations left (one amax each)."""

    def __init__(self, merge: bool):
        self.merge, self.amax = merge, -1

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.merge:
            super().__call__(graph)
        self.amax = sum(n.target is torch.ops.aten.amax.default for n in graph.nodes)


def compiled(model, merge: bool = True) -> tuple[int, int, torch.Tensor]:
    """(GEMM calls in the code Inductor generates, input quantisations left, the logits)."""
    from torch._inductor.utils import run_and_get_code  # noqa: PLC0415

    torch._dynamo.reset()
    counted = Counted(merge)
    options = {"post_grad_custom_pre_pass": counted, "fx_graph_cache": False}
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(model, dynamic=False, options=options), input_ids=IDS)
    torch._dynamo.reset()
    return len(re.findall(r"(?:extern_kernels\.(?:addmm|mm|bmm)|_scaled_mm)\(", "\n".join(code))), counted.amax, out.logits


@pytest.mark.parametrize("scaled_mm", [False, True], ids=["dequantised", "scaled_mm"])
def test_compiled_each_group_quantises_its_input_once_and_runs_one_gemm(monkeypatch, scaled_mm):
    dtype = torch.bfloat16 if scaled_mm else torch.float32  # the row-wise FP8 GEMM writes bf16 only
    stacked, plain = qwen2(dtype), unstacked(monkeypatch, qwen2(dtype))
    hold_own_weights_in_fp8(stacked)
    for model in (stacked, plain):
        for m in model.modules():
            if isinstance(m, Fp8Linear):
                m.fp8_gemm = scaled_mm
    plain_gemms, plain_amax, _ = compiled(plain)
    gemms, amax, out = compiled(stacked)
    # Seven quantised projections a layer, four inputs: q/k/v and gate/up become one GEMM each,
    # and every input is quantised once (unstacked too: the members' quantisations are one expression).
    assert gemms == plain_gemms - 3 * LAYERS
    assert (plain_amax, amax) == (4 * LAYERS, 4 * LAYERS)
    if scaled_mm:  # the control, once (a third compile): without the pass nothing merges, whichever the product
        gemms_unmerged, amax_unmerged, _ = compiled(stacked, merge=False)
        assert gemms_unmerged == plain_gemms  # each member's GEMM of its whole group: the pass is what merges them
        assert amax_unmerged == 7 * LAYERS
    tolerance = 2e-2 if scaled_mm else 1e-5
    torch.testing.assert_close(out.float(), logits(plain).float(), atol=tolerance, rtol=0)

