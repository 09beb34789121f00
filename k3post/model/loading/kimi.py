"""Kimi Linear students: `KimiLinearForCausalLM` (transformers) built from a `KimiSpec`.

The architecture (Kimi Linear, arXiv 2510.26692; the student shape of Kimi K3) interleaves
  - KDA layers: Kimi Delta Attention, a gated delta-rule linear attention whose state is a
    fixed [K, V] matrix per head (no KV cache growth), with a per-channel forget gate;
  - MLA layers: DeepSeek-style multi-head latent attention (full softmax attention over a
    compressed KV latent; NoPE in Kimi Linear), about one in four layers;
  - MoE MLPs: sigmoid-scored top-k routing over `num_experts` routed experts plus shared
    experts, the first `first_k_dense` layers dense.

Pitfalls handled here (REFERENCE §8.2): transformers' default `layer_types` puts full
attention at layers 4, 8, ... so a model of <= 4 layers has none and `generate` fails;
`layer_types` is therefore always explicit. The default pad/bos/eos ids (163839, ...) lie
outside a small vocabulary, so they are taken from the tokenizer. `num_key_value_heads` must
equal the MLA head count (the default 32 would make the KV repeat factor 0).

The KDA ops (`chunk_kda`, `fused_recurrent_kda`) and the short convolutions resolve, at import
of transformers' Kimi module, to: the `fla` package's Triton kernels if importable, else the
pure-PyTorch reference (correct, much slower). `kernel_report` says which one a process got.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass

import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from k3post.config.errors import UserError
from k3post.config.schema import KimiSpec

logger = logging.getLogger("k3post.model.loading.kimi")

FULL, LINEAR = "full_attention", "linear_attention"
# A random body passes the embedding almost unchanged to the head, so with a teacher's embedding
# and head (the same matrix in SmolLM2) the student starts as "repeat the last token" with a
# saturated softmax: on its own samples entropy 0.000 and a reverse-KL gradient norm of 1e-3
# (the 77.6M recipe student, measured). Final-norm weight 0.1 starts it near uniform (entropy
# 10.3 of ln V = 10.8 nats, gradient norm 8) with the teacher's geometry intact (docs/kimi.md).
INIT_LOGIT_SCALE_WITH_TEACHER = 0.1
# op name in transformers' Kimi module -> (the package transformers tries first, its module path)
KDA_OPS = {
    "chunk_kimi_delta_attention": ("fla", "fla.ops.kda"),
    "recurrent_kimi_delta_attention": ("fla", "fla.ops.kda"),
    "causal_conv1d_fn": ("causal_conv1d", "causal_conv1d"),
    "causal_conv1d_update": ("causal_conv1d", "causal_conv1d"),
}


@dataclass
class Embeddings:
    """A model's input embedding and output head, [V, H] each (the same storage when tied)."""

    input_VH: torch.Tensor
    output_VH: torch.Tensor


def embeddings_of(model: PreTrainedModel) -> Embeddings:
    return Embeddings(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach())


def layer_types(num_layers: int, full_attention_every: int) -> list[str]:
    """MLA at every `full_attention_every`-th layer (1-based), KDA elsewhere; never zero MLA
    layers: if the stride skips them all, the last layer is MLA."""
    types = [FULL if (i + 1) % full_attention_every == 0 else LINEAR for i in range(num_layers)]
    if FULL not in types:
        types[-1] = FULL
    return types


def kimi_config(spec: KimiSpec, tokenizer: PreTrainedTokenizerBase) -> KimiLinearConfig:
    """The transformers config of a spec; vocabulary and special ids come from the tokenizer."""
    return KimiLinearConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        layer_types=layer_types(spec.num_layers, spec.full_attention_every),
        mlp_layer_types=["dense" if i < spec.first_k_dense else "sparse" for i in range(spec.num_layers)],
        linear_num_heads=spec.linear_num_heads,
        linear_head_dim=spec.linear_head_dim,
        linear_conv_kernel_dim=spec.conv_kernel_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        kv_lora_rank=spec.kv_lora_rank,
        q_lora_rank=spec.q_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
        n_shared_experts=spec.num_shared_experts,
        moe_intermediate_size=spec.moe_intermediate_size,
        routed_scaling_factor=spec.routed_scaling_factor,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def copy_embeddings(model: KimiLinearForCausalLM, source: Embeddings) -> None:
    """Copy a teacher's embedding and head into the student: the teacher's matrices may have
    more rows than the tokenizer (padded vocabularies); the first V rows are the tokenizer's."""
    for target, weight in ((model.get_input_embeddings().weight, source.input_VH),
                           (model.get_output_embeddings().weight, source.output_VH)):
        (V, H), (V_src, H_src) = target.shape, weight.shape
        if H_src != H or V_src < V:
            raise UserError(f"kimi.init_embeddings_from: the teacher's embedding is {V_src}x{H_src}, the student "
                            f"needs {V}x{H} (same hidden_size, vocabulary at least the tokenizer's)")
        with torch.no_grad():
            target.copy_(weight[:V].to(target.dtype))


