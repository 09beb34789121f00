"""The Ray resources of one actor group (`resources.*`, a teacher's and a reward model's `resources:`)."""

from __future__ import annotations

from pydantic import Field, PositiveInt

from k3post.config.base import Strict


class ResourceSpec(Strict):
    """Ray resources of one actor group: `replicas` actors, each with these CPUs/GPUs."""

    replicas: PositiveInt = Field(1, description="how many actors the group has (for the learner: its ranks)")
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs each actor reserves")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each actor reserves (a fraction shares one GPU); more "
                                                   "than 0 runs the engine on cuda")
    # Samplers and the learner run alone in their phase and should use every core; teacher groups
    # score at the same time, so on a small machine give each a share (the quickstart gives each
    # teacher 1 of 2 cores).
    threads: PositiveInt | None = Field(None, description="torch intra-op threads per actor; null: every core of "
                                                          "the node (teachers score at once: give each a share)")
