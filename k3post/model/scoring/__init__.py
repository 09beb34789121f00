"""Scoring: log-probabilities of tokens that are already chosen.

`logprobs.py` computes log π(y_t) from the final hidden states chunk by chunk over the
vocabulary (no [N, V] block held whole), applying each family's output transforms;
`prefix_scoring.py` encodes a prompt shared by several completions once
(`shared_prefix_attention.py` is the attention mask that makes it exact); `chat_render.py`
renders each teacher's chat template and system prompt. May import: `generation/sampling.py`
(prompt rendering), `model/families.py`, `algo`, `types`; never loading, the learner's surgery
or an engine.
"""
