"""Does each device hold what lands on it, and if not, what would make it fit.

A device fits when the sum over its tenants of (peak × 1.05 + 0.6 GiB) is at most its memory:
the peaks are allocated bytes (what torch.cuda.max_memory_allocated reports); each process on a
GPU also holds a CUDA context (~0.5 GiB) and the caching allocator's slack (~5% of what it
allocates). A vLLM engine's reservation already is the share of the device it takes, context
included; engines in sleep mode (`vllm.sleep`) take turns, so only the largest of them counts
whole, the others a CUDA context each. A CPU actor's peak is host memory: all the CPU actors of a node share it, each a
process that also holds Python, torch and transformers (about 1 GiB resident before any model).

The fixes tried for a learner that does not fit are the recipe's own keys, one at a time, each
re-estimated with the same formulas: learner.activation_checkpointing, loss.reference.kind
grad_buffer instead of copy, learner.shard_unit block, a smaller optim.micro_batch_size, more
learner ranks (resources.learner.replicas). For a teacher: bfloat16 weights, or vLLM over
enough GPUs for its weights (resources.num_gpus, tensor parallel); for any engine: more replicas.
"""

from __future__ import annotations

import math
from typing import Any

from k3post.plan.groups import GroupNeed, Lengths, learner_setup
from k3post.plan.memory import GIB, learner_peak
from k3post.plan.placement import Device

SLACK, CONTEXT, HOST_PROCESS = 1.05, 0.6 * GIB, 1.0 * GIB


def host_footprint(need_bytes: float) -> float:
    """What a CPU actor takes of its node's host memory: its peak with slack, and its process."""
    return need_bytes * SLACK + HOST_PROCESS


def footprint(need_bytes: float, vllm: bool) -> float:
    """What a tenant takes of a device: its peak with the allocator's slack and a CUDA context."""
    return need_bytes if vllm else need_bytes * SLACK + CONTEXT


def device_use(device: Device, vllm_tenants: set[str], sleeping: frozenset[str] = frozenset()) -> float:
    """The device's peak: every resident tenant, plus the largest of the sleeping vLLM engines
    (`vllm.sleep`: they take turns, one awake at a time) and a CUDA context for each other one
    (a sleeping engine's process keeps its context and little else)."""
    resident, asleep = 0.0, []
    for label, need in device.tenants:
        key = label.rsplit("[", 1)[0]
        if key in sleeping:
            asleep.append(footprint(need, True))
        else:
            resident += footprint(need, key in vllm_tenants)
    return resident + (max(asleep) + CONTEXT * (len(asleep) - 1) if asleep else 0.0)


def _fits_learner(recipe: Any, lengths: Lengths, shape: Any, budget: float, **changes: Any) -> float | None:
    setup = learner_setup(recipe, lengths, **changes)
    peak = footprint(learner_peak(shape, setup).total, False)
    return peak if peak <= budget else None


def learner_fixes(recipe: Any, lengths: Lengths, group: GroupNeed, budget: float) -> list[str]:
    """Recipe changes, one at a time, after which one learner rank fits `budget` bytes."""
    s, shape = group.setup, group.shape
    trials: list[tuple[str, dict]] = []
    if not s.activation_checkpointing:
        trials.append(("learner.activation_checkpointing=true", {"activation_checkpointing": True}))
    if s.reference == "copy":
        trials.append(("loss.reference.kind=grad_buffer", {"reference": "grad_buffer"}))
    if s.sharded and s.shard_unit == "model":
        trials.append(("learner.shard_unit=block", {"shard_unit": "block"}))
    micro = s.micro_batch // 2
    while micro >= 1:
        trials.append((f"optim.micro_batch_size={micro}", {"micro_batch": micro}))
        micro //= 2
    for ranks in (2 * s.ranks, 4 * s.ranks, 8 * s.ranks):
        trials.append((f"resources.learner.replicas={ranks}", {"ranks": ranks, "sharded": True}))
    if not s.activation_checkpointing:
        both = {"ranks": 2 * s.ranks, "sharded": True, "activation_checkpointing": True}
        trials.append((f"resources.learner.replicas={2 * s.ranks} learner.activation_checkpointing=true", both))
    fixes = []
    for words, changes in trials:
        peak = _fits_learner(recipe, lengths, shape, budget, **changes)
        if peak is not None:
            fixes.append(f"{words} ({peak / GIB:.1f} GiB)")
        if len(fixes) == 3:
            break
    return fixes


def serving_fixes(group: GroupNeed, budget: float, dtype_bytes: int) -> list[str]:
    """Changes after which one actor of a teacher / sampler / reward model group fits `budget`
    bytes: its rows' part (everything but the weights and a sync bucket grows with the rows)
    spread over k times the replicas, bf16 weights, or vLLM over enough GPUs for the weights."""
    key, parts = group.key, group.need.parts
    prefix = f"teachers.{key.split('/', 1)[1]}." if key.startswith("teacher/") else (
        "resources.samplers." if key == "samplers" else f"reward_models.{key.split('/', 1)[-1]}.")
    resources = prefix if key == "samplers" else prefix + "resources."
    weights, fixed = parts.get("weights", 0.0), parts.get("weights", 0.0) + parts.get("weight-sync bucket", 0.0)
    rows_part = group.need.total - fixed
    fixes = []
    for k in (2, 4, 8):
        peak = footprint(fixed + rows_part / k, False)
        if peak <= budget:
            fixes.append(f"{resources}replicas={k * group.replicas} ({1 / k:.2g} of the rows per actor: "
                         f"{peak / GIB:.1f} GiB; {k * group.replicas} actors)")
            break
    if dtype_bytes == 4 and key != "samplers" and footprint(group.need.total - weights / 2, False) <= budget:
        fixes.append(f"{prefix}model.dtype=bfloat16 (weights {weights / 2 / GIB:.1f} GiB)")
    if key.startswith("teacher/") and group.shape is not None:
        gpus = max(1, math.ceil(group.shape.params * 2 / (0.9 * budget * 0.8)))
        gpus = 2 ** math.ceil(math.log2(gpus))
        per_gpu = group.shape.params * 2 / gpus / GIB
        fixes.append(f"{prefix}engine=vllm {resources}num_gpus={gpus} (its weights {per_gpu:.1f} GiB per GPU in bf16, "
                     f"the rest of its 0.9 of each GPU KV cache)")
    return fixes
