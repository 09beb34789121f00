"""The vLLM engine core shared by the vLLM sampler and teacher: the only module that imports vLLM.

`vllm_engine.py` builds `vllm.LLM` from a recipe (imported lazily, so everything else imports
without vLLM), feeds it token ids, reads sampled and prompt log-probabilities back, and loads
synced weights in place (checked by `transport/weight_check.py`). Differences between the vLLM
releases k3post supports live here alone. May import: `transport/`, `model/`, `config`.
"""
