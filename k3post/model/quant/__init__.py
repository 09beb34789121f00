"""FP8 quantisation: training against the grid the student will be served on.

`qat.py` swaps Linear layers for torchao's fake-quantised ones (per-row e4m3 weights, per-token
activations, a straight-through backward); `fp8_sync.py` is what the learner sends the samplers
under `sampling.weights: fp8` (e4m3 bytes and per-row scales); `fp8_linear.py` is the sampler's
Linear that holds them and multiplies with a real FP8 GEMM on Hopper. May import:
`generation/fused_projections.py`, `training/weights.py`, `algo`; never loading or an engine.
"""
