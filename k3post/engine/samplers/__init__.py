"""Samplers: the student generating rollouts, with the log-probabilities it drew them from.

`sampler.py` is the HF `generate` sampler (and what every sampler shares: prompt rendering, the
weight sync's receiving half); `fast_sampler.py` the static-KV-cache, CUDA-graph one;
`speculative_sampler.py` drafts with the learner's head and switches speculation on or off by
measured speed; `vllm_sampler.py` samples on vLLM. May import: `vllm/`, `transport/`, `model/`;
never the learner or the teachers.
"""
