"""RL from rewards: group-relative advantages, the clipped PPO loss, KL-to-reference estimators and
loss aggregation modes. Pure tensor functions with scalar arguments (docs/architecture.md).

Shapes: `_PG` is [num_prompts, G], the G completions sampled for each prompt (a *group*);
`_BT` is [batch, completion position], aligned with `completion_ids_BT` (k3post/types.py).

Advantages from outcome rewards. Every completion i of a group gets one scalar reward R_i; the
policy gradient E[A ∇log π(y)] is unchanged by subtracting any baseline b that does not depend on
y_i itself, and a good baseline (≈ the expected reward of the prompt) removes most variance:

- GRPO:  A_i = (R_i − mean_g R) / (std_g R + ε), std with Bessel's correction (torch's default).
  The group mean uses R_i too, so it is slightly biased (by a factor (G−1)/G, plus the std
  division); Dr.GRPO drops the std division (`normalize_std=False`), which otherwise up-weights
  prompts whose rewards barely differ (too easy or too hard).
- RLOO:  A_i = R_i − mean_{j≠i} R_j = G/(G−1) · (R_i − mean_g R), an unbiased baseline because
  it excludes R_i itself.

A group of one has no baseline to compare against; both give it advantage 0 (verl uses mean 0,
std 1 for GRPO, i.e. A = R; we prefer 0: a lone sample says nothing about *relative* quality).

The sequence advantage is broadcast to every completion token (`sequence_to_token`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3post.algo.aggregate import masked_sum, token_sum_normalized
from k3post.algo.policy_loss import importance_sampled_pg_loss


def grpo_advantages(rewards_PG: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A_pi = (R_pi − mean_i R_p·) / (std_i R_p· + eps) per group p; [P, G] → [P, G].

    `normalize_std=False` is Dr.GRPO: A = R − mean. G = 1 ⇒ A = 0 (module docstring).
    A group whose rewards are all equal gets A = 0 exactly: nothing to prefer within it.
    """
    if rewards_PG.dim() != 2:
        raise ValueError(f"rewards must be shaped [num_prompts, G], got {tuple(rewards_PG.shape)}")
    centred_PG = rewards_PG - rewards_PG.mean(dim=-1, keepdim=True)
    if rewards_PG.shape[-1] == 1 or not normalize_std:
        return centred_PG  # G = 1: R − mean(R) = 0 already; std of one sample is undefined
    std_P1 = rewards_PG.std(dim=-1, keepdim=True)  # unbiased (Bessel), as verl
    return centred_PG / (std_P1 + eps)


def rloo_advantages(rewards_PG: torch.Tensor) -> torch.Tensor:
    """A_pi = R_pi − (1/(G−1)) Σ_{j≠i} R_pj = G/(G−1) · (R_pi − mean_j R_pj); [P, G] → [P, G].

    Derivation: Σ_{j≠i} R_j = G·mean − R_i, so R_i − (G·mean − R_i)/(G−1) = G(R_i − mean)/(G−1).
    G = 1 ⇒ A = 0 (no other sample to form a baseline).
    """
    if rewards_PG.dim() != 2:
        raise ValueError(f"rewards must be shaped [num_prompts, G], got {tuple(rewards_PG.shape)}")
    group_size = rewards_PG.shape[-1]
    if group_size == 1:
        return torch.zeros_like(rewards_PG)
    centred_PG = rewards_PG - rewards_PG.mean(dim=-1, keepdim=True)
    return centred_PG * (group_size / (group_size - 1))


