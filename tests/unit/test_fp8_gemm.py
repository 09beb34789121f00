"""The FP8 numerics (algo/fp8.py) and the sampler's FP8 Linear (model/quant/fp8_linear.py), on a CPU.

- The grid is torchao's: `quantize_rows` + `dequantize_rows` equal torchao's Float8FakeQuantizer
  (PerRow) bit for bit, for weights and for activations (with the amax floor), fp32 and bf16.
- The real FP8 GEMM (`torch._scaled_mm`, which runs on a CPU in torch 2.13) computes the QAT
  forward's product: against the dequantised form it differs only by fp32 rounding, within the
  bound of algo/fp8.py's docstring, and in bf16 by bf16 rounding of the output and operands.
- An `Fp8Linear` holding FP8 computes exactly the learner's fake-quantised forward on a CPU, takes
  either form a payload carries, and a sync in the same form copies in place.
(The kernel on a GPU with FP8 tensor cores: tests/gpu/test_fp8_gemm_cuda.py.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3post.algo.fp8 import (E4M3_MAX, dequantize_rows, fake_quantize_rows, fp8_gemm_available, linear_dequantised,
                             linear_scaled_mm, quantize_rows)
from k3post.model.quant.qat import ACTIVATION_AMAX_FLOOR, prepare_fp8_qat

U32 = 2.0**-24  # fp32 unit roundoff


def torchao_quantizer(amax_floor: float | None = None):
    from torchao.quantization import PerRow
    from torchao.quantization.qat import Float8FakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import Float8FakeQuantizer

    return Float8FakeQuantizer(Float8FakeQuantizeConfig(granularity=PerRow(), hp_value_lb=amax_floor))


def spread(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Values over many binades (exercises e4m3's subnormals and the clamp)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.exp(2 * torch.randn(*shape, generator=g))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_and_activations_land_on_torchaos_grid_bit_for_bit(dtype):
    w = spread(48, 64, dtype=dtype)
    assert torch.equal(fake_quantize_rows(w), torchao_quantizer()(w))
    x = spread(3, 5, 64, dtype=dtype, seed=1)
    x[0, 2] = 0  # a padding token's zero embedding: the floor keeps it finite
    want = torchao_quantizer(ACTIVATION_AMAX_FLOOR)(x)
    assert torch.equal(fake_quantize_rows(x, ACTIVATION_AMAX_FLOOR), want) and torch.isfinite(want).all()


def test_the_scales_are_per_row_and_the_values_e4m3():
    w = spread(16, 32)
    q, s = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (16, 1)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((16,), E4M3_MAX))  # each row's largest hits 448
    zero = torch.zeros(2, 32)
    assert torch.equal(dequantize_rows(*quantize_rows(zero), torch.float32), zero)  # an all-zero row stays zero


def operands(m: int = 7, k: int = 64, n: int = 48, dtype=torch.float32):
    x, w, b = spread(m, k, dtype=dtype, seed=2), spread(n, k, dtype=dtype, seed=3), spread(n, dtype=dtype, seed=4)
    q_w, s_w = quantize_rows(w)
    return x, q_w, s_w, b


def test_the_scaled_gemm_differs_from_the_dequantised_product_by_fp32_rounding_only():
    """fp32: |Δ| ≤ (2K + 4)·u·Σ_k |x̃_k w̃_k| (algo/fp8.py), and both agree with the exact product
    (float64 of the same dequantised operands) to the same order."""
    x, q_w, s_w, b = operands()
    k = x.shape[-1]
    scaled = linear_scaled_mm(x, q_w, s_w, b, ACTIVATION_AMAX_FLOOR)
    deq = linear_dequantised(x, q_w, s_w, b, torch.float32, ACTIVATION_AMAX_FLOOR)
    x_t, w_t = fake_quantize_rows(x, ACTIVATION_AMAX_FLOOR).double(), dequantize_rows(q_w, s_w, torch.float64)
    bound = (2 * k + 4) * U32 * (x_t.abs() @ w_t.abs().T + b.double().abs())
    exact = x_t @ w_t.T + b.double()
    assert scaled.dtype == torch.float32 and scaled.shape == deq.shape
    assert ((scaled.double() - deq.double()).abs() <= bound).all()
    assert ((scaled.double() - exact).abs() <= bound).all() and ((deq.double() - exact).abs() <= bound).all()


def test_in_bf16_the_scaled_gemm_rounds_once_where_the_dequantised_form_rounds_its_operands():
    """bf16: the scaled GEMM is the exact product rounded to bf16, then the bias added in bf16 (two
    roundings of ≤ 2⁻⁹ relative, plus fp32 accumulation); the dequantised form first rounds x̃ and
    W̃ to bf16 (≤ 2⁻⁹ each, so ≤ 2⁻⁸ per term) and then the output: to first order within
    3·2⁻⁹·(Σ|x̃ w̃| + |b|), asserted with a factor 2 of slack for the second-order terms."""
    x, q_w, s_w, b = operands(dtype=torch.bfloat16)
    k = x.shape[-1]
    scaled = linear_scaled_mm(x, q_w, s_w, b, ACTIVATION_AMAX_FLOOR)
    deq = linear_dequantised(x, q_w, s_w, b, torch.bfloat16, ACTIVATION_AMAX_FLOOR)
    q_x, s_x = quantize_rows(x, ACTIVATION_AMAX_FLOOR)
    x_t, w_t = q_x.double() * s_x.double(), q_w.double() * s_w.double()
    product, terms, bias = x_t @ w_t.T, x_t.abs() @ w_t.abs().T, b.double()
    assert scaled.dtype == torch.bfloat16
    assert ((scaled.double() - (product + bias)).abs()
            <= 2**-8 * (product.abs() + (product + bias).abs()) + 2 * k * U32 * terms).all()
    assert ((deq.double() - (product + bias)).abs() <= 2 * 3 * 2**-9 * (terms + bias.abs())).all()
    assert not torch.equal(scaled, deq)  # different roundings: the real kernel is not the reference path


def test_the_real_gemm_runs_only_on_a_gpu_with_fp8_tensor_cores():
    assert not fp8_gemm_available(torch.device("cpu"))  # a CPU: the dequantised form


def fp8_layer(dtype=torch.float32, bias: bool = True):
    """A QAT Linear as the learner has it, and the same as a sampler's Fp8Linear holding its FP8."""
    from k3post.model.quant.fp8_linear import Fp8Linear, use_fp8_linears

    torch.manual_seed(0)
    learner = nn.Sequential(nn.Linear(64, 32, bias=bias)).to(dtype)
    prepare_fp8_qat(learner)
    sampler = nn.Sequential(nn.Linear(64, 32, bias=bias)).to(dtype)
    prepare_fp8_qat(sampler)
    assert use_fp8_linears(sampler) == ["0"] and isinstance(sampler[0], Fp8Linear)
    return learner, sampler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_linear_holding_the_learners_fp8_is_its_qat_forward_bit_for_bit(dtype):
    learner, sampler = fp8_layer(dtype)
    q, s = quantize_rows(learner[0].weight.detach())
    sampler[0].hold_fp8()
    with torch.no_grad():
        sampler[0].weight.copy_(q.view(torch.uint8))
        sampler[0].weight_scale.copy_(s)
        sampler[0].bias.copy_(learner[0].bias)
    x = spread(2, 5, 64, dtype=dtype, seed=5)
    with torch.no_grad():
        assert torch.equal(sampler(x), learner(x))


