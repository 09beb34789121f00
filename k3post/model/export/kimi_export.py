"""A Kimi Linear student as vLLM serves it: Moonshot's config schema and Moonshot's tensor names.

transformers' `KimiLinearForCausalLM` (model/loading/kimi.py) and vLLM's
(`vllm/model_executor/models/kimi_linear.py`, 0.26.0) compute the same network, but vLLM reads
neither transformers' config fields nor its parameter names: it reads the schema of Moonshot's
original checkpoint (`vllm/transformers_utils/configs/kimi_linear.py`) and loads Moonshot's names.
This module translates both, as pure functions, so that one export serves and one name map syncs
trained weights into a running engine.

The config (`vllm_kimi_config`), transformers → vLLM 0.26's config.json:

- `layer_types[i]`: linear_attention → i + 1 in `linear_attn_config.kda_layers`, full_attention →
  i + 1 in `full_attn_layers` (1-based: `is_kda_layer(i)` tests `i + 1`); the KDA sizes
  `linear_num_heads/linear_head_dim/linear_conv_kernel_dim` → `linear_attn_config.num_heads/head_dim/
  short_conv_kernel_size`.
- `mlp_layer_types[i]` = sparse → i >= `first_k_dense_replace` and i % `moe_layer_freq` == 0 (the
  decoder layer's test, kimi_linear.py:328-333). transformers can describe any dense/sparse pattern,
  vLLM only "dense below k, then every f-th layer": another pattern is refused (`UserError`).
- the router (sigmoid scores, the correction bias added for the choice only, grouped top-k,
  renormalised, × `routed_scaling_factor`) → `moe_router_activation_func: sigmoid`,
  `use_grouped_topk: true`, `num_expert_group`, `topk_group`, `moe_renormalize`,
  `routed_scaling_factor` (vLLM applies it to the top-k weights, fused_moe/layer.py:293-300).
- MLA with NoPE and a full-rank query → `mla_use_nope: true`, `q_lora_rank: null` (asserted,
  kimi_linear.py:214-215): a low-rank query is refused, as are no shared expert (vLLM would build a
  zero-width MLP), attention biases (vLLM's projections have none) and a non-SiLU MLP.
- the head: transformers never ties Kimi's (`_tied_weights_keys` is empty) and vLLM 0.26 would
  leave its own `lm_head` unloaded under `tie_word_embeddings: true`, so: false, and `lm_head.weight`
  is always written.

The names (`vllm_kimi_names`): each transformers tensor → the vLLM checkpoint tensors it is cut into,
all of one shape, whose concatenation in memory order is the transformers tensor (a bijection on
elements). Under `model.layers.{i}.`:

- `self_attn.conv1d.weight` [3P, 1, K] → `self_attn.{q,k,v}_conv1d.weight` [P, 1, K] (channels q|k|v);
- `self_attn.forget_gate.X` (X = `f_a_proj.weight`, `f_b_proj.weight`, `dt_bias`, `A_log`) → `self_attn.X`;
- `mlp.experts.gate_up_proj` [E, 2I, H] → `block_sparse_moe.experts.{e}.w1.weight` (gate rows) and
  `.w3.weight` (up rows), [I, H] each, expert by expert;
- `mlp.experts.down_proj` [E, H, I] → `block_sparse_moe.experts.{e}.w2.weight` [H, I];
- `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, `mlp.shared_experts.*` → `block_sparse_moe.…`;
- everything else (KDA q/k/v/b/g/o projections and `o_norm`, MLA projections and `kv_a_layernorm`,
  the dense MLP, norms, embedding, head): unchanged.

Why `block_sparse_moe`: vLLM registers the MoE module under that name and aliases it as `mlp`;
`named_parameters` keeps the first name only, so only `block_sparse_moe.*` resolve (kimi_linear.py:
334-339, 478). Why per-expert tensors: its loader maps `experts.{e}.w1.` onto the fused
`experts.routed_experts.w13_weight` (`fused_moe_make_expert_params_mapping` without the fused
forms, :469-475). The dense and shared MLPs' `gate_proj`/`up_proj` it fuses itself (:461-465).

Where the two compute differently even with every name right (read from the two sources; small,
which tests/gpu/test_vllm_kimi_cuda.py is written to measure): vLLM's router GEMM runs in the model
dtype, transformers' in fp32 (near-tied expert scores may be chosen differently); vLLM's MLA
`kv_a_layernorm` uses `rms_norm_eps`, transformers' a fixed 1e-6; vLLM's KDA output norm a fixed
1e-5, transformers' `rms_norm_eps` (1e-5 by default, so only the MLA norm differs by default).

vLLM 0.32 (the CPU build in the venv) moved the model to `vllm/models/kimi_k3/`; its loader
still accepts exactly these checkpoint names (it fuses more of them internally) and its config
class reads the same fields, plus some new ones with defaults. May import: `config`; never an
engine, Ray or vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from k3post.config.errors import UserError

VLLM_ARCHITECTURE = "KimiLinearForCausalLM"
FULL, LINEAR = "full_attention", "linear_attention"
MOE_PREFIX = "block_sparse_moe."
# HF suffix after `self_attn.` → vLLM's; the forget gate is its own module only in transformers
_KDA_RENAMES = {f"forget_gate.{name}": name for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")}
_CONV_PIECES = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


def moe_placement(mlp_layer_types: list[str]) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq) reproducing `mlp_layer_types` under vLLM's rule
    "layer i is MoE iff i >= k and i % f == 0"; the smallest f that fits. A model without MoE
    layers gets k = the layer count. Raises UserError for a pattern the rule cannot express."""
    n = len(mlp_layer_types)
    sparse = [i for i, kind in enumerate(mlp_layer_types) if kind == "sparse"]
    if not sparse:
        return n, 1
    k = sparse[0]  # any k' <= k with the same f would add layers below k, which are dense
    for f in range(1, n + 1):
        if [i for i in range(n) if i >= k and i % f == 0] == sparse:
            return k, f
    raise UserError(
        f"mlp_layer_types {mlp_layer_types}: vLLM's Kimi Linear schema expresses only 'dense below "
        f"first_k_dense_replace, then MoE at every moe_layer_freq-th layer' (layer i is MoE iff i >= k and "
        f"i % f == 0); expected such a pattern, e.g. {['dense'] * k + ['sparse'] * (n - k)}")


