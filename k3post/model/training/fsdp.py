"""FSDP2 for Hugging Face causal LMs: `fully_shard` per decoder block and at the root.

Every parameter becomes a DTensor sharded on dim 0 across the learner group (`Shard(0)`); a
block's full weights exist only while that block computes (all-gathered before its forward and
again before its backward, freed after), and its gradients are reduce-scattered back to shards
as soon as its backward is done. The root group holds what no block owns (embeddings, final
norm, LM head — tied embeddings stay one parameter there).

Precision (`learner.precision`), bytes per parameter of persistent state (weights + grads +
AdamW's two moments), before activations and divided by the number of ranks:

| precision    | master weights | compute | grads / reduction | AdamW states | bytes/param |
|--------------|----------------|---------|-------------------|--------------|-------------|
| `fp32`       | fp32           | fp32    | fp32              | fp32         | 16          |
| `bf16`       | bf16           | bf16    | bf16              | bf16         | 8           |
| `bf16-mixed` | fp32 (sharded) | bf16    | fp32              | fp32         | 16 (+2 gathered per block) |

`bf16` is today's single-GPU mode: small updates below bf16's resolution (~0.4% of a weight)
are lost. `bf16-mixed` keeps fp32 master weights and moments and casts the all-gathered
weights to bf16 for compute (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`).

Activation checkpointing wraps each block's *forward* (not the module, so parameter names do
not change) in `torch.utils.checkpoint`: FSDP's hooks stay outside the checkpointed region, so
the recompute in backward runs on the weights FSDP has just all-gathered for the backward.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.optim.adam import adam
from torch.utils.checkpoint import checkpoint

Precision = Literal["fp32", "bf16", "bf16-mixed"]
BYTES_PER_PARAM = {"fp32": 16, "bf16": 8, "bf16-mixed": 16}


def resolve_precision(precision: str, device: str, model_dtype: str) -> Precision:
    """`auto`: bf16-mixed on GPUs; on CPUs what the student's dtype says (today's behaviour)."""
    if precision != "auto":
        return precision  # type: ignore[return-value]
    if device.startswith("cuda"):
        return "bf16-mixed"
    return "bf16" if model_dtype == "bfloat16" else "fp32"


def master_dtype(precision: Precision) -> torch.dtype:
    """The dtype of the sharded parameters (and so of the optimizer states)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of an HF causal LM: the ModuleList of layers of its base model
    (`model.model.layers` for Llama/Qwen/Mistral/Kimi Linear, `transformer.h` for GPT-2 style);
    failing those names, the base model's largest ModuleList."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    for name in ("layers", "h", "blocks"):
        found = getattr(base, name, None)
        if isinstance(found, nn.ModuleList) and len(found):
            return found
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no ModuleList of decoder blocks found to shard")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def checkpoint_blocks(blocks: nn.ModuleList) -> None:
    """Recompute each block's activations in backward instead of keeping them (in place; the
    module tree and parameter names are unchanged)."""
    for block in blocks:
        if not getattr(block, "_k3post_checkpointed", False):
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
            block._k3post_checkpointed = True


def mixed_precision(precision: Precision) -> MixedPrecisionPolicy:
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)  # compute and reduce in the parameters' dtype