def sequence_to_token(advantages_B: torch.Tensor, loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """A_bt = A_b · m_bt: an outcome advantage credited to every completion token of row b."""
    return advantages_B.unsqueeze(-1).to(loss_mask_BT.dtype) * loss_mask_BT


def ppo_clip_loss(
    student_logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """Per-token clipped surrogate  ℓ_t = max(−ρ_t A_t, −clip(ρ_t, 1−ε_low, 1+ε_high) A_t).

    ρ_t = exp(log π_θ(y_t) − log π_old(y_t)). The max of the two *losses* (= min of the two
    objectives) is pessimistic: once a step has moved ρ past the trust region in the direction
    the advantage favours (ρ > 1+ε_high with A > 0, or ρ < 1−ε_low with A < 0), the clipped
    branch is constant and the token stops pulling. In the other direction the unclipped branch
    wins, so a step that made a good token less likely (A > 0, ρ < 1−ε) still gets corrected.

    Dual clip (Ye et al. 2020, verl `clip_ratio_c`, typically 3): for A < 0 the loss −ρA grows
    without bound in ρ; it is capped at −c·A, i.e. ℓ = min(ℓ, −c·A) where A < 0, c > 1.

    The log-ratio is clamped to [−20, 20] before exp (as verl) so that stale or padded tokens
    cannot overflow; old logprobs and advantages are constants (detached). Not reduced: use
    `aggregate`.
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (a cap on the ratio for negative advantages), got {dual_clip}")
    advantages_BT = advantages_BT.detach()
    log_ratio_BT = (student_logprobs_BT - old_logprobs_BT.detach()).clamp(-20.0, 20.0)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -ratio_BT * advantages_BT
    clipped_BT = -ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages_BT
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    if dual_clip is not None:
        capped_BT = torch.minimum(loss_BT, -dual_clip * advantages_BT)
        loss_BT = torch.where(advantages_BT < 0, capped_BT, loss_BT)
    return loss_BT


def _k1(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    return log_ratio_BT


def _k2(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio_BT.square()


def _k3(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    # verl's low_var_kl: clamp the exponent so exp cannot overflow, then the value itself.
    neg_d_BT = (-log_ratio_BT).clamp(-20.0, 20.0)
    return (torch.exp(neg_d_BT) - neg_d_BT - 1.0).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) from the sampled token, d = log π_θ(y) − log π_ref(y).

    Schulman's estimators (http://joschu.net/blog/kl-approx.html), for y ~ π_θ:
      k1 = d                 unbiased: E[d] = KL; can be negative per sample; high variance.
      k2 = ½ d²              biased (E[k2] ≠ KL in general), ≥ 0, low variance.
      k3 = e^{−d} − 1 + d    unbiased (E[e^{−d}] = Σ_y π_ref(y) = 1), ≥ 0, low variance.
    k3 clamps −d to [−20, 20] and the value to [−10, 10] (verl `low_var_kl`), trading exactness
    on extreme tokens for finite values.

    Gradients (REFERENCE §2.2) when the estimate is *backpropagated* as a loss: E[∇k1] = 0 (use
    k1 only as a reward / advantage term); E[∇k2] = ∇KL(π_θ‖π_ref) (reverse KL);
    E[∇k3] = ∇KL(π_ref‖π_θ) (forward KL) — the GRPO-style `β·k3` loss term pulls towards the
    reference in the forward-KL sense. The reference is detached.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logprobs_BT - ref_logprobs_BT.detach())



# Each mode: (loss_BT, mask_BT, tokens_B, num_tokens, num_seqs, max_len) -> scalar; see `aggregate`.
def _token_mean(loss_BT, mask_BT, tokens_B, num_tokens, num_seqs, max_len):
    return token_sum_normalized(loss_BT, mask_BT, num_tokens)


def _seq_mean_token_sum(loss_BT, mask_BT, tokens_B, num_tokens, num_seqs, max_len):
    return masked_sum(loss_BT, mask_BT) / num_seqs


def _seq_mean_token_mean(loss_BT, mask_BT, tokens_B, num_tokens, num_seqs, max_len):
    # Per-row token mean, then the rows summed; a safe denominator keeps empty rows at 0.
    selected_BT = torch.where(mask_BT != 0, loss_BT, torch.zeros_like(loss_BT)) * mask_BT
    safe_tokens_B = torch.where(tokens_B > 0, tokens_B, torch.ones_like(tokens_B))
    return (selected_BT.sum(dim=-1) / safe_tokens_B).sum() / num_seqs


def _seq_mean_token_sum_norm(loss_BT, mask_BT, tokens_B, num_tokens, num_seqs, max_len):
    return masked_sum(loss_BT, mask_BT) / (num_seqs * max_len)


AGGREGATIONS = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to the scalar of one micro-batch (verl `loss_agg_mode` names).

    With m the mask, n_b = Σ_t m_bt the tokens of row b, N the step's tokens and S its sequences:

      token-mean               Σ_{b,t} m ℓ / N                 every token weighs the same (DAPO)
      seq-mean-token-sum       Σ_b (Σ_t m ℓ)_b / S             long answers weigh more
      seq-mean-token-mean      Σ_b (Σ_t m ℓ / n_b) / S         every sequence weighs the same (GRPO)
      seq-mean-token-sum-norm  Σ_{b,t} m ℓ / (S · max_len)     Dr.GRPO: a constant per-token weight

    Global counts: pass N (`num_tokens`) and S (`num_seqs`) of the whole optimizer step — all
    micro-batches, all ranks — and the sum of the micro-batch results equals the full-batch value
    (aggregate.py explains the pitfall). None means "this call is the whole step": N = Σ m and
    S = rows with at least one token. `max_len` must be a constant of the run (max new tokens),
    never the padded width of a micro-batch, or micro-batches would be scaled differently.
    (verl's seq-mean-token-sum-norm divides by the constant only; we also average over
    sequences, as the Dr.GRPO paper writes it, so the scale does not grow with the batch.)
    A row with no tokens contributes 0 in every mode; an empty step gives an exact 0.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {list(AGGREGATIONS)}")
    tokens_B = mask_BT.sum(dim=-1)
    num_tokens = float(tokens_B.sum()) if num_tokens is None else num_tokens
    num_seqs = float((tokens_B > 0).sum()) if num_seqs is None else num_seqs
    if mode == "seq-mean-token-sum-norm" and not (max_len is not None and max_len > 0):
        raise ValueError("seq-mean-token-sum-norm needs max_len > 0, a constant of the run (max new tokens)")
    if not (num_tokens > 0 and num_seqs > 0):
        if bool((mask_BT != 0).any()):
            raise ValueError(f"num_tokens ({num_tokens}) and num_seqs ({num_seqs}) must be positive")
        return masked_sum(loss_BT, mask_BT)  # an empty step: 0, with a finite zero gradient
    return AGGREGATIONS[mode](loss_BT, mask_BT, tokens_B, num_tokens, num_seqs, max_len)


# ---------------------------------------------------------------- from rewards to a training batch
#
# The loops sample a *flat* batch: the G completions of each prompt sit in consecutive rows
# (prompt p owns rows p·G … p·G+G−1). These functions take that layout and scalar options, and
# are all the maths an RL step (and an OPD step mixed with rewards) needs between the reward
# scores and the learner.

ADVANTAGE_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": lambda rewards_PG: grpo_advantages(rewards_PG, normalize_std=False),
    "rloo": rloo_advantages,
}


def group_advantages(rewards_B: torch.Tensor, group_size: int, estimator: str) -> torch.Tensor:
    """Per-completion advantages of a flat batch of consecutive groups; [B] → [B].

    Reshapes to [B/G, G], applies `estimator` ∈ {grpo, dr_grpo, rloo} within each group (module
    docstring) and flattens back, so row i's advantage compares it only with its own siblings.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}")
    if group_size < 1 or rewards_B.dim() != 1 or rewards_B.shape[0] % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards_B.shape)} do not split into groups of {group_size}")
    return ADVANTAGE_ESTIMATORS[estimator](rewards_B.reshape(-1, group_size)).reshape(-1)


