"""Pure maths of the pipeline: losses, estimators, advantages, reductions and schedules.

Imports torch and the standard library only; functions take tensors and scalars, never config
objects, so each formula can be tested against its closed form in isolation.

- opd: the teacher KL estimator, sampled-token advantages, exact full-vocabulary KL.
- objectives: what the learner minimises, one object per objective (sampled-token policy
  gradient, full-vocabulary KL, SFT NLL, RL policy loss) and the KL-to-reference term.
- policy_loss: the importance-sampled and PPO-clip policy losses, ratio diagnostics.
- advantages: group-relative advantages from rewards (GRPO, Dr.GRPO, RLOO) onto the tokens.
- kl: the k1/k2/k3 estimators of KL(π_θ‖π_ref) from sampled tokens.
- aggregate: masked reductions and global-token normalisation across micro-batches.
- eval_metrics: pass@k, confidence intervals, sequence KL/NLL for the evaluation harness.
- moe: expert load and routing-bias updates for MoE students.
- schedule: the learning-rate multiplier.
- fp8: the FP8 QAT grid (torchao's per-row e4m3 rounding, bit for bit) and FP8 GEMMs on it.
"""