class FSDPRoot(nn.Module):
    """The FSDP2 root around an HF model. k3post's logprob functions call the decoder stack and
    the LM head weight directly, never the HF forward, so the root group (embeddings, final
    norm, LM head) would stay sharded; a call `root(fn, *args)` runs `fn(hf_model, *args)`
    inside the root's forward, where FSDP has gathered that group (and reduce-scatters its
    gradients in backward). Parameter names inside `.model` are the HF names."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def shard_model(model: nn.Module, precision: Precision, activation_checkpointing: bool = False,
                compile_blocks: bool = False, unit: Literal["block", "model"] = "block") -> FSDPRoot:
    """FSDP2: each decoder block, then an `FSDPRoot` around the model (the default group is the
    mesh). Inputs are not cast (cast_forward_inputs=False): the root's inputs are masks and
    logprobs that must stay fp32; blocks get bf16 hidden states from the bf16 embedding anyway.

    Gradient reduction SUMS over ranks (divide factor 1): each rank's loss is already divided
    by the *global* token count, so the sum of the ranks' gradients is the one-process gradient
    (FSDP2's default would average, i.e. divide once more by the world size).

    `compile_blocks` (`train.compile`): each block compiled in place (`Module.compile`: names
    unchanged), after activation checkpointing and before sharding, as torchtitan orders them;
    FSDP's gathers stay outside the compiled graphs.

    `unit` (`learner.shard_unit`): "model" shards only at the root, so the whole model is one
    FSDP unit, gathered once per forward and not resharded until its backward is done (no
    re-gather): one gather, one cast and one reduce-scatter per micro-batch instead of one per
    block, at the memory of the full gathered weights."""
    blocks = decoder_blocks(model)
    if activation_checkpointing:
        checkpoint_blocks(blocks)
    if compile_blocks:
        for block in blocks:
            block.compile()
    policy = mixed_precision(precision)
    if unit == "block":
        for block in blocks:
            fully_shard(block, mp_policy=policy)
    root = FSDPRoot(model)
    fully_shard(root, mp_policy=policy, reshard_after_forward=unit == "block")
    sum_gradients(root)
    return root


def sum_gradients(root: nn.Module) -> None:
    """Every FSDP unit under `root` reduces its gradients by a plain SUM over ranks (divide factor
    1): each rank's loss is already divided by the step's global count."""
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of the (DTensor) gradients, clipped to `max_norm`; every rank gets the
    same figure.

    FSDP's grads are `Shard(0)` DTensors whose local shards partition each full gradient, so
    ‖g‖² = Σ_ranks Σ_tensors ‖g_local‖²: each rank takes the norm of its own shards (one foreach
    kernel over plain tensors), one all-reduce of a scalar sums the squares, and the clip
    multiplies the local shards in place. Going through DTensor's dispatch instead costs a
    sharding propagation per op over every grad: host time that bounds small students' steps.
    Grads with any other placement (replicated) take the DTensor path, which counts them once."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if not all(_sharded_dim0_only(g) for g in grads):
        return clip_grad_norm_dtensor(params, max_norm)
    shards = [local(g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(shards)), 2.0)
    if isinstance(grads[0], DTensor) and grads[0].device_mesh.size() > 1:
        squared = total.float().square()
        torch.distributed.all_reduce(squared, group=grads[0].device_mesh.get_group())
        total = squared.sqrt().to(total.dtype)
    torch._foreach_mul_(shards, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return float(total)


def clip_grad_norm_dtensor(params: list[nn.Parameter], max_norm: float) -> float:
    """`clip_grad_norm` through DTensor's own ops (any placement; each op dispatched per grad)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    total = total.full_tensor() if isinstance(total, DTensor) else total
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def _sharded_dim0_only(t: torch.Tensor) -> bool:
    return not isinstance(t, DTensor) or all(p == Shard(0) for p in t.placements)


class ShardLocalAdamW(torch.optim.AdamW):
    """AdamW whose update runs on each rank's local shards as plain tensors.

    AdamW is elementwise, so updating the local shard of every parameter with the local shards
    of its grad and moments is the whole sharded update: the same kernels on the same numbers
    as torch's AdamW over the DTensors (bit-identical), without DTensor's dispatch (a sharding
    propagation over every parameter, grad and moment for each foreach or fused call, and per
    op and per tensor on the CPU's single-tensor path). The parameters and the state stay
    DTensors, so distributed checkpoints save and reshard them as before."""

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "ShardLocalAdamW takes no closure"
        for group in self.param_groups:
            lists: tuple[list, ...] = ([], [], [], [], [], [])  # params, grads, m, v, max v, steps
            has_complex = self._init_group(group, *lists)
            beta1, beta2 = group["betas"]
            adam(
                *([local(t) for t in tensors] for tensors in lists), amsgrad=group["amsgrad"],
                has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                fused=group["fused"], grad_scale=None, found_inf=None,
                decoupled_weight_decay=group["decoupled_weight_decay"])


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) tensor, as a plain tensor view."""
    return t.to_local() if isinstance(t, DTensor) else t