def _refusals(config: Any) -> list[str]:
    """What in a transformers Kimi config vLLM 0.26's Kimi Linear layers cannot compute."""
    problems = []
    if config.q_lora_rank is not None:
        problems.append(f"q_lora_rank {config.q_lora_rank}: vLLM's Kimi MLA asserts a full-rank query "
                        "(expected null)")
    if "sparse" in config.mlp_layer_types and not config.num_shared_experts:
        problems.append("num_shared_experts 0: vLLM would build a zero-width shared MLP (expected >= 1)")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r}: vLLM's Kimi MLPs are SiLU-gated (expected 'silu')")
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias: vLLM's Kimi MLA projections have no biases (expected false)")
    kinds = set(config.layer_types) - {FULL, LINEAR}
    if kinds:
        problems.append(f"layer_types {sorted(kinds)}: expected only {FULL!r} and {LINEAR!r}")
    if len(config.layer_types) != config.num_hidden_layers or len(config.mlp_layer_types) != config.num_hidden_layers:
        problems.append(f"layer_types/mlp_layer_types: expected {config.num_hidden_layers} entries each")
    return problems


def vllm_kimi_config(config: Any) -> dict:
    """The config.json (Moonshot's schema) whose model vLLM 0.26 builds equal to the
    transformers `KimiLinearConfig` `config`. Raises UserError for what vLLM cannot serve."""
    problems = _refusals(config)
    if problems:
        raise UserError("this Kimi Linear model has no vLLM form: " + "; ".join(problems))
    first_k_dense, moe_freq = moe_placement(list(config.mlp_layer_types))
    types = list(config.layer_types)
    dtype = getattr(config, "dtype", None)
    return {
        "architectures": [VLLM_ARCHITECTURE], "model_type": "kimi_linear",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range, "max_position_embeddings": config.max_position_embeddings,
        "pad_token_id": config.pad_token_id, "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        # transformers never ties Kimi's head (`_tied_weights_keys = {}`), and vLLM 0.26 would leave an
        # untied `lm_head` unloaded if this said true: the head is always written as its own tensor.
        "tie_word_embeddings": False, "use_cache": True,
        # no layer applies a rotary embedding (MLA with NoPE; vLLM builds it with rotary_emb=None)
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        # MLA
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": None, "kv_lora_rank": config.kv_lora_rank, "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim, "v_head_dim": config.v_head_dim, "mla_use_nope": True,
        # KDA
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == LINEAR],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == FULL],
            "num_heads": config.linear_num_heads, "head_dim": config.linear_head_dim,
            "short_conv_kernel_size": config.linear_conv_kernel_dim},
        # not read by vLLM 0.26's Kimi model: its ModelConfig counts a hybrid's layers by kind from
        # `layer_types` (`get_num_layers_by_block_type`), and transformers, reading this file back,
        # takes both lists before Moonshot's fields (it would ignore `moe_layer_freq`)
        "layer_types": types, "mlp_layer_types": list(config.mlp_layer_types),
        # MoE
        "num_experts": config.num_experts, "num_experts_per_token": config.num_experts_per_token,
        "num_shared_experts": config.num_shared_experts, "moe_intermediate_size": config.moe_intermediate_size,
        "first_k_dense_replace": first_k_dense, "moe_layer_freq": moe_freq,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": bool(config.moe_renormalize),
        "routed_scaling_factor": float(config.routed_scaling_factor),
        "use_grouped_topk": True, "num_expert_group": config.num_expert_group, "topk_group": config.topk_group,
        "num_nextn_predict_layers": 0,
        **({"dtype": str(dtype).removeprefix("torch.")} if dtype is not None else {}),
    }


