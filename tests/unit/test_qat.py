"""FP8 fake quantization (torchao QAT) on the student's Linear layers."""

from __future__ import annotations

import torch

from k3post.config.schema import ModelSpec, TinyModelSpec
from k3post.model.loading.load import load_model
from k3post.model.quant.qat import fake_quant_layers, prepare_fp8_qat, set_fake_quant

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


def _linear_grads(model, fake_quant: bool) -> dict[str, torch.Tensor]:
    model.zero_grad()
    set_fake_quant(model, fake_quant)
    ids = torch.randint(3, 60, (4, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "proj" in n}


def test_gradients_are_straight_through_the_fake_quantizers():
    """The QAT gradient is the full-precision gradient evaluated at the fake-quantized forward:
    close to the plain gradient in direction (cos > 0.99 for FP8's percent-level error) and
    dense. Before the straight-through wrapper, torchao's own backward (an unscaled e4m3 cast
    of the gradient) zeroed 98-99% of every weight gradient and left cosines near 0."""
    model, _ = load_model(SPEC)
    prepare_fp8_qat(model)
    plain, qat = _linear_grads(model, False), _linear_grads(model, True)
    assert len(qat) == 14
    for name, g in qat.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), plain[name].flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))
        assert (g == 0).float().mean() < 0.01, name


def test_torchao_float8_fake_quant_backward_is_still_not_straight_through():
    """Why StraightThrough exists: if this starts failing, a torchao upgrade fixed its backward
    and the wrapper may be dropped."""
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    model, _ = load_model(SPEC)
    prepare_fp8_qat(model)
    for module in model.modules():
        if isinstance(module, FakeQuantizedLinear):  # unwrap: torchao's quantizers alone
            module.activation_fake_quantizer = module.activation_fake_quantizer.inner
            module.weight_fake_quantizer = module.weight_fake_quantizer.inner
    raw = _linear_grads(model, True)
    zero_fraction = sum(float((g == 0).float().mean()) for g in raw.values()) / len(raw)
    assert zero_fraction > 0.5, zero_fraction


def test_straight_through_keeps_torchaos_forward_value_bit_for_bit():
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    model, _ = load_model(SPEC)
    prepare_fp8_qat(model)
    layer = next(m for m in model.modules() if isinstance(m, FakeQuantizedLinear))
    x = torch.randn(5, layer.in_features, requires_grad=True)
    assert torch.equal(layer.activation_fake_quantizer(x), layer.activation_fake_quantizer.inner(x))
    assert torch.equal(layer.weight_fake_quantizer(layer.weight), layer.weight_fake_quantizer.inner(layer.weight))
