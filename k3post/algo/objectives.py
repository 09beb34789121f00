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
    PerTeacherOPD        Σ_teachers coef_i · (the teacher's own term on its rows)      per teacher: A_t,
                         (sampled-token, full-vocab, top-k forward/reverse/JSD)          top-k or full
                                                                                          distributions

`compares_with_sampler` says whether the tokens were drawn by the sampler, so that the
sampler-vs-learner ratio diagnostics mean something (SFT targets were not sampled: no).
A KL-to-reference term is not an objective of its own but an addition to any of them
(`ReferenceKL`), computed from reference logprobs the learner obtains before the step's first
backward (engine/learner/reference.py).

Objects, not a mode string: the launch layer picks one from the recipe (a table lookup), the
learner never branches on the algorithm, and a new loss is a new class here with its tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import torch

from k3post.algo.aggregate import token_sum_normalized
from k3post.algo.chunked_kl import chunked_reverse_kl
from k3post.algo.kl import kl_estimate
from k3post.algo.opd import full_vocab_reverse_kl_loss, kl_divergence
from k3post.algo.policy_loss import importance_sampled_pg_loss, policy_loss
from k3post.algo.topk import topk_bins, bin_divergence, topk_mass
from k3post.types import TeacherPart, TrainBatch


class Objective(Protocol):
    needs_teacher_distributions: ClassVar[bool]  # the batch must carry teacher_full_logprobs_BTV
    needs_student_distributions: ClassVar[bool]  # the learner must compute the student's [B,T,V]
    compares_with_sampler: ClassVar[bool]  # tokens were sampled: ratio diagnostics apply

    def loss(self, mb: TrainBatch, student_logprobs_BT: torch.Tensor, student_full_logprobs_BTV: torch.Tensor | None,
             num_tokens: float) -> torch.Tensor: ...

    def loss_and_sums(self, mb: TrainBatch, student_logprobs_BT: torch.Tensor,
                      student_full_logprobs_BTV: torch.Tensor | None, num_tokens: float
                      ) -> tuple[torch.Tensor, dict[str, float]]: ...

    def sum_names(self) -> tuple[str, ...]: ...

    def finish_sums(self, totals: dict[str, float]) -> dict[str, float]: ...


class PlainLoss:
    """An objective with no figures of its own besides the loss (the learner's step metrics)."""

    def loss_and_sums(self, mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens):
        return self.loss(mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens), {}

    def sum_names(self) -> tuple[str, ...]:
        return ()

    def finish_sums(self, totals: dict[str, float]) -> dict[str, float]:
        return {}


@dataclass(frozen=True)
class SampledTokenPG(PlainLoss):
    """Sampled-token OPD: the importance-sampled policy gradient on the advantages the loop
    computed from the teachers' logprobs of the sampled tokens (A_t = −c·(log μ − log π_T))."""

    needs_teacher_distributions: ClassVar[bool] = False
    needs_student_distributions: ClassVar[bool] = False
    compares_with_sampler: ClassVar[bool] = True

    def loss(self, mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens):
        loss_BT = importance_sampled_pg_loss(student_logprobs_BT, mb.sampler_logprobs_BT, mb.advantages_BT)
        return token_sum_normalized(loss_BT, mb.loss_mask_BT, num_tokens)


@dataclass(frozen=True)
class FullVocabReverseKL(PlainLoss):
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
class SftNll(PlainLoss):
    """Negative log-likelihood of the completion (reply) tokens; the prompt is context, not target."""

    needs_teacher_distributions: ClassVar[bool] = False
    needs_student_distributions: ClassVar[bool] = False
    compares_with_sampler: ClassVar[bool] = False

    def loss(self, mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens):
        return token_sum_normalized(-student_logprobs_BT, mb.loss_mask_BT, num_tokens)


@dataclass(frozen=True)
class RlPolicyLoss(PlainLoss):
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


# -- Per-teacher OPD: every teacher its own loss, in one objective --

@dataclass(frozen=True)
class TeacherTerm:
    """One teacher's share of the loss (config/loss_schema.py: TeacherLossSpec, resolved).

    kind: sampled_token | full_vocab | topk_forward | topk_reverse | topk_jsd; coef multiplies the
    term (for sampled_token the driver has put it into the advantages already, A_t = −coef·k_t);
    k and beta: the top-k terms'; send: how a full_vocab teacher ships its distribution."""

    kind: str = "sampled_token"
    coef: float = 1.0
    k: int = 64
    beta: float = 0.5
    send: str = "logprobs"

    @property
    def scoring(self) -> tuple[str, tuple]:
        """The teacher engine's method (and its extra arguments) that returns ([B, T], payload)."""
        if self.kind.startswith("topk_"):
            return "score_topk", (self.k,)
        if self.kind == "full_vocab":
            return ("score_with_hidden", ()) if self.send == "hidden_states" else ("score_with_full", ())
        return "score", ()


def _sampled_token_term(term, mb, part, s_BT, s_BTV, num_tokens):
    """The importance-sampled PG on the driver's advantages, over this teacher's rows only (a row
    mask on the whole micro-batch: with one teacher the same operations as SampledTokenPG)."""
    rows_B = torch.zeros(len(mb), dtype=mb.loss_mask_BT.dtype, device=mb.loss_mask_BT.device)
    rows_B[list(part.rows)] = 1.0
    loss_BT = importance_sampled_pg_loss(s_BT, mb.sampler_logprobs_BT, mb.advantages_BT)
    return token_sum_normalized(loss_BT, mb.loss_mask_BT * rows_B[:, None], num_tokens), None, None


def _teacher_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`t[rows]`, or `t` itself when the rows are the whole batch in order (one teacher): indexing
    would copy a [B, T, V] tensor, and its backward scatter it back, for the same values."""
    return t if rows == list(range(t.shape[0])) else t[rows]


def _full_vocab_term(term, mb, part, s_BT, s_BTV, num_tokens):
    """The exact reverse KL over the vocabulary: from the teacher's [B, T, V] logprobs, or from its
    hidden states and output head, chunk by chunk (chunked_kl.py)."""
    rows, payload = list(part.rows), part.payload
    mask_BT = mb.loss_mask_BT[rows]
    if hasattr(payload, "hidden_BTH"):
        kl_BT = chunked_reverse_kl(_teacher_rows(s_BTV, rows), payload.hidden_BTH, payload.head_VH,
                                   payload.temperature)
    else:
        kl_BT = kl_divergence(_teacher_rows(s_BTV, rows), payload.logprobs_BTV.detach())
    return term.coef * token_sum_normalized(kl_BT, mask_BT, num_tokens), kl_BT.detach(), None


def _topk_term(term, mb, part, s_BT, s_BTV, num_tokens):
    """forward / reverse / JSD(β) on the teacher's top-k plus the tail bucket (topk.py), a loss on the
    student's distribution (never an advantage); its logged KL is the reverse KL on the same bins.

    A teacher of another tokenizer sends the top-k only where a chunk is one token on each side
    (`signal_BT`, algo/cross_tokenizer.py); every other token of its rows takes the sampled-token
    term on the driver's advantages (its chunk's share of L_S − L_T), so no token is left out."""
    rows, topk = list(part.rows), part.payload
    mask_BT = mb.loss_mask_BT[rows]
    fallback = 0.0
    if topk.signal_BT is not None:
        signal_BT = topk.signal_BT.to(mask_BT.dtype)
        rest = TeacherPart(part.teacher, part.rows)
        rest_mb = replace(mb, loss_mask_BT=_scatter_rows(mb.loss_mask_BT, rows, mask_BT * (1 - signal_BT)))
        fallback = _sampled_token_term(term, rest_mb, rest, s_BT, s_BTV, num_tokens)[0]
        mask_BT = mask_BT * signal_BT
    student_bins, teacher_bins = topk_bins(_teacher_rows(s_BTV, rows), topk.ids_BTK.long(), topk.logprobs_BTK,
                                           topk.tail_logprobs_BT)
    teacher_bins = torch.where((mask_BT != 0)[..., None], teacher_bins, student_bins.detach())  # pads: 0, finite
    div_BT = bin_divergence(student_bins, teacher_bins, term.kind.removeprefix("topk_"), term.beta)
    kl_BT = bin_divergence(student_bins.detach(), teacher_bins, "reverse")
    loss = term.coef * token_sum_normalized(div_BT, mask_BT, num_tokens) + fallback
    return loss, kl_BT, topk_mass(topk.logprobs_BTK)


def _scatter_rows(mask_BT: torch.Tensor, rows: list[int], values_RT: torch.Tensor) -> torch.Tensor:
    """`mask_BT` with its `rows` replaced by `values_RT` (the other rows zero)."""
    out = torch.zeros_like(mask_BT)
    out[rows] = values_RT
    return out


TERM_LOSSES = {"sampled_token": _sampled_token_term, "full_vocab": _full_vocab_term, "topk_forward": _topk_term,
               "topk_reverse": _topk_term, "topk_jsd": _topk_term}


@dataclass(frozen=True)
class PerTeacherOPD:
    """Every teacher its own loss term on the rows routed to it, summed: L = Σ_i L_i, each L_i a
    masked sum over teacher i's tokens divided by the step's global token count (so the terms add
    up to a token mean over the step, and micro-batches to the whole batch).

    Sampled-token rows use the advantages the driver computed; top-k and full-vocab rows the
    teacher's payload in the batch's `teacher_parts` (sent actor → learner by reference). Figures
    per teacher (`finish_sums`): train/loss/<t> (its loss per token of its own), train/kl/<t> (the
    exact reverse KL for full_vocab, the reverse KL on the k + 1 bins for top-k) and
    train/topk_mass/<t> (how much of the teacher's distribution its top-k held)."""

    terms: tuple[tuple[str, TeacherTerm], ...]
    needs_teacher_distributions: ClassVar[bool] = False  # the payloads come per teacher instead
    compares_with_sampler: ClassVar[bool] = True

    @property
    def needs_student_distributions(self) -> bool:
        return any(term.kind != "sampled_token" for _, term in self.terms)

    def term(self, teacher: str) -> TeacherTerm:
        return dict(self.terms)[teacher]

    def sum_names(self) -> tuple[str, ...]:
        return tuple(f"{what}/{name}" for name, _ in self.terms for what in ("tokens", "loss", "kl", "topk_mass"))

    def loss(self, mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens):
        return self.loss_and_sums(mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens)[0]

    def loss_and_sums(self, mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens):
        total, sums = 0.0, {}
        for part in mb.teacher_parts:
            if not part.rows:
                continue
            term = self.term(part.teacher)
            loss, kl_BT, mass_BT = TERM_LOSSES[term.kind](term, mb, part, student_logprobs_BT,
                                                          student_full_logprobs_BTV, num_tokens)
            total = total + loss
            sums.update(_part_sums(part, mb, float(loss.detach()), kl_BT, mass_BT, num_tokens))
        if not torch.is_tensor(total):  # no rows at all (a weight-0 padding micro-batch): a zero with a graph
            total = 0.0 * student_logprobs_BT.sum()
        return total, sums

    def finish_sums(self, totals: dict[str, float]) -> dict[str, float]:
        """Per-teacher means over the teacher's own tokens, from the step's token-share sums."""
        out = {}
        for name, term in self.terms:
            share = totals.get(f"tokens/{name}", 0.0)
            if share <= 0:
                continue
            out[f"train/loss/{name}"] = totals[f"loss/{name}"] / share
            if term.kind != "sampled_token":
                out[f"train/kl/{name}"] = totals[f"kl/{name}"] / share
            if term.kind.startswith("topk_"):
                out[f"train/topk_mass/{name}"] = totals[f"topk_mass/{name}"] / share
        return out


def _part_sums(part: TeacherPart, mb: TrainBatch, loss: float, kl_BT, mass_BT, num_tokens: float) -> dict[str, float]:
    """One teacher's figures in one micro-batch, each a masked sum over its tokens / the step's count."""
    mask_BT = mb.loss_mask_BT[list(part.rows)]
    sums = {f"tokens/{part.teacher}": float(mask_BT.sum()) / num_tokens, f"loss/{part.teacher}": loss}
    if kl_BT is not None:
        sums[f"kl/{part.teacher}"] = float(token_sum_normalized(kl_BT, mask_BT, num_tokens))
    if mass_BT is not None:
        sums[f"topk_mass/{part.teacher}"] = float(token_sum_normalized(mass_BT, mask_BT, num_tokens))
    return sums


def per_teacher_objective(losses: dict[str, "object"]) -> PerTeacherOPD:
    """The objective of a run from each teacher's resolved TeacherLossSpec (launch/distill.py)."""
    return PerTeacherOPD(tuple((name, TeacherTerm(spec.kind, spec.coef, spec.k, spec.beta, spec.send))
                               for name, spec in losses.items()))