def _vllm_suffix(rest: str, num_experts: int | None) -> tuple[str, ...]:
    """vLLM names for one tensor of a decoder layer, given its name after `model.layers.{i}.`."""
    if rest.startswith("self_attn."):
        attn = rest.removeprefix("self_attn.")
        if attn == "conv1d.weight":
            return tuple(f"self_attn.{piece}" for piece in _CONV_PIECES)
        return (f"self_attn.{_KDA_RENAMES.get(attn, attn)}",)
    if rest.startswith(("mlp.gate.", "mlp.shared_experts.")):
        return (MOE_PREFIX + rest.removeprefix("mlp."),)
    if rest.startswith("mlp.experts."):
        if num_experts is None:
            raise ValueError(f"{rest}: the number of experts is needed to name its per-expert tensors")
        if rest == "mlp.experts.gate_up_proj":
            return tuple(f"{MOE_PREFIX}experts.{e}.{w}.weight" for e in range(num_experts) for w in ("w1", "w3"))
        if rest == "mlp.experts.down_proj":
            return tuple(f"{MOE_PREFIX}experts.{e}.w2.weight" for e in range(num_experts))
        raise KeyError(f"unknown expert tensor {rest!r}")
    if rest.startswith(("mlp.", "input_layernorm.", "post_attention_layernorm.")):
        return (rest,)
    raise KeyError(f"unknown decoder-layer tensor {rest!r}")


