"""Generation: the student drawing tokens, with the log-probabilities it drew them from.

`sampling.py` is the HF `generate` path and the helpers every sampler shares (chat rendering of
prompts, stop ids, the recipe's generation config); `fast_sampling.py` the static-KV-cache
sampler whose decode step is one CUDA graph, over `fused_projections.py` (one GEMM per group of
projections) and `grouped_decode_attention.py`; `speculative_sampling.py` and
`fast_speculation.py` draft with `draft_head.py` and accept exactly (eager and compiled).
May import: `model/families.py`, `algo`, `types`, torch and transformers; never the learner's
surgery (`training/`, `quant/`), loading or an engine.
"""
