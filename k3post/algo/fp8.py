"""FP8 numerics of the QAT grid: per-row e4m3 quantisation and the two ways to multiply by it.

torchao's FP8 QAT (model/quant/qat.py) rounds a Linear's weight W [N, K] row by row and its input
x [M, K] token by token, by one rule (e4m3: 4 exponent bits, 3 mantissa bits, largest finite
value 448):

    s = amax_k |t_k| / 448          divided in t's own dtype (bf16 or fp32), then held in fp32
    q = e4m3(clamp(t / s, ±448))    t cast to fp32 and divided by s in fp32, rounded to nearest
    t̃ = q · s                       in fp32, cast back to t's dtype

Each rounding happens where torchao does it (a bf16 weight's scale is divided in bf16: an fp32
division flips some e4m3 roundings), so `quantize_rows` followed by `dequantize_rows` is torchao's
fake quantisation bit for bit, and (q, s) are exactly the values the learner's QAT forward
multiplies by. For activations the amax is first floored (`amax_floor`): an all-zero row, the
zero embedding of a padding token, would otherwise get s = 0 and 0/0 = NaN. Weights have no
floor in torchao, so an all-zero weight row makes its QAT forward NaN; here such a row gets
s = 1 and stays zero (the only place this differs from torchao, and only where it gives NaN).

The QAT forward is y = x̃ W̃ᵀ + b. Two ways to compute it from (q, s):

- `linear_dequantised`: dequantise both operands to the compute dtype and multiply. This is the
  learner's fake-quantised forward, bit for bit on the same device and kernel: what a CPU (and
  any GPU without FP8 tensor cores) runs.
- `linear_scaled_mm`: keep the e4m3 operands and let `torch._scaled_mm` multiply them,

      y_mn = s^x_m · s^w_n · Σ_k q^x_mk · q^w_nk     (row-wise scales: s^x [M, 1], s^w as [1, N])

  Each product of two e4m3 values is exact in fp32 (4 + 4 significant bits); the sum is an fp32
  dot product, scaled once and rounded to the output dtype. The weights are read as 1 byte per
  element, and on a GPU of compute capability ≥ 8.9 (Ada, Hopper, Blackwell) the product runs
  on the FP8 tensor cores. It is not bit-identical to the dequantised form: in fp32 the two
  differ by fp32 rounding only - two dot products (each within K·u·Σ_k |x̃_k w̃_k| to first
  order, u = 2⁻²⁴) and a few roundings of operands and scales, so within (2K + 4)·u·Σ_k |x̃_k w̃_k|;
  in bf16 the dequantised form also rounds each operand q·s to bf16 (8 significant bits) before
  multiplying, so the two differ by bf16 rounding, ~2⁻⁸ of |y| (REFERENCE §5.4 measured the same
  order, 3.3e-3 relative L2, between torchao's fake and real FP8 on an H200). That bound assumes
  the kernel accumulates in fp32: on an H100 with torch 2.11 some outputs exceed it
  (tests/gpu/test_fp8_gemm_cuda.py fails there; docs/engines.md), while per GEMM the FP8 product
  lands as close to the exact grid product as the dequantised form does and 0.2% of |y| from it
  (bench/fp8/fp8_gemm_error_gpu.py, docs/benchmarks.md); which outputs exceed and why is not isolated.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_GEMM_CAPABILITY = (8, 9)  # the first CUDA architecture with FP8 tensor cores (Ada)


def quantize_rows(t: torch.Tensor, amax_floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [..., K], s fp32 [..., 1]) with t ≈ q·s, one scale per row of the last dim
    (torchao's PerRow rule, above); `amax_floor` > 0 floors the amax (activations)."""
    amax = t.abs().amax(dim=-1, keepdim=True)
    if amax_floor > 0:
        amax = amax.clamp(min=amax_floor)
    scale = (amax / E4M3_MAX).to(torch.float32)  # divided in t's dtype, as torchao does
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = (t.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q·s in fp32, cast to `dtype`: the fake-quantised tensor the QAT forward computes with."""
    return (q.to(torch.float32) * scale).to(dtype)


def fake_quantize_rows(t: torch.Tensor, amax_floor: float = 0.0) -> torch.Tensor:
    """t on the e4m3 grid, in t's dtype (torchao's Float8FakeQuantizer, PerRow, bit for bit)."""
    return dequantize_rows(*quantize_rows(t, amax_floor), t.dtype)


def linear_dequantised(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor, bias: torch.Tensor | None,
                       dtype: torch.dtype, amax_floor: float) -> torch.Tensor:
    """x̃ W̃ᵀ + b with both operands dequantised to `dtype` (the weight's dtype in the learner)."""
    return torch.nn.functional.linear(fake_quantize_rows(x, amax_floor), dequantize_rows(q_w, s_w, dtype), bias)


def linear_scaled_mm(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor, bias: torch.Tensor | None,
                     amax_floor: float) -> torch.Tensor:
    """x̃ W̃ᵀ + b by an FP8 GEMM: x quantised per token, e4m3 × e4m3 with fp32 accumulation, row-wise
    scales, output in x's dtype. `q_w` [N, K] is row-major, so q_wᵀ is the column-major [K, N]
    operand the kernel wants; K and N must be multiples of 16 (model/quant/qat.py skips other Linears).
    On a GPU the row-wise kernel writes bf16 only."""
    lead, k = x.shape[:-1], x.shape[-1]
    q_x, s_x = quantize_rows(x.reshape(-1, k), amax_floor)
    y = torch._scaled_mm(q_x, q_w.t(), scale_a=s_x, scale_b=s_w.reshape(1, -1), out_dtype=x.dtype)
    if bias is not None:  # added after the GEMM: the row-wise kernels' bias support varies by version
        y = y + bias
    return y.reshape(*lead, q_w.shape[0])


def fp8_gemm_available(device: torch.device) -> bool:
    """Real FP8 GEMMs on `device`: CUDA with FP8 tensor cores (compute capability ≥ 8.9). Callers
    also need a bf16 input, the row-wise kernel's only output dtype; elsewhere the dequantised
    form runs, which is the learner's forward exactly."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_GEMM_CAPABILITY
