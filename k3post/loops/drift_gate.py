"""The drift gate: acts on the sampler-vs-learner figures every step, and on a teacher spot check
every `teacher_check_every` steps (recipe `train.drift`, config/drift_schema.py; the maths in
algo/drift.py).

The learner measures (train/logprob_abs_diff, train/sampler_kl, train/ratio_max, from the
sampler's log μ and its own log π); the loop can act, so the gate runs in the loop, one call per
step after the learner's step:

    ok       nothing (drift/warned = 0)
    warn     one line when the figure crosses `warn_abs_diff` (again only after a clean step), and
             drift/warned = 1 at every step above it
    correct  as warn, and from the next step to the end of the run every batch carries the
             recipe's IS correction (TIS or MIS, algo/drift.py); drift/correction = 1 from then on
    stop     `DriftStopped`: one line naming the step and the figure; no checkpoint of that step.
             The error carries the step's metrics (with drift/stopped = 1): the loop logs the
             step like any other before the run ends (loops/common.py: train_loop)

With `sampling.on_policy: bitwise` (`exact`) the sampler's and the learner's log-probabilities are
equal by construction (model/batch_invariant.py), so the gate first reads the step's largest gap,
train/logprob_abs_diff_max, and stops on anything but exactly 0 (algo/drift.py: exact_verdict).

A resumed run starts with the correction off; it switches on again at the first step above the
threshold.
"""

from __future__ import annotations

from typing import Callable, Mapping

from k3post.algo.drift import Verdict, drift_verdict, exact_verdict
from k3post.config.drift_schema import DriftSpec
from k3post.config.errors import StepStopped
from k3post.loops.protocols import TeacherGroup
from k3post.loops.routing import rows_by_teacher
from k3post.types import Rollouts

SAMPLER_FIGURE = "train/logprob_abs_diff"
EXACT_FIGURE = "train/logprob_abs_diff_max"


class DriftStopped(StepStopped):
    """The sampler and the learner (or a teacher engine and its HF recomputation) disagree past the
    recipe's stop threshold: the CLI prints the message as one line, exit 1; `metrics` are the
    step's (the loop logs them first)."""


class DriftGate:
    def __init__(self, spec: DriftSpec, say: Callable[[str], None] = print, exact: bool = False):
        """`exact`: sampling.on_policy is bitwise, and any gap at all stops the run."""
        self.spec, self.say, self.exact = spec, say, exact
        self.correction: tuple[str, float] | None = None  # what the batches carry once switched on
        self.above: set[str] = set()  # figures above their warn threshold at the last check

    def check(self, step: int, metrics: Mapping[str, float], rollouts: Rollouts | None = None,
              teachers: Mapping[str, TeacherGroup] | None = None) -> dict[str, float]:
        """Act on this step's figures; returns the drift/* metrics. Raises DriftStopped carrying
        `metrics`, the drift/* figures found so far and drift/stopped = 1."""
        out: dict[str, float] = {}
        try:
            self._check(step, metrics, out, rollouts, teachers)
        except DriftStopped as stop:
            stop.metrics = {**metrics, **out, "drift/stopped": 1.0}
            raise
        return out

    def _check(self, step: int, metrics: Mapping[str, float], out: dict[str, float], rollouts: Rollouts | None,
               teachers: Mapping[str, TeacherGroup] | None) -> None:
        if self.exact and EXACT_FIGURE in metrics:
            self._stop_unless_exact(step, metrics)
        if SAMPLER_FIGURE in metrics:
            spec = self.spec
            verdict = drift_verdict(metrics[SAMPLER_FIGURE], spec.warn_abs_diff, spec.stop_abs_diff, spec.correction,
                                    SAMPLER_FIGURE)
            out["drift/warned"] = self._act(step, verdict, "the sampler's log μ and the learner's log π",
                                            _sampler_detail(metrics))
            out["drift/correction"] = float(self.correction is not None)
        every = self.spec.teacher_check_every
        if teachers and rollouts is not None and every and step % every == 0:
            self.check_teachers(step, rollouts, teachers, out)

    def _stop_unless_exact(self, step: int, metrics: Mapping[str, float]) -> None:
        verdict = exact_verdict(metrics[EXACT_FIGURE], EXACT_FIGURE)
        if verdict.action == "stop":
            raise DriftStopped(
                f"stopped at step {step}: sampling.on_policy is bitwise, yet the learner's log π and the sampler's "
                f"log μ differ by up to {verdict.value:.3g} nats ({EXACT_FIGURE}; mean "
                f"{metrics.get(SAMPLER_FIGURE, float('nan')):.3g}). A broken invariant is a bug, not noise: a kernel "
                f"the batch-invariant mode does not cover, or weights that differ between the two (docs/on-policy.md). "
                f"No checkpoint of step {step} was written")

    def check_teachers(self, step: int, rollouts: Rollouts, teachers: Mapping[str, TeacherGroup],
                       out: dict[str, float]) -> None:
        """Each teacher's engine scores against an HF recomputation, on the rows routed to it (an
        HF teacher answers None: nothing to compare); the figures go into `out` as they come."""
        pending = {name: teachers[name].check_scores(rollouts.select(rows))
                   for name, rows in rows_by_teacher(rollouts.prompts).items()}
        for name, answer in pending.items():
            found = answer.result()
            if found is None:
                continue
            figure = f"drift/teacher_abs_diff/{name}"
            out[figure] = found["mean_abs_diff"]
            out[f"drift/teacher_max_abs_diff/{name}"] = found["max_abs_diff"]
            verdict = drift_verdict(found["mean_abs_diff"], self.spec.teacher_warn_abs_diff,
                                    self.spec.teacher_stop_abs_diff, "none", figure)
            out[f"drift/teacher_warned/{name}"] = self._act(
                step, verdict, f"teacher '{name}''s engine scores and their HF recomputation",
                f"max |Δ| {found['max_abs_diff']:.4g}")

    def _act(self, step: int, verdict: Verdict, what: str, detail: str) -> float:
        """Carry out a verdict; the value of its warned metric."""
        if verdict.action == "stop":
            raise DriftStopped(f"stopped at step {step}: {what} disagree: {verdict.describe()} (train.drift stop "
                               f"threshold; {detail}). No checkpoint of step {step} was written. Check the engines' "
                               f"dtype, temperature and weight sync (docs/learner.md, 'Drift'), or raise the threshold")
        if verdict.action == "ok":
            self.above.discard(verdict.figure)
            return 0.0
        switch = verdict.action == "correct" and self.correction is None
        if switch:
            self.correction = self.spec.correction_args
        if switch or verdict.figure not in self.above:
            then = (f"; {self.spec.correction.upper()} importance-sampling correction on from step {step + 1}"
                    if switch else "")
            self.say(f"warning: step {step}: {what} drift apart: {verdict.describe()} ({detail}){then}")
        self.above.add(verdict.figure)
        return 1.0


def _sampler_detail(metrics: Mapping[str, float]) -> str:
    return (f"KL(μ‖π) ≈ {metrics.get('train/sampler_kl', float('nan')):.4g}, "
            f"max ratio {metrics.get('train/ratio_max', float('nan')):.4g}")
