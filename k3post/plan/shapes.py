"""What the planner knows of a model: its shape and parameter counts, from its config alone.

A model spec's config (config.json of a `path:` directory — a directory holding only config.json
is enough here —, a GGUF's metadata for `builtin:` / `gguf:`, the config k3post builds for `tiny:`
and `kimi:`) is turned into the model on PyTorch's meta device: every parameter has its shape
and dtype and no storage, so a 32B model costs a few hundred milliseconds and no memory. The
counts are then the real ones (`sum(p.numel())`, tied embeddings counted once) rather than a
formula over the config, and `keep_layers` is applied to the config before construction.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from k3post.config.errors import UserError, located
from k3post.config.schema import ModelSpec


@dataclass(frozen=True)
class ModelShape:
    """A causal LM's sizes as the memory formulas need them (k3post/plan/memory.py).

    params: every parameter (tied ones once); block_params: the largest decoder block's;
    root_params: what no block owns (embeddings, final norm, LM head); linear_params: the
    parameters of the blocks' Linear layers (what FP8 QAT fake-quantises); lora_in_out: the
    summed in + out features of the Linear layers LoRA's default targets would wrap, per model;
    kv_per_token: the key/value cache elements one token adds over all layers (0 for a layer
    without one: KDA keeps a fixed state); moe_*: routed-expert sizes (0: a dense model).
    """

    name: str
    params: int
    block_params: int
    root_params: int
    linear_params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    kv_per_token: int
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate: int = 0
    moe_shared: int = 0
    moe_layers: int = 0
    lora_in_out: int = 0
    linear_state: int = 0  # elements of one KDA layer's recurrent state (heads × K × V), per sequence

    @property
    def active_params(self) -> int:
        """Parameters one token goes through (all of them for a dense model): 2·active is the
        forward FLOPs per token a MoE costs, not 2·params."""
        if not self.moe_experts:
            return self.params
        per_expert = 3 * self.hidden * self.moe_intermediate
        return self.params - self.moe_layers * (self.moe_experts - self.moe_top_k) * per_expert


class _VocabOnly:
    """Stands in for a tokenizer where a config needs only its length and special ids."""

    def __init__(self, size: int, pad: int | None, bos: int | None, eos: int | None):
        self.size, self.pad_token_id, self.bos_token_id, self.eos_token_id = size, pad, bos, eos

    def __len__(self) -> int:
        return self.size


def _directory_config(directory: Path) -> Any:
    from transformers import AutoConfig  # noqa: PLC0415

    if not (directory / "config.json").is_file():
        raise UserError(located(directory, "expected a model directory with config.json (the planner reads only the "
                                           "config)"))
    try:
        return AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(located(directory / "config.json", f"the model config does not load: {err}")) from err


def _gguf_config(path: Path) -> Any:
    if not path.is_file():
        raise UserError(located(path, "GGUF file not found"))
    return copy.deepcopy(_gguf_header_config(str(path.resolve())))


@functools.cache
def _gguf_header_config(path: str) -> Any:
    """A GGUF's config from its header (no tensors read); once per file (two teachers and a
    student of the same GGUF read it once)."""
    from transformers import AutoConfig  # noqa: PLC0415

    return AutoConfig.from_pretrained(Path(path).parent, gguf_file=Path(path).name)


def hf_config(spec: ModelSpec) -> Any:
    """The transformers config of the model `spec` names (no weights read; keep_layers applied)."""
    if spec.builtin is not None:
        from k3post.model.loading.load import smollm2_gguf_path  # noqa: PLC0415

        config = _gguf_config(smollm2_gguf_path())
    elif spec.gguf is not None:
        config = _gguf_config(Path(spec.gguf))
    elif spec.path is not None:
        config = _directory_config(Path(spec.path))
    elif spec.tiny is not None:
        from k3post.model.loading.tiny import build_tiny_tokenizer, tiny_config  # noqa: PLC0415

        config = tiny_config(spec.tiny, build_tiny_tokenizer())
    elif spec.kimi is not None:
        from k3post.model.loading.kimi import kimi_config  # noqa: PLC0415

        teacher = hf_config(spec.kimi.tokenizer_from)
        vocab = _VocabOnly(teacher.vocab_size, getattr(teacher, "pad_token_id", None),
                           getattr(teacher, "bos_token_id", None), getattr(teacher, "eos_token_id", None))
        config = kimi_config(spec.kimi, vocab)
    else:
        assert spec.transplant is not None
        config = hf_config(spec.transplant.base)
        config.vocab_size = spec.transplant.vocab_size
    if spec.keep_layers is not None:
        config.num_hidden_layers = len(spec.keep_layers)
        if getattr(config, "layer_types", None):
            config.layer_types = [config.layer_types[i] for i in spec.keep_layers]
        if getattr(config, "mlp_layer_types", None):
            config.mlp_layer_types = [config.mlp_layer_types[i] for i in spec.keep_layers]
    return config


def meta_model(config: Any) -> nn.Module:
    """The model of `config` on the meta device (shapes, no storage)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    return model


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _lora_in_out(blocks: nn.ModuleList, targets: tuple[str, ...]) -> int:
    return sum(m.in_features + m.out_features for block in blocks for name, m in block.named_modules()
               if isinstance(m, nn.Linear) and name.split(".")[-1] in targets)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shape_of(config: Any, name: str, lora_targets: tuple[str, ...] = LORA_TARGETS) -> ModelShape:
    """Sizes from the meta-device model of `config` (see ModelShape)."""
    from k3post.model.training.fsdp import decoder_blocks  # noqa: PLC0415

    model = meta_model(config)
    blocks = decoder_blocks(model)
    params, in_blocks = _numel(model), sum(_numel(b) for b in blocks)
    linear = sum(m.weight.numel() for b in blocks for m in b.modules() if isinstance(m, nn.Linear))
    text = getattr(config, "text_config", config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    moe = _moe_sizes(text)
    return ModelShape(
        name=name, params=params, block_params=max(_numel(b) for b in blocks), root_params=params - in_blocks,
        linear_params=linear, layers=len(blocks), hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, vocab=text.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", False)),
        kv_per_token=_kv_per_token(text, kv_heads, head_dim), lora_in_out=_lora_in_out(blocks, lora_targets), **moe)


def _full_attention_layers(text: Any) -> int:
    types = getattr(text, "layer_types", None)
    if not types:
        return text.num_hidden_layers
    return sum(1 for t in types if t in ("full_attention", "attention", "sliding_attention"))


def _kv_per_token(text: Any, kv_heads: int, head_dim: int) -> int:
    """Cache elements per token over all layers: K and V per KV head per full-attention layer;
    MLA (Kimi's full attention) caches its compressed latent + the shared rope key instead."""
    layers = _full_attention_layers(text)
    if getattr(text, "kv_lora_rank", None):
        return layers * (text.kv_lora_rank + text.qk_rope_head_dim)
    return layers * 2 * kv_heads * head_dim


def _moe_sizes(text: Any) -> dict[str, int]:
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 0
    if not experts or not getattr(text, "moe_intermediate_size", None):
        return {}
    kinds = getattr(text, "mlp_layer_types", None) or ["sparse"] * text.num_hidden_layers
    state = 0
    if getattr(text, "linear_num_heads", None):
        state = text.linear_num_heads * text.linear_head_dim * text.linear_head_dim
    return {"moe_experts": experts, "moe_top_k": text.num_experts_per_tok,
            "moe_intermediate": text.moe_intermediate_size, "moe_shared": getattr(text, "n_shared_experts", 0) or 0,
            "moe_layers": sum(1 for k in kinds if k == "sparse"), "linear_state": state}


def spec_label(spec: ModelSpec) -> str:
    for key in ("builtin", "path", "gguf"):
        value = getattr(spec, key)
        if value is not None:
            return Path(value).name if key != "builtin" else value
    return "tiny" if spec.tiny is not None else "kimi" if spec.kimi is not None else "transplant"


def model_shape(spec: ModelSpec) -> ModelShape:
    """The shape of the model a recipe's model spec names, from its config alone."""
    return shape_of(hf_config(spec), spec_label(spec))


def config_from_dict(data: dict) -> Any:
    """A transformers config from a config.json-style mapping (`model_type` picks the class)."""
    from transformers import AutoConfig  # noqa: PLC0415

    data = json.loads(json.dumps(data))
    return AutoConfig.for_model(data.pop("model_type"), **data)
