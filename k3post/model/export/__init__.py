"""Export: checkpoints that serving engines load.

`fp8_export.py` writes a QAT student as a compressed-tensors FP8 checkpoint (per-channel weight
scales, dynamic per-token activations) that vLLM serves; `mimo_export.py` writes the trained
draft head as an MTP layer vLLM's `speculative_config={"method": "mtp"}` reads. May import:
`quant/`, `training/`, `config`; never an engine, Ray or vLLM.
"""
