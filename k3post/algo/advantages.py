"""Advantages from outcome rewards: group-relative baselines, and from rewards to the tokens of a
training batch. Pure tensor functions with scalar arguments (docs/architecture.md).

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


def zero_variance_share(rewards_PG: torch.Tensor) -> float:
    """Share of groups (rows of [P, G]) whose rewards are all equal; 0.0 for no groups.

    Such a group has zero advantage under every estimator here, so it gives no learning signal.
    """
    if rewards_PG.dim() != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards_PG.shape)}")
    if rewards_PG.shape[0] == 0:
        return 0.0
    constant_P = rewards_PG.max(dim=1).values == rewards_PG.min(dim=1).values
    return float(constant_P.float().mean())


def sequence_to_token(advantages_B: torch.Tensor, loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """A_bt = A_b · m_bt: an outcome advantage credited to every completion token of row b."""
    return advantages_B.unsqueeze(-1).to(loss_mask_BT.dtype) * loss_mask_BT


# ---------------------------------------------------------------- from rewards to a training batch
#
# The loops sample a *flat* batch: the G completions of each prompt sit in consecutive rows
# (prompt p owns rows p·G … p·G+G−1). These functions take that layout and scalar options, and
# are all the maths an RL step (and an OPD step mixed with rewards) needs between the reward
# scores and the learner (whose policy losses are in policy_loss.py).

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
