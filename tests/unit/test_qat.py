"""FP8 fake quantization (torchao QAT) on the student's Linear layers."""

from __future__ import annotations

import torch

from k3post.config.schema import ModelSpec, TinyModelSpec
from k3post.model.load import load_model
from k3post.model.qat import fake_quant_layers, prepare_fp8_qat, set_fake_quant

SPEC = ModelSpec(tiny=TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, seed=4, init_std=0.05))
X = torch.tensor([[5, 6, 7, 8, 9, 10, 0, 0]])  # ends in padding (id 0: a zero embedding row)


def test_prepare_swaps_eligible_linears_and_keeps_names():
    model, _ = load_model(SPEC)
    keys = set(model.state_dict())
    names = prepare_fp8_qat(model)
    assert len(names) == 2 * 7 and fake_quant_layers(model) == 14  # q,k,v,o,gate,up,down per layer
    assert not any(n.endswith("lm_head") for n in names)
    assert set(model.state_dict()) == keys  # checkpoints and weight sync are unaffected


def test_fake_quant_error_is_fp8_sized_and_can_be_toggled():
    reference, _ = load_model(SPEC)
    model, _ = load_model(SPEC)
    prepare_fp8_qat(model)
    with torch.no_grad():
        exact = reference(input_ids=X).logits
        quantized = model(input_ids=X).logits
        set_fake_quant(model, False)
        off = model(input_ids=X).logits
    assert torch.isfinite(quantized).all()  # zero rows (padding) do not produce NaN
    relative = (quantized - exact).norm() / exact.norm()
    assert 1e-4 < relative < 0.1, relative  # e4m3 rounding: percent-level, not zero, not garbage
    assert torch.equal(off, exact)


def test_gradients_flow_through_fake_quantized_layers():
    model, _ = load_model(SPEC)
    prepare_fp8_qat(model)
    model(input_ids=X).logits.square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if "proj" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
