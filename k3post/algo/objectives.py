"""What the learner minimises: one small object per objective, each saying what it needs.

The learner runs the same step for every algorithm: the student's logprobs of the batch's
completion tokens (and, if the objective asks, its full next-token distributions), then
`objective.loss(...)` per micro-batch, normalised by the step's *global* token count N so that
accumulated micro-batch gradients equal the full-batch gradient (aggregate.py). What differs is
only the loss, and what the loss needs:

    objective            per-token loss ℓ_t (summed with the mask, divided by N)     needs
    SampledTokenPG       −ρ_t A_t,  ρ_t = π_θ(y_t)/μ(y_t)   (opd.py, policy_loss.py)  the batch's A_t
    FullVocabReverseKL   Σ_v π_θ(v) (log π_θ(v) − log π_T(v))   (opd.py)               both distributions
    SftNll               −log π_θ(y_t)                                                 the targets only
    RlPolicyLoss         PPO-clip or IS surrogate (policy_loss.py)                     the batch's A_t

`compares_with_sampler` says whether the tokens were drawn by the sampler, so that the
sampler-vs-learner ratio diagnostics mean something (SFT targets were not sampled: no).
A KL-to-reference term is not an objective of its own but an addition to any of them
(`ReferenceKL`), computed from reference logprobs the learner obtains before the step's first
backward (engine/reference.py).

Objects, not a mode string: the launch layer picks one from the recipe (a table lookup), the
learner never branches on the algorithm, and a new loss is a new class here with its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from k3post.algo.aggregate import token_sum_normalized
from k3post.algo.kl import kl_estimate
from k3post.algo.opd import full_vocab_reverse_kl_loss
from k3post.algo.policy_loss import importance_sampled_pg_loss, policy_loss
from k3post.types import TrainBatch


class Objective(Protocol):
    needs_teacher_distributions: ClassVar[bool]  # the batch must carry teacher_full_logprobs_BTV
    needs_student_distributions: ClassVar[bool]  # the learner must compute the student's [B,T,V]
    compares_with_sampler: ClassVar[bool]  # tokens were sampled: ratio diagnostics apply

    def loss(self, mb: TrainBatch, student_logprobs_BT: torch.Tensor, student_full_logprobs_BTV: torch.Tensor | None,
             num_tokens: float) -> torch.Tensor: ...


@dataclass(frozen=True)
class SampledTokenPG:
    """Sampled-token OPD: the importance-sampled policy gradient on the advantages the loop
    computed from the teachers' logprobs of the sampled tokens (A_t = −c·(log μ − log π_T))."""

    needs_teacher_distributions: ClassVar[bool] = False
    needs_student_distributions: ClassVar[bool] = False
    compares_with_sampler: ClassVar[bool] = True

    def loss(self, mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens):
        loss_BT = importance_sampled_pg_loss(student_logprobs_BT, mb.sampler_logprobs_BT, mb.advantages_BT)
        return token_sum_normalized(loss_BT, mb.loss_mask_BT, num_tokens)


@dataclass(frozen=True)
class FullVocabReverseKL:
    """The exact reverse KL over the whole vocabulary at every completion position,
    differentiated directly (no sampling variance); needs the teachers' full distributions."""

    needs_teacher_distributions: ClassVar[bool] = True
    needs_student_distributions: ClassVar[bool] = True
    compares_with_sampler: ClassVar[bool] = True

    def loss(self, mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens):
        if mb.teacher_full_logprobs_BTV is None or student_full_logprobs_BTV is None:
            raise ValueError("the full-vocabulary KL needs the teacher's and the student's full distributions")
        return full_vocab_reverse_kl_loss(student_full_logprobs_BTV, mb.teacher_full_logprobs_BTV, mb.loss_mask_BT,
                                          num_tokens)


@dataclass(frozen=True)
class SftNll:
    """Negative log-likelihood of the completion (reply) tokens; the prompt is context, not target."""

    needs_teacher_distributions: ClassVar[bool] = False
    needs_student_distributions: ClassVar[bool] = False
    compares_with_sampler: ClassVar[bool] = False

    def loss(self, mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens):
        return token_sum_normalized(-student_logprobs_BT, mb.loss_mask_BT, num_tokens)


@dataclass(frozen=True)
class RlPolicyLoss:
    """RL from rewards: the `kind` policy loss (ppo_clip | is) against the sampler's recorded
    logprobs (the behaviour policy), token-mean over the step. The batch's advantages already
    carry the sequence-aggregation weights if the recipe asked for them
    (advantages.sequence_mean_weights)."""

    kind: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    needs_teacher_distributions: ClassVar[bool] = False
    needs_student_distributions: ClassVar[bool] = False
    compares_with_sampler: ClassVar[bool] = True

    def loss(self, mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens):
        loss_BT = policy_loss(self.kind, student_logprobs_BT, mb.sampler_logprobs_BT, mb.advantages_BT,
                              self.clip_low, self.clip_high, self.dual_clip)
        return token_sum_normalized(loss_BT, mb.loss_mask_BT, num_tokens)


# The OPD objectives a recipe's `loss.kind` names.
OPD_OBJECTIVES: dict[str, type] = {"sampled_token": SampledTokenPG, "full_vocab": FullVocabReverseKL}


@dataclass(frozen=True)
class ReferenceKL:
    """A KL-to-reference term added to any objective: coef · token-mean of the `estimator`
    (k1 | k2 | k3, kl.py) of KL(π_θ‖π_ref) on the completion tokens. coef 0 adds nothing to the
    loss but the term is still measured (`logged`)."""

    coef: float = 0.0
    estimator: str = "k3"

    def loss(self, student_logprobs_BT, ref_logprobs_BT, loss_mask_BT, num_tokens: float) -> torch.Tensor:
        kl_BT = kl_estimate(student_logprobs_BT, ref_logprobs_BT, self.estimator)
        return self.coef * token_sum_normalized(kl_BT, loss_mask_BT, num_tokens)

    @staticmethod
    def logged(student_logprobs_BT, ref_logprobs_BT, loss_mask_BT, num_tokens: float) -> float:
        """The unbiased k1 mean, whatever estimator the loss uses (its share of the step)."""
        return float(token_sum_normalized((student_logprobs_BT - ref_logprobs_BT).detach(), loss_mask_BT, num_tokens))
