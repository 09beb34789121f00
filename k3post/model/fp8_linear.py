"""The sampler's FP8 Linear: a QAT Linear that can also hold its weight as e4m3 values + scales.

`Fp8Linear` is torchao's `FakeQuantizedLinear` (the same parameters, the same fake quantisers,
so `set_fake_quant` and the state-dict names work unchanged) with two forms:

- full: `weight` in the model's dtype; the forward is FakeQuantizedLinear's (fake quantisation
  of weight and activations when switched on, model/qat.py);
- fp8: `weight` holds the e4m3 bytes (uint8 [out, in]) and `weight_scale` the fp32 per-row
  scales [out, 1], as the FP8 weight sync sends them (model/fp8_sync.py). The forward quantises
  its input per token and computes x̃ W̃ᵀ + b (algo/fp8.py): with a real FP8 GEMM
  (`torch._scaled_mm`) on a GPU of compute capability ≥ 8.9, and elsewhere by dequantising,
  W̃ = q·s in the weight's dtype: bit for bit the weight the learner's fake-quantised forward
  uses, so on a CPU the sampler's logprobs equal the learner's.

`hold_payload_forms(model, weights)` puts every Fp8Linear into the form a payload carries, so
that the payload can then be copied in by name (model/weights.py `import_weights`). A change of
form allocates the new tensors; a sync in the same form is a copy in place, so the tensors a
compiled decode step captured stay where they were.
"""

from __future__ import annotations

import torch
from torch import nn
from torchao.quantization.qat.linear import FakeQuantizedLinear

from k3post.algo.fp8 import fp8_gemm_available, linear_dequantised, linear_scaled_mm
from k3post.model.fp8_sync import SCALE, as_e4m3, fp8_layers_of, fp8_payload
from k3post.model.qat import ACTIVATION_AMAX_FLOOR, prepare_fp8_qat
from k3post.model.weights import import_weights, unique_state


class Fp8Linear(FakeQuantizedLinear):
    """A FakeQuantizedLinear whose weight may be held as e4m3 bytes and per-row scales."""

    compute_dtype: torch.dtype  # the full weight's dtype: what the dequantised weight is cast to
    fp8_gemm: bool = False  # decided when the FP8 form is taken (a plain attribute: a compiled step guards on it)

    @classmethod
    def from_fake_quantized(cls, layer: FakeQuantizedLinear) -> "Fp8Linear":
        """The same layer (its parameters and quantisers shared, not copied), able to hold FP8."""
        new = cls(layer.in_features, layer.out_features, layer.bias is not None, device="meta")
        new.weight, new.bias = layer.weight, layer.bias
        new.activation_fake_quantizer = layer.activation_fake_quantizer
        new.weight_fake_quantizer = layer.weight_fake_quantizer
        new.compute_dtype = layer.weight.dtype
        new.register_buffer(SCALE, None)
        return new

    @property
    def holds_fp8(self) -> bool:
        return self.weight_scale is not None

    def hold_fp8(self) -> None:
        """Switch to the fp8 form (zero bytes and unit scales until a payload is copied in)."""
        if not self.holds_fp8:
            device = self.weight.device
            self.weight = nn.Parameter(torch.zeros(self.weight.shape, dtype=torch.uint8, device=device),
                                       requires_grad=False)
            self.weight_scale = torch.ones(self.out_features, 1, dtype=torch.float32, device=device)
            self.fp8_gemm = fp8_gemm_available(device)

    def hold_full(self) -> None:
        """Switch to the full form (zeros until a payload is copied in)."""
        if self.holds_fp8:
            self.weight = nn.Parameter(torch.zeros(self.weight.shape, dtype=self.compute_dtype,
                                                   device=self.weight.device), requires_grad=False)
            self.weight_scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.holds_fp8:
            return super().forward(x)
        q_w = as_e4m3(self.weight)
        if self.fp8_gemm and x.dtype == torch.bfloat16:
            return linear_scaled_mm(x, q_w, self.weight_scale, self.bias, ACTIVATION_AMAX_FLOOR)
        return linear_dequantised(x, q_w, self.weight_scale, self.bias, self.compute_dtype, ACTIVATION_AMAX_FLOOR)


def use_fp8_linears(model: nn.Module) -> list[str]:
    """Replace every FakeQuantizedLinear of a QAT-prepared `model` by an Fp8Linear sharing its
    parameters (in the full form); returns their names."""
    names = [name for name, m in model.named_modules() if type(m) is FakeQuantizedLinear]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Fp8Linear.from_fake_quantized(getattr(parent, child)))
    return names


def hold_payload_forms(model: nn.Module, weights: dict) -> None:
    """Every Fp8Linear of `model` in the form `weights` carries it in (fp8 where the payload has
    its scale); a payload that sends a layer in FP8 that is no Fp8Linear here is an error."""
    fp8 = fp8_layers_of(weights)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    unknown = sorted(fp8 - set(layers))
    if unknown:
        raise ValueError(f"the weight sync sends {unknown[:3]} in FP8, which this sampler does not quantise")
    for name, layer in layers.items():
        if name in fp8:
            layer.hold_fp8()
        else:
            layer.hold_full()


def hold_own_weights_in_fp8(model: nn.Module) -> list[str]:
    """Prepare `model` for FP8 rollouts and put its own weights through an FP8 sync: what a
    sampler holds after the learner sends these weights (benchmarks, GPU tests). Returns the
    quantised layers."""
    layers = prepare_fp8_qat(model)
    use_fp8_linears(model)
    payload = fp8_payload(unique_state(model), layers)
    hold_payload_forms(model, payload)
    import_weights(model, payload)
    return layers
