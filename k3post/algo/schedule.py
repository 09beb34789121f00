"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

The function returns a multiplier of the base learning rate (what `LambdaLR` expects), so
`lr(step) = base_lr · warmup_cosine_factor(step, ...)`, with `step` the 0-based index of the
optimizer step about to be taken.
"""

from __future__ import annotations

import math


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """The learning-rate multiplier at optimizer step `step` (0-based).

    With W = warmup_steps, S = total_steps, r = min_ratio:

        step < W:        (step + 1) / W                      linear: 1/W, 2/W, ..., W/W = 1
        W ≤ step < S:    r + (1 − r) · ½ (1 + cos(π p)),      p = (step − W) / (S − W) ∈ [0, 1)
        step ≥ S:        r                                    constant floor

    Warmup counts from step + 1 so the very first step already moves (a factor of 0 would
    waste it) and the last warmup step, W − 1, reaches exactly 1. The cosine starts at 1
    (p = 0, step W), passes (1 + r)/2 halfway (p = ½, step W + (S − W)/2) and would reach r at
    p = 1 (step S), where the constant floor takes over, so the curve is continuous there.
    W = 0 means no warmup (the cosine starts at step 0). If S = W the decay has no length: the
    factor is 1 through warmup and r from step S on.
    """
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step and warmup_steps must be >= 0, got step={step}, warmup_steps={warmup_steps}")
    if total_steps < warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_ratio
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
