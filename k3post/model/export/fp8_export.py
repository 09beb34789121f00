"""Writing an FP8 checkpoint that vLLM serves: the compressed-tensors "float-quantized" layout.

For every Linear the QAT run fake-quantized (model/quant/qat.py: same eligibility), the exported
checkpoint holds

    <layer>.weight        float8_e4m3fn [out, in]    q = round_e4m3(clamp(w / s, ±448))
    <layer>.weight_scale  float32       [out, 1]     s = amax|w_row| / 448   (one scale per row)

and `config.json` gets a `quantization_config` that declares per-channel static weights and
dynamic per-token FP8 activations — exactly the scheme the QAT forward simulated, so the served
model computes what training saw (up to kernel rounding). Everything else (embeddings, norms,
lm_head) stays in the checkpoint's dtype and is listed under `ignore`.

This writes the tensors directly, so it runs on a CPU (torchao's `convert` step needs an FP8
GPU: SM ≥ 8.9). The scale is divided in the weight's own dtype first, as torchao does, so a
bf16 model's export matches its QAT rounding bit for bit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from k3post.model.quant.qat import fp8_eligible

E4M3_MAX = 448.0
QUANT_SUFFIXES = ("weight", "weight_scale")


def quantize_rows_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 per-row scale) with weight ≈ q.float() * scale."""
    scale = (weight.abs().amax(dim=1, keepdim=True) / E4M3_MAX).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_rows_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def quantization_config(ignore: list[str]) -> dict:
    """compressed-tensors FP8 W8A8: per-channel static weights, dynamic per-token activations."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ignore,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                        "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        }},
    }


def export_fp8(model: nn.Module, tokenizer, out_dir: Path) -> dict[str, int]:
    """Write `model` (plain or QAT-prepared) as an FP8 compressed-tensors checkpoint."""
    out_dir.mkdir(parents=True, exist_ok=True)
    quantized = {name for name, module in model.named_modules() if fp8_eligible(module, name)}
    linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module_name = name.rsplit(".", 1)[0]
        if module_name in quantized and name.endswith(".weight"):
            q, scale = quantize_rows_fp8(tensor.detach())
            state[name], state[f"{module_name}.weight_scale"] = q.contiguous(), scale.contiguous()
        else:
            state[name] = tensor.detach().contiguous()
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied:
        state.pop("lm_head.weight", None)  # re-tied from the embedding at load time
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(sorted(n for n in linear_names if n not in quantized))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {"fp8_layers": len(quantized), "kept_layers": len(linear_names) - len(quantized)}


def tensor_kind(name: str) -> str:
    """A state-dict name's kind: the module's own name with layer and expert numbers dropped,
    e.g. `model.layers.3.self_attn.q_proj.weight` → `self_attn.q_proj`; `…bias` keeps `.bias`."""
    parts = [p for p in name.split(".") if not p.isdigit() and p != "model"]
    suffix = parts.pop() if parts and parts[-1] in ("weight", "bias") else ""
    kind = ".".join(parts[-2:]) if len(parts) > 1 and re.search(r"_proj$|^w\d$", parts[-1]) else ".".join(parts[-1:])
    return kind + (".bias" if suffix == "bias" else "")


def fp8_tensor_kinds(model: nn.Module) -> list[dict]:
    """What `export_fp8` does to each kind of tensor: [{kind, tensors, parameters, fp8}], the
    FP8 kinds first, each group by parameter count."""
    quantized = {name for name, module in model.named_modules() if fp8_eligible(module, name)}
    tied = getattr(model.config, "tie_word_embeddings", False)
    kinds: dict[tuple[str, bool], list[int]] = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # stored once, as the embedding
        fp8 = name.endswith(".weight") and name.rsplit(".", 1)[0] in quantized
        row = kinds.setdefault((tensor_kind(name), fp8), [0, 0])
        row[0], row[1] = row[0] + 1, row[1] + tensor.numel()
    rows = [{"kind": k, "fp8": fp8, "tensors": n, "parameters": p} for (k, fp8), (n, p) in kinds.items()]
    return sorted(rows, key=lambda r: (not r["fp8"], -r["parameters"]))