def vllm_kimi_names(names: Iterable[str] | Mapping[str, torch.Tensor],
                    num_experts: int | None = None) -> dict[str, tuple[str, ...]]:
    """Each transformers name → the vLLM checkpoint names of the pieces it is cut into, in
    memory order (the module docstring lists them). Given a state dict, the expert count is read from the
    fused expert tensors; given bare names, pass `num_experts`. Names outside a Kimi Linear
    model raise KeyError."""
    if isinstance(names, Mapping) and num_experts is None:
        fused = [t for n, t in names.items() if n.endswith("mlp.experts.down_proj")]
        num_experts = getattr(fused[0], "shape", fused[0])[0] if fused else None  # a tensor's or a shape's
    out = {}
    for name in names:
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[name] = (name,)
        elif name.startswith("model.layers."):
            index, rest = name.removeprefix("model.layers.").split(".", 1)
            out[name] = tuple(f"model.layers.{index}.{s}" for s in _vllm_suffix(rest, num_experts))
        else:
            raise KeyError(f"{name!r} is not a tensor of transformers' KimiLinearForCausalLM")
    return out


def _piece_shape(name: str, shape: torch.Size, pieces: int) -> tuple[int, ...]:
    """The shape of each vLLM piece of the transformers tensor `name` of `shape`."""
    if pieces == 1:
        return tuple(shape)
    if name.endswith("conv1d.weight"):  # [3P, 1, K] → [P, 1, K]: vLLM keeps nn.Conv1d's layout
        return (shape[0] // pieces, *shape[1:])
    if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] → [I, H]: gate rows, then up rows
        return (shape[1] // 2, shape[2])
    return tuple(shape[1:])  # experts.down_proj [E, H, I] → [H, I]


def vllm_kimi_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers state dict (parameters and buffers) under vLLM's checkpoint names, fused
    tensors cut into their pieces: views of contiguous tensors (no copy); `.contiguous()` them to save."""
    names = vllm_kimi_names(state)
    out = {}
    for name, tensor in state.items():
        targets = names[name]
        pieces = tensor.reshape(len(targets), *_piece_shape(name, tensor.shape, len(targets)))
        out.update(zip(targets, pieces.unbind(0)))
    return out


def hf_kimi_state(vllm_state: Mapping[str, torch.Tensor], hf_shapes: Mapping[str, torch.Size]
                  ) -> dict[str, torch.Tensor]:
    """The inverse of `vllm_kimi_state`: transformers tensors of `hf_shapes` (name → shape, e.g.
    from `{n: t.shape for n, t in model.state_dict().items()}`) joined from vLLM-named pieces."""
    names = vllm_kimi_names(hf_shapes)  # the expert count: the fused down projection's first dimension
    return {name: torch.stack([vllm_state[t] for t in targets]).reshape(hf_shapes[name])
            for name, targets in names.items()}


def _write_checkpoint(model: Any, tokenizer: Any, directory: Path, dtype: torch.dtype | None) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415

    state = {n: t.detach().to("cpu", dtype if dtype is not None and t.is_floating_point() else t.dtype)
             for n, t in model.state_dict().items()}
    save_file({n: t.contiguous() for n, t in vllm_kimi_state(state).items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    config = vllm_kimi_config(model.config)
    config["dtype"] = str(dtype or next(iter(state.values())).dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def export_kimi_for_vllm(model: Any, tokenizer: Any, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the transformers Kimi Linear `model` into `out_dir` (made if missing) as a checkpoint
    vLLM 0.26 serves: config.json in Moonshot's schema, model.safetensors under vLLM's names
    (floating tensors cast to `dtype` if given), the generation config and `tokenizer` (if not
    None). Returns `out_dir`. Like the FP8 export it writes in place: a caller publishing the
    directory wraps the call in `atomic_directory` (track/atomic.py), as `k3post export-fp8` does."""
    if getattr(model.config, "model_type", None) != "kimi_linear":
        raise UserError(f"export_kimi_for_vllm: expected a Kimi Linear model (model_type 'kimi_linear'), "
                        f"got {getattr(model.config, 'model_type', None)!r}")
    vllm_kimi_config(model.config)  # refuse before writing anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_checkpoint(model, tokenizer, out, dtype)
    return out