def build_kimi_student(spec: KimiSpec, tokenizer: PreTrainedTokenizerBase,
                       teacher_embeddings: Embeddings | None = None) -> KimiLinearForCausalLM:
    """A seeded random Kimi Linear model (fp32, eval mode), embeddings optionally from a teacher.

    The final RMSNorm starts at `spec.final_norm_init` (default: 0.1 with teacher embeddings,
    see INIT_LOGIT_SCALE_WITH_TEACHER; 1.0 without). Every process that builds the same spec gets
    the same weights (learner and samplers agree before the first sync)."""
    config = kimi_config(spec, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = KimiLinearForCausalLM(config)
    if teacher_embeddings is not None:
        copy_embeddings(model, teacher_embeddings)
    final_norm = spec.final_norm_init or (INIT_LOGIT_SCALE_WITH_TEACHER if teacher_embeddings is not None else 1.0)
    with torch.no_grad():
        model.model.norm.weight.fill_(final_norm)
    return model.eval()


def _op_backend(name: str) -> str:
    """'torch' (the reference fallback) or the package whose kernel transformers bound."""
    from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: PLC0415

    func = getattr(modeling_kimi_linear, name, None)
    while func is not None:
        closure = inspect.getclosurevars(func).nonlocals if inspect.isfunction(func) else {}
        if "is_new_implementation" in closure:
            return KDA_OPS[name][0] if closure["is_new_implementation"] else "torch"
        func = getattr(func, "__wrapped__", None)
    return "unknown"


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:  # noqa: BLE001 (fla.ops raises whatever triton's absence raises)
        return False


def kernel_report(model: PreTrainedModel) -> dict:
    """Which implementation each part of a Kimi model runs in this process.

    `kda_ops`: per KDA op, 'fla'/'causal_conv1d' (kernels) or 'torch' (the reference fallback);
    `kda_layers`/`mla_layers`/`moe_layers`: decoder layer indices; `attn_implementation`: what
    the MLA layers use (sdpa/eager/flash); `fla_kernels`: whether `fla.ops.kda` imports (needs
    triton, so never on a CPU-only torch)."""
    config = model.config
    types = list(config.layer_types)
    return {
        "kda_layers": [i for i, t in enumerate(types) if t == LINEAR],
        "mla_layers": [i for i, t in enumerate(types) if t == FULL],
        "moe_layers": [i for i, t in enumerate(config.mlp_layer_types) if t == "sparse"],
        "kda_ops": {name: _op_backend(name) for name in KDA_OPS},
        "fla_kernels": _importable("fla.ops.kda"),
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "device": str(next(model.parameters()).device),
    }


_reported = False


def log_kernel_report_once(model: PreTrainedModel) -> dict:
    """Log `kernel_report` the first time a process loads a Kimi model (a warning when the
    KDA ops run the PyTorch fallback on a GPU, where it is an order of magnitude slower)."""
    global _reported
    report = kernel_report(model)
    if not _reported:
        _reported = True
        fallback = [name for name, backend in report["kda_ops"].items() if backend == "torch"]
        level = logging.WARNING if fallback and report["device"].startswith("cuda") else logging.INFO
        logger.log(level, "Kimi student: KDA layers %s, MLA layers %s, MoE layers %s; torch fallback for %s; "
                   "attention %s", report["kda_layers"], report["mla_layers"], report["moe_layers"],
                   fallback or "none", report["attn_implementation"])
    return report