def test_a_layer_takes_the_form_the_payload_carries_and_a_same_form_sync_copies_in_place():
    from k3post.model.quant.fp8_linear import hold_payload_forms

    _, sampler = fp8_layer()
    layer = sampler[0]
    full = {"0.weight": torch.zeros(32, 64), "0.bias": torch.zeros(32)}
    fp8 = {"0.weight": torch.zeros(32, 64, dtype=torch.uint8), "0.weight_scale": torch.ones(32, 1),
           "0.bias": torch.zeros(32)}
    hold_payload_forms(sampler, fp8)
    where = (layer.weight.data_ptr(), layer.weight_scale.data_ptr())
    assert layer.holds_fp8 and layer.weight.dtype == torch.uint8 and set(sampler.state_dict()) == set(fp8)
    hold_payload_forms(sampler, fp8)
    assert (layer.weight.data_ptr(), layer.weight_scale.data_ptr()) == where  # nothing reallocated
    hold_payload_forms(sampler, full)
    assert not layer.holds_fp8 and layer.weight.dtype == torch.float32 and set(sampler.state_dict()) == set(full)
    with pytest.raises(ValueError, match="does not quantise"):
        hold_payload_forms(sampler, {**fp8, "1.weight_scale": torch.ones(1, 1)})


def test_a_model_holding_its_own_weights_in_fp8_computes_its_qat_forward(tiny_spec):
    """`hold_own_weights_in_fp8` (the benchmark's FP8 student): the logits of the model after an
    FP8 sync of its own weights are those of its fake-quantised QAT forward, bit for bit."""
    from k3post.model.quant.fp8_linear import Fp8Linear, hold_own_weights_in_fp8
    from k3post.model.loading.load import load_model

    qat, _ = load_model(tiny_spec)
    prepare_fp8_qat(qat)
    fp8, _ = load_model(tiny_spec)
    layers = hold_own_weights_in_fp8(fp8)
    held = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    assert len(held) == len(layers) > 0 and all(m.holds_fp8 and not m.fp8_gemm for m in held)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fp8(ids).logits, qat(ids).logits)
