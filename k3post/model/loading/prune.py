"""Layer-pruned initialisation: a student made of a subset of a model's decoder layers.

Keeping the embedding, the final norm, the head and a chosen subset of blocks (ShortGPT-style
depth pruning) gives a student that shares the teacher's tokenizer and starts far closer to
the teacher than a random init, which is what makes distillation on a CPU budget feasible.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from k3post.config.errors import UserError


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The ModuleList of decoder blocks (`model.model.layers` for Llama-family models)."""
    base = getattr(model, model.base_model_prefix, None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UserError(f"{type(model).__name__}: cannot find its decoder layers to prune (expected .model.layers)")
    return layers


def keep_decoder_layers(model: PreTrainedModel, keep: list[int]) -> PreTrainedModel:
    """Keep `keep` (indices into the current layers, in order); renumber the layers' cache slots."""
    layers = decoder_layers(model)
    bad = [i for i in keep if not 0 <= i < len(layers)]
    if bad:
        raise UserError(f"keep_layers {bad}: the model has layers 0..{len(layers) - 1}")
    kept = nn.ModuleList(layers[i] for i in keep)
    for new_index, layer in enumerate(kept):
        # The KV cache is indexed by layer_idx; stale indices would overwrite each other.
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_index
    getattr(model, model.base_model_prefix).layers = kept
    config = model.config
    for per_layer in ("layer_types", "mlp_layer_types"):  # mlp_layer_types: dense/MoE (Kimi Linear)
        if getattr(config, per_layer, None) is not None:
            setattr(config, per_layer, [getattr(config, per_layer)[i] for i in keep])
    config.num_hidden_layers = len(keep)
    return model
