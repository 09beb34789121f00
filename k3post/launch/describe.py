"""One-line descriptions printed at start: where the local cluster's CPU slots come from, and
the learner group's layout. Pure functions of numbers and specs, so tests can read the text."""

from __future__ import annotations

from k3post.config.learner_schema import LearnerSpec


def _count(value: float) -> str:
    return f"{value:g}"


def cpu_slots_line(slots: int, requested: int | None, needed: float, cores: int, placement: bool = False) -> str:
    """'4 CPU slots: the recipe's actors ask for 4 (resources.*.num_cpus × replicas summed), this machine has 2 cores'.

    requested: `ray.num_cpus` from the recipe (None: not set); needed: what the actors ask for;
    placement: the count is the sum of `resources.placement`'s bundles.
    """
    summed = "resources.placement's bundles summed" if placement else "resources.*.num_cpus × replicas summed"
    asks = f"the recipe's actors ask for {_count(needed)} ({summed})"
    note = " (slots are logical: actors whose phases run one after another share cores)" if slots > cores else ""
    if requested is not None:
        return f"{slots} CPU slots: ray.num_cpus in the recipe; {asks}, this machine has {cores} cores{note}"
    if needed > cores:
        return f"{slots} CPU slots: {asks}, this machine has {cores} cores{note}"
    return f"{slots} CPU slots: this machine's {cores} cores ({asks})"


def learner_group_line(ranks: int, spec: LearnerSpec, gpus_per_rank: float, in_run_group: bool) -> str:
    """'learner group: 2 ranks (1 GPU each), placement pack, precision auto, sharding auto (FSDP2 over 2 ranks)'."""
    device = f"{_count(gpus_per_rank)} GPU each" if gpus_per_rank else "CPU"
    placement = "bundles of the run's placement group (resources.placement)" if in_run_group else spec.placement
    return (f"learner group: {ranks} ranks ({device}), placement {placement}, precision {spec.precision}, "
            f"sharding {spec.sharding} (FSDP2 over {ranks} ranks), shard unit {spec.shard_unit}")