def sequence_mean_weights(loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """Row weights w_b = N / (S · n_b) that turn the token mean into the sequence mean.

    n_b = Σ_t m_bt (tokens of row b), N = Σ_b n_b, S = rows with n_b > 0; w_b = 0 for empty rows.
    For any per-token loss ℓ,

        Σ_{b,t} m (w_b ℓ) / N = Σ_b (Σ_t m ℓ / n_b) / S            (seq-mean-token-mean)

    i.e. "every sequence weighs the same" instead of "every token weighs the same". Both policy
    losses are positively homogeneous in the advantage — ℓ(c·A) = c·ℓ(A) for c ≥ 0, because
    ρA, clip(ρ)A and the dual-clip cap c_d·A all scale with A — so scaling each row's advantage
    by w_b moves the sequence aggregation into the batch: the learner keeps one token-mean loss
    with the step's global token count and stays exact under any micro-batch split. (The
    KL-to-reference term stays a token mean.)
    """
    tokens_B = loss_mask_BT.sum(dim=-1)
    total, rows = tokens_B.sum(), (tokens_B > 0).sum()
    if not bool(rows > 0):
        return torch.zeros_like(tokens_B)
    safe_B = torch.where(tokens_B > 0, tokens_B, torch.ones_like(tokens_B))
    return torch.where(tokens_B > 0, total / (rows * safe_B), torch.zeros_like(tokens_B))


def _importance_sampled(student_logprobs_BT, old_logprobs_BT, advantages_BT, eps_low, eps_high, dual_clip):
    return importance_sampled_pg_loss(student_logprobs_BT, old_logprobs_BT, advantages_BT)


POLICY_LOSSES: dict[str, Callable[..., torch.Tensor]] = {"ppo_clip": ppo_clip_loss, "is": _importance_sampled}


def policy_loss(
    kind: str,
    student_logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """The per-token policy loss `kind`, not reduced:

    ppo_clip  max(−ρA, −clip(ρ, 1−ε_low, 1+ε_high)·A) (+ dual clip), `ppo_clip_loss`;
    is        −ρA, plain importance sampling (policy_loss.py), the ε arguments unused.

    ρ = exp(log π_θ − log π_old) with π_old the *sampler's* recorded logprobs (the behaviour
    policy that drew the tokens). With one update per batch, ρ = 1 up to train/inference
    numerics and both give the on-policy gradient −A∇log π; they differ once the learner has
    moved away from the sampler (stale samples, several updates, a mismatched engine).
    """
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r}; choose one of {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[kind](student_logprobs_BT, old_logprobs_BT, advantages_BT, eps_low, eps_high, dual_clip)


def mix_reward_advantages(
    opd_advantages_BT: torch.Tensor, reward_advantages_B: torch.Tensor, loss_mask_BT: torch.Tensor, coef: float
) -> torch.Tensor:
    """OPD with task rewards:  A_bt = A^OPD_bt + coef · A^R_b · m_bt.

    A^OPD is the per-token distillation advantage (−c·(log μ − log π_T), opd.py); A^R_b the
    group-normalised reward advantage of completion b (`group_advantages`), credited to every
    token of it. The policy gradient is linear in A, so the update is the sum of the two
    gradients: descend the reverse KL to the teacher and climb the reward, `coef` trading them.
    """
    return opd_advantages_BT + coef * sequence_to_token(reward_advantages_B, loss_mask_BT)


def token_advantages(advantages_B: torch.Tensor, loss_mask_BT: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Outcome advantages on the tokens, for a learner that takes the step's token mean:

    token     A_bt = A_b · m_bt           every token weighs the same (DAPO, the default)
    sequence  A_bt = A_b · w_b · m_bt     every completion weighs the same (`sequence_mean_weights`)
    """
    if aggregation == "token":
        return sequence_to_token(advantages_B, loss_mask_BT)
    if aggregation == "sequence":
        return sequence_to_token(advantages_B * sequence_mean_weights(loss_mask_BT), loss_mask_BT)
    raise ValueError(f"unknown aggregation {aggregation!r}; choose 'token' or 'sequence'")
