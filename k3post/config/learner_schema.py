"""`learner:` recipe keys — how the learner computes, beyond what it optimises.

The learner is a group of `resources.learner.replicas` ranks (one GPU each on GPUs). These
keys say how each rank holds the student (engine/sharded_learner.py, docs/learner.md).
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

    precision: Literal["auto", "fp32", "bf16", "bf16-mixed"] = "auto"
    activation_checkpointing: bool = Field(False, description="recompute each decoder block's activations in backward")
    sharding: Literal["auto", "always"] = "auto"
    weight_bucket_mb: PositiveInt = Field(512, description="size of a bucket of full tensors gathered for weight sync")
    # On Ray the ranks are one placement group of `resources.learner.replicas` bundles: pack puts
    # them on as few nodes as fit (fast collectives), spread on as many as possible;
    # strict_pack insists on one node and fails to schedule otherwise.
    placement: Literal["pack", "spread", "strict_pack"] = "pack"
    # What FSDP2 gathers at once. block: each decoder block (one block's full weights alive at a
    # time: the memory-lean default). model: the whole model as one unit, gathered once per
    # forward and kept through its backward (+2 bytes/parameter per rank in bf16-mixed) with ~25x
    # fewer hooks per step: for small students whose step is host-bound (docs/learner.md).
    shard_unit: Literal["block", "model"] = "block"
