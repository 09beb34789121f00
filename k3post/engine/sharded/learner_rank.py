"""Which learner a rank runs: today's one-process `Learner`, or a `ShardedLearner` rank.

The Ray layer builds one of these per learner actor (`resources.learner.replicas` of them),
each with its `RankSpec`, and calls every method on every rank; rank 0's return value is the
group's. One rank with no sharding asked for is today's learner exactly (the quickstart's
figures do not move); anything else is the FSDP2 code path, one rank included.
"""

from __future__ import annotations

from k3post.config.learner_schema import LearnerSpec
from k3post.engine.sharded.rank import RankSpec
from k3post.model.training.fsdp import resolve_precision


def uses_sharding(spec: LearnerSpec, world_size: int, device: str, student_dtype: str) -> bool:
    """FSDP2 when the group has several ranks, when asked for (`sharding: always`), or when the
    precision is bf16-mixed (fp32 masters with bf16 compute is FSDP's MixedPrecisionPolicy)."""
    precision = resolve_precision(spec.precision, device, student_dtype)
    return world_size > 1 or spec.sharding == "always" or precision == "bf16-mixed"


def check_unsharded(spec: LearnerSpec, device: str, student_dtype: str) -> None:
    """One unsharded rank computes in the student's dtype: a precision that says otherwise, or
    activation checkpointing (a sharded-path feature), would be silently ignored."""
    from k3post.config.errors import UserError  # noqa: PLC0415

    precision = resolve_precision(spec.precision, device, student_dtype)
    wanted = "bf16" if student_dtype == "bfloat16" else "fp32"
    if precision != wanted:
        raise UserError(f"learner.precision: {spec.precision} with one unsharded rank trains in the student's dtype "
                        f"({student_dtype}); set learner.sharding: always, or the student's dtype")
    if spec.activation_checkpointing:
        raise UserError("learner.activation_checkpointing needs the sharded learner: set learner.sharding: always")
    if spec.shard_unit != "block":
        raise UserError(f"learner.shard_unit: {spec.shard_unit} needs the sharded learner: set learner.sharding: always")


def learner_class(config, spec: LearnerSpec, world_size: int) -> type:
    """The class each of `world_size` ranks runs: `ShardedLearner(config, rank, spec)` or, for
    one unsharded rank, `Learner(config)` (whose options `spec` must not contradict)."""
    if uses_sharding(spec, world_size, config.device, config.student.dtype):
        from k3post.engine.sharded.sharded_learner import ShardedLearner  # noqa: PLC0415

        return ShardedLearner
    from k3post.engine.learner.learner import Learner  # noqa: PLC0415

    check_unsharded(spec, config.device, config.student.dtype)
    return Learner


def group_backend(device: str) -> str:
    """The learner group's collective backend: NCCL between GPUs, gloo on CPUs."""
    return "nccl" if device.startswith("cuda") else "gloo"


def make_learner(config, spec: LearnerSpec | None = None, rank: RankSpec | None = None):
    """The learner for this rank. `config.device` must agree with the rank's backend
    (cuda ↔ nccl): a rank on a GPU uses it, a learner never asks for GPUs it leaves idle."""
    spec, rank = spec or LearnerSpec(), rank or RankSpec()
    if rank.backend != group_backend(config.device):
        raise ValueError(f"a {rank.backend} learner rank cannot compute on {config.device!r}")
    from k3post.engine.learner.learner import Learner  # noqa: PLC0415

    cls = learner_class(config, spec, rank.world_size)
    return Learner(config) if cls is Learner else cls(config, rank, spec)
