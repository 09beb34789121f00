"""The sampler's FP8 Linear: a QAT Linear that can also hold its weight as e4m3 values + scales.

`Fp8Linear` is torchao's `FakeQuantizedLinear` (the same parameters, the same fake quantisers,
so `set_fake_quant` and the state-dict names work unchanged) with two forms:

- full: `weight` in the model's dtype; the forward is FakeQuantizedLinear's (fake quantisation
  of weight and activations when switched on, model/quant/qat.py);
- fp8: `weight` holds the e4m3 bytes (uint8 [out, in]) and `weight_scale` the fp32 per-row
  scales [out, 1], as the FP8 weight sync sends them (model/quant/fp8_sync.py). The forward quantises
  its input per token and computes x̃ W̃ᵀ + b (algo/fp8.py): with a real FP8 GEMM
  (`torch._scaled_mm`) on a GPU of compute capability ≥ 8.9, and elsewhere by dequantising,
  W̃ = q·s in the weight's dtype: bit for bit the weight the learner's fake-quantised forward
  uses, so on a CPU the sampler's logprobs equal the learner's.

`hold_payload_forms(model, weights)` puts every Fp8Linear into the form a payload carries, so
that the payload can then be copied in by name (model/training/weights.py `import_weights`). A change of
form allocates the new tensors; a sync in the same form is a copy in place, so the tensors a
compiled decode step captured stay where they were.

Stacked groups. q/k/v and gate/up read one input each; in the fp8 form a group's bytes and
scales can be stacked (`stack_group`, called by model/generation/fused_projections.py) with every member's
`weight` and `weight_scale` views of its rows, as the bf16 projections are: eagerly a member is
the layer it was; compiled, each member computes the group's whole FP8 GEMM and keeps its own
columns, and the compiled step's common-subexpression pass leaves one quantisation of the input
and one GEMM per group. A weight sync in the fp8 form copies into the views, so into the stacks.
"""

from __future__ import annotations

import torch
from torch import nn
from torchao.quantization.qat.linear import FakeQuantizedLinear

from k3post.algo.fp8 import (dequantize_rows, fake_quantize_rows, fp8_gemm_available, linear_dequantised,
                             linear_scaled_mm)
from k3post.model.quant.fp8_sync import SCALE, as_e4m3, fp8_layers_of, fp8_payload
from k3post.model.generation.fused_projections import copy_with_row_views, projection_groups, same_inputs
from k3post.model.quant.qat import ACTIVATION_AMAX_FLOOR, prepare_fp8_qat
from k3post.model.training.weights import import_weights, unique_state


class Fp8Linear(FakeQuantizedLinear):
    """A FakeQuantizedLinear whose weight may be held as e4m3 bytes and per-row scales."""

    compute_dtype: torch.dtype  # the full weight's dtype: what the dequantised weight is cast to
    fp8_gemm: bool = False  # decided when the FP8 form is taken (a plain attribute: a compiled step guards on it)
    rows: tuple[int, int] | None = None  # this layer's rows of its group's stacks while stacked

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
        """Switch to the full form (zeros until a payload is copied in); a stacked layer leaves its group."""
        if self.holds_fp8:
            self.weight = nn.Parameter(torch.zeros(self.weight.shape, dtype=self.compute_dtype,
                                                   device=self.weight.device), requires_grad=False)
            self.weight_scale = None
            self.unstack()

    def __deepcopy__(self, memo: dict) -> "Fp8Linear":
        """A stacked layer's copy keeps its rows as views of its copied stacks (fused_projections)."""
        return copy_with_row_views(self, memo, self.rows)

    @classmethod
    def stack_group(cls, members: list["Fp8Linear"]) -> bool:
        """Stack the bytes, scales (and biases) of a group of layers that read one input, each
        member's own tensors becoming views of its rows; False (nothing done) unless every member
        holds fp8 alike and they are not stacked together already."""
        first = members[0]
        if not (all(m.holds_fp8 and m.fp8_gemm == first.fp8_gemm and m.compute_dtype == first.compute_dtype
                    for m in members) and same_inputs(members)):
            return False
        if all(m.rows is not None and m.weight_stack is first.weight_stack for m in members):
            return False
        with torch.no_grad():
            q, s = torch.cat([m.weight for m in members]), torch.cat([m.weight_scale for m in members])
            b = None if first.bias is None else torch.cat([m.bias for m in members])
        start = 0
        for m in members:
            stop = start + m.out_features
            m.register_buffer("weight_stack", q, persistent=False)
            m.register_buffer("scale_stack", s, persistent=False)
            m.register_buffer("bias_stack", b, persistent=False)
            m.weight = nn.Parameter(q[start:stop], requires_grad=False)
            m.weight_scale = s[start:stop]
            if b is not None:
                m.bias = nn.Parameter(b[start:stop], requires_grad=False)
            m.rows, start = (start, stop), stop
        return True

    def unstack(self) -> None:
        """Compute with this layer's own rows again (its tensors stay views of the stacks)."""
        if self.rows is not None:
            self.rows = None
            for name in ("weight_stack", "scale_stack", "bias_stack"):
                delattr(self, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.holds_fp8:
            return super().forward(x)
        if self.rows is not None and torch.compiler.is_compiling():  # the group's GEMM, computed once
            start, stop = self.rows
            return self._fp8_forward(x, self.weight_stack, self.scale_stack, self.bias_stack)[..., start:stop]
        return self._fp8_forward(x, self.weight, self.weight_scale, self.bias)

    def quantise_input(self, x: torch.Tensor) -> torch.Tensor:
        """x on the fp8 form's per-token e4m3 grid, in x's dtype: torchao's activation fake
        quantiser (the learner's) bit for bit."""
        return fake_quantize_rows(x, ACTIVATION_AMAX_FLOOR)

    def dequantised_weight(self) -> torch.Tensor:
        """The fp8 form's W̃ = q·s in the full weight's dtype: the learner's fake-quantised weight."""
        return dequantize_rows(as_e4m3(self.weight), self.weight_scale, self.compute_dtype)

    def _fp8_forward(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        q_w = as_e4m3(weight)
        if self.fp8_gemm and x.dtype == torch.bfloat16:
            return linear_scaled_mm(x, q_w, scale, bias, ACTIVATION_AMAX_FLOOR)
        return linear_dequantised(x, q_w, scale, bias, self.compute_dtype, ACTIVATION_AMAX_FLOOR)


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
    for _, _, members in projection_groups(model):  # groups that now hold fp8 stack their bytes and scales
        if all(type(m) is Fp8Linear for m in members):
            Fp8Linear.stack_group(members)


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
