"""`train.drift`: what the drift gate does when the sampler and the learner disagree
(algo/drift.py for the figures and the maths, loops/drift_gate.py for the gate, docs/learner.md).

    train:
      drift:
        warn_abs_diff: 0.1        # mean |log π − log μ| above this: one warning line, drift/warned = 1
        stop_abs_diff: 1.0        # above this the run stops, naming the step and the figure (null: never)
        correction: none          # above warn_abs_diff: none | tis | mis, on from that step to the end
        tis_cap: 2.0              # tis: each token's weight min(π/μ, tis_cap)
        mis_threshold: 2.0        # mis: tokens with π/μ outside [1/mis_threshold, mis_threshold] dropped
        teacher_check_every: 0    # every N steps, each teacher's scores against an HF recomputation (0: never)
        teacher_warn_abs_diff: 0.05
        teacher_stop_abs_diff: 0.5

The defaults are silent on a clean run: equal weights give |Δ log p| = 0.0 on the CPU in float32
(measured on the tiny smoke models), a bf16 vLLM engine against a learner ~1e-3–1e-2 (reported by
verl/OpenRLHF users, not measured here), a sampler one update behind (async mode, tiny smoke
recipe at lr 1e-3) 0.008–0.012. Noisy sampler weights (std 0.05) gave 0.25 (tests/unit/test_drift_gate.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, model_validator

from k3post.config.base import Strict


class DriftSpec(Strict):
    warn_abs_diff: PositiveFloat = Field(0.1, description=(
        "mean |log π − log μ| (train/logprob_abs_diff) above this prints one warning and sets drift/warned = 1"))
    stop_abs_diff: PositiveFloat | None = Field(1.0, description=(
        "above this the run stops, naming the step and the figure; null: never"))
    correction: Literal["none", "tis", "mis"] = Field("none", description=(
        "switched on from the step after warn_abs_diff is crossed, to the end: none; tis (truncated importance "
        "weights); mis (tokens with outlying ratios dropped)"))
    tis_cap: float = Field(2.0, gt=1.0, description="tis: each token's weight is min(π/μ, tis_cap)")
    mis_threshold: float = Field(2.0, gt=1.0, description=(
        "mis: tokens with π/μ outside [1/mis_threshold, mis_threshold] are dropped"))
    # HF teachers have nothing to compare: they are the HF computation. The recomputation costs an
    # HF forward of the teacher, hence off by default.
    teacher_check_every: int = Field(0, ge=0, description=(
        "every N steps, compare each vLLM teacher's scores with an HF recomputation of the same tokens; 0: never"))
    teacher_warn_abs_diff: PositiveFloat = Field(0.05, description=(
        "the teacher check: mean |Δ log p| above this prints a warning"))
    teacher_stop_abs_diff: PositiveFloat | None = Field(0.5, description=(
        "the teacher check: above this the run stops; null: never"))

    @model_validator(mode="after")
    def _stop_above_warn(self) -> "DriftSpec":
        for warn, stop in (("warn_abs_diff", "stop_abs_diff"), ("teacher_warn_abs_diff", "teacher_stop_abs_diff")):
            if getattr(self, stop) is not None and getattr(self, stop) <= getattr(self, warn):
                raise ValueError(f"{stop} ({getattr(self, stop)}) must be above {warn} ({getattr(self, warn)}): the "
                                 f"run would stop before it warned")
        return self

    @property
    def correction_args(self) -> tuple[str, float] | None:
        """(kind, cap) as the learner applies it (algo/drift.py: is_correction_factor); None for none."""
        if self.correction == "none":
            return None
        return self.correction, self.tis_cap if self.correction == "tis" else self.mis_threshold
