"""Pure maths of the pipeline: losses, estimators, reductions and schedules.

Imports torch and the standard library only; functions take tensors and scalars, never config
objects, so each formula can be tested against its closed form in isolation.

- opd: the teacher KL estimator, sampled-token advantages, exact full-vocabulary KL.
- policy_loss: the importance-sampled policy-gradient loss and ratio diagnostics.
- aggregate: masked reductions and global-token normalisation across micro-batches.
- schedule: the learning-rate multiplier.
"""
