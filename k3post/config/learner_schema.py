"""`learner:` recipe keys — how the learner computes, beyond what it optimises.

The learner is a group of `resources.learner.replicas` ranks (one GPU each on GPUs). These
keys say how each rank holds the student (engine/sharded/sharded_learner.py, docs/learner.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from k3post.config.base import Strict


class LearnerSpec(Strict):
    """precision:
    - auto: bf16-mixed on GPUs; on CPUs the student's dtype as today (fp32 unless it says bfloat16);
    - fp32: fp32 weights, compute, gradients and AdamW states (16 bytes/parameter);
    - bf16: pure bf16 weights and AdamW states (8 bytes/parameter; small updates are lost);
    - bf16-mixed: fp32 sharded master weights and AdamW states, bf16 compute, fp32 gradient
      reduction (16 bytes/parameter).
    sharding: auto = FSDP2 when the group has more than one rank or the precision is
    bf16-mixed (one rank then still runs the FSDP code path); always = FSDP2 also on one rank
    in fp32/bf16; a single unsharded rank otherwise (today's learner, unchanged)."""

    precision: Literal["auto", "fp32", "bf16", "bf16-mixed"] = Field("auto", description=(
        "auto: bf16-mixed on GPUs, the student's dtype on CPUs; fp32; bf16 (pure: weights and AdamW states); "
        "bf16-mixed (fp32 master weights and AdamW states, bf16 compute)"))
    activation_checkpointing: bool = Field(False, description="recompute each decoder block's activations in backward")
    sharding: Literal["auto", "always"] = Field("auto", description=(
        "auto: FSDP2 with more than one rank or with bf16-mixed, else one unsharded rank; always: FSDP2 on one "
        "rank too"))
    weight_bucket_mb: PositiveInt = Field(512, description="size of a bucket of full tensors gathered for weight sync")
    # On Ray the ranks are one placement group of `resources.learner.replicas` bundles.
    placement: Literal["pack", "spread", "strict_pack"] = Field("pack", description=(
        "where the learner's ranks go: pack on as few nodes as fit (fast collectives), spread on as many as "
        "possible, strict_pack on one node or not at all"))
    # model: +2 bytes/parameter per rank in bf16-mixed, ~25x fewer hooks per step (docs/learner.md).
    shard_unit: Literal["block", "model"] = Field("block", description=(
        "what FSDP2 gathers at once: block (one decoder block at a time, the memory-lean default) or model "
        "(the whole model, kept through its backward: for small, host-bound students)"))
