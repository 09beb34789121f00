"""A student and its `residual` MTP head as one MiMo checkpoint: what vLLM's `mtp` method serves.

vLLM 0.32 loads an MTP draft from the target's own checkpoint (`speculative_config={"method":
"mtp", ...}`, no separate model), picking the draft class from the target's architecture
(`vllm/config/speculative.py`, `hf_config_override`). For `MiMoForCausalLM` it is `MiMoMTP`
(`vllm/model_executor/models/mimo_mtp.py`), whose layer computes, from the target's states h̃_t
before its final norm (`mimo.py`: the model returns the residual stream, `compute_logits` norms
it) and the next token x_{t+1} at position t:

    e = E x_{t+1}, 0 where t = 0
    g = FinalLN( Block( W_in [ HiddenLN(h̃_t) ; TokenLN(e) ] ) )     Block: a Qwen2 decoder layer
    logits = Head(g)                                                   the next draft reads g

That is a `draft.hidden: residual` head (model/generation/draft_head.py) tensor for tensor:

| k3post (`mtp_head.safetensors`, the student)  | MiMo checkpoint name                          |
|------------------------------------------------|-----------------------------------------------|
| `enorm.weight`                                 | `model.mtp_layers.0.token_layernorm.weight`   |
| `hnorm.weight`                                 | `model.mtp_layers.0.hidden_layernorm.weight`  |
| `eh_proj.weight` = [W_e │ W_h]                 | `model.mtp_layers.0.input_proj.weight` = [W_h │ W_e] |
| `block.<name>`                                 | `model.mtp_layers.0.<name>`                   |
| the student's `model.norm.weight`              | `model.mtp_layers.0.final_layernorm.weight`   |

(the concatenation order differs, so W_in is W_proj with its two column halves swapped: exact).
The target is the student's own module tree under Qwen2's names, which are Llama's: Qwen2's
attention has q/k/v biases, written as zeros for students without them (Llama, Mistral, Qwen3),
and its `qk_norm` option is Qwen3's q_norm/k_norm. What has no exact Qwen2 form is refused
(`mimo_problem`): other families, head_dim ≠ hidden/heads (vLLM's Qwen2 derives it), biases on
o_proj or the MLP, sliding windows, activations other than SiLU.
"""

from __future__ import annotations

from typing import Any

import torch

DRAFT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MTP_PREFIX = "model.mtp_layers.0."
HEAD_NAMES = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight"}
ZERO_BIASES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def mimo_problem(config: Any) -> str | None:
    """Why the student of `config` (a transformers config) has no exact MiMo (Qwen2) form; None if it has."""
    family = config.model_type
    if family not in DRAFT_FAMILIES:
        return (f"model_type {family!r}: vLLM's MiMo MTP layer is a Qwen2 decoder layer, which expresses "
                f"{', '.join(DRAFT_FAMILIES)} students exactly, not this one")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim * heads != config.hidden_size:
        return (f"head_dim {head_dim} × {heads} heads ≠ hidden_size {config.hidden_size}: vLLM's Qwen2 attention "
                f"takes head_dim = hidden_size / heads")
    if family != "qwen2" and getattr(config, "attention_bias", False):
        return "attention_bias: Qwen2 has no o_proj bias"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias: Qwen2's MLP has no biases"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}: vLLM's Qwen2 MLP is SiLU-gated"
    window = getattr(config, "sliding_window", None)
    if window and (family == "mistral" or getattr(config, "use_sliding_window", False)):
        return f"sliding_window {window}: the exported layers would attend differently"
    return None


def mimo_config(config: Any, dtype: torch.dtype) -> dict:
    """The MiMo checkpoint's config.json: a Qwen2 config of the student's shapes, architecture
    `MiMoForCausalLM` (what selects vLLM's MiMo target and MTP draft) and one MTP layer."""
    from transformers import Qwen2Config  # noqa: PLC0415

    qwen2 = Qwen2Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters), tie_word_embeddings=config.tie_word_embeddings,
        use_sliding_window=False, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None))
    out = qwen2.to_dict()
    out.update({"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1,
                "qk_norm": config.model_type == "qwen3", "dtype": str(dtype).removeprefix("torch.")})
    return out


def _with_zero_biases(state: dict[str, torch.Tensor], prefixes: list[str]) -> None:
    """Zero q/k/v biases (Qwen2's attention always has them) where the student has none."""
    for prefix in prefixes:
        for proj in ZERO_BIASES:
            weight = state[f"{prefix}{proj}.weight"]
            state.setdefault(f"{prefix}{proj}.bias", torch.zeros(weight.shape[0], dtype=weight.dtype))


def mimo_state(student: dict[str, torch.Tensor], head: dict[str, torch.Tensor], config: Any
               ) -> dict[str, torch.Tensor]:
    """The MiMo checkpoint's tensors from the student's HF state dict (each tied storage once)
    and a residual head's (`mtp_head.safetensors`), in the table's names."""
    state = {name: t.contiguous() for name, t in student.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # re-tied from the embedding at load
    d = config.hidden_size
    for name, t in head.items():
        if name == "eh_proj.weight":  # [W_e | W_h] over [embedding; hidden] → [W_h | W_e] over [hidden; embedding]
            state[MTP_PREFIX + "input_proj.weight"] = torch.cat([t[:, d:], t[:, :d]], dim=1).contiguous()
        elif name in HEAD_NAMES:
            state[MTP_PREFIX + HEAD_NAMES[name]] = t.contiguous()
        elif name.startswith("block."):
            state[MTP_PREFIX + name.removeprefix("block.")] = t.contiguous()
        else:
            raise KeyError(f"the draft head has a tensor {name!r} that a MiMo MTP layer has no place for")
    state[MTP_PREFIX + "final_layernorm.weight"] = student["model.norm.weight"].clone()
    layers = [f"model.layers.{i}." for i in range(config.num_hidden_layers)] + [MTP_PREFIX]
    _with_zero_biases(state, layers)
    return state


def write_mimo_checkpoint(model, head: dict[str, torch.Tensor], tokenizer, out_dir) -> int:
    """Write the student `model` (a loaded HF model) and `head` as a MiMo checkpoint in
    `out_dir`: model.safetensors, config.json, generation config, tokenizer (if given). Returns
    the number of tensors written."""
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from safetensors.torch import save_file  # noqa: PLC0415

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    student = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    dtype = next(iter(student.values())).dtype
    state = mimo_state(student, {k: v.to(dtype) for k, v in head.items()}, model.config)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(mimo_config(model.config, dtype), indent=2))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return len(state)
