"""FP8 quantization-aware training with torchao (fake quantization of Linear layers).

`prepare_fp8_qat` swaps each eligible `nn.Linear` for torchao's `FakeQuantizedLinear`: in the
forward pass the weight is rounded to float8 e4m3 with one scale per output row
(scale = amax|w_row| / 448) and the input activations with one scale per token, then both are
dequantized, so training sees the FP8 serving error while the weights stay in full precision.

The backward pass is a straight-through estimator: ∂(fake_quant(x))/∂x = I. torchao 0.18's float8
fake quantizer has no such estimator — autograd differentiates its ops, so the incoming
gradient is itself cast to e4m3 *unscaled* (everything below ~2e-3 becomes 0) and flows through
the amax of the scale. Measured on a tiny Llama: 98–99% of every Linear's weight gradient was
zero and its cosine with the true gradient was ~0 (tests/unit/test_qat.py), so QAT barely
trained the Linear layers. `prepare_fp8_qat` therefore wraps each of torchao's quantizers in
`StraightThrough`: the forward value is torchao's, bit for bit; the gradient is the identity.
Parameter names do not change, so checkpoints, weight sync and the reference buffers work
unchanged.

Skipped: the LM head (it stays in high precision when served) and Linears whose dimensions
are not multiples of 16 (the FP8 GEMM kernels reject them).
"""

from __future__ import annotations

import torch
from torch import nn

FP8_ALIGN = 16
ACTIVATION_AMAX_FLOOR = 1e-12


def fp8_eligible(module: nn.Module, name: str) -> bool:
    return (isinstance(module, nn.Linear) and not name.endswith("lm_head")
            and module.in_features % FP8_ALIGN == 0 and module.out_features % FP8_ALIGN == 0)


class _Identity(torch.autograd.Function):
    """Forward: the given quantized value. Backward: the incoming gradient, unchanged, to x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return q

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class StraightThrough(nn.Module):
    """A fake quantizer whose forward is `inner`'s and whose backward is the identity.

    The quantized value is computed without autograd (nothing of it is kept for backward) and
    returned through `_Identity`, whose backward hands the gradient to x as it is; `enabled` is
    the inner quantizer's switch (set_fake_quant flips it).
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    @property
    def enabled(self) -> bool:
        return self.inner.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.inner.enabled = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inner.enabled:
            return x
        with torch.no_grad():
            q = self.inner(x)
        return _Identity.apply(x, q)


def prepare_fp8_qat(model: nn.Module) -> list[str]:
    """Fake-quantize every eligible Linear in place; returns the names of the swapped layers."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_  # noqa: PLC0415
    from torchao.quantization.qat import QATConfig  # noqa: PLC0415

    names = [n for n, m in model.named_modules() if fp8_eligible(m, n)]
    # A floor under the activation amax: an all-zero row (the zero embedding of a padding token)
    # would otherwise get scale 0 and turn into NaN, which attention then spreads to every
    # position through 0·NaN.
    base = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), activation_value_lb=ACTIVATION_AMAX_FLOOR)
    quantize_(model, QATConfig(base, step="prepare"), filter_fn=fp8_eligible)
    from torchao.quantization.qat.linear import FakeQuantizedLinear  # noqa: PLC0415

    for module in model.modules():
        if isinstance(module, FakeQuantizedLinear):
            for attr in ("activation_fake_quantizer", "weight_fake_quantizer"):
                quantizer = getattr(module, attr)
                if quantizer is not None and not isinstance(quantizer, StraightThrough):
                    setattr(module, attr, StraightThrough(quantizer))
    return names


def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    """Turn fake quantization on or off in every prepared layer (used to delay it N steps)."""
    from torchao.quantization.qat.linear import FakeQuantizedLinear  # noqa: PLC0415

    for module in model.modules():
        if isinstance(module, FakeQuantizedLinear):
            for quantizer in (module.activation_fake_quantizer, module.weight_fake_quantizer):
                if quantizer is not None:
                    quantizer.enabled = enabled


def fake_quant_layers(model: nn.Module) -> int:
    from torchao.quantization.qat.linear import FakeQuantizedLinear  # noqa: PLC0415

    return sum(isinstance(m, FakeQuantizedLinear) for m in model.modules())
