"""A length penalty: nothing up to a target length, then a linear penalty, capped.

    penalty(prompt: str, completion: str, meta: dict, target: int | None = None,
            unit: str = "chars", window: int | None = None, max_penalty: float = 1.0) -> float

With L the completion length and T the target:

    reward = −max_penalty · min(1, max(0, L − T) / W)

so it is 0 for L ≤ T, falls linearly, and reaches −max_penalty at L = T + W (W defaults to T:
twice the target is the full penalty) and stays there.

- unit "chars": L = len(completion), in characters.
- unit "tokens": L = meta["completion_tokens"], the number of sampled tokens, which the RL loop
  knows exactly (re-tokenizing here could disagree with the sampler).
- T: meta["target_length"] if the sample carries one (per-prompt budgets), else `target` from
  the recipe; one of them is required.

    rewards:
      - {fn: "rewards.length:penalty", weight: 0.5, kwargs: {target: 2000, unit: chars}}
"""

from __future__ import annotations


def penalty(
    prompt: str,
    completion: str,
    meta: dict,
    target: int | None = None,
    unit: str = "chars",
    window: int | None = None,
    max_penalty: float = 1.0,
) -> float:
    target = meta.get("target_length", target)
    if target is None or target <= 0:
        raise ValueError("rewards.length:penalty needs a positive target (kwargs 'target' or meta['target_length'])")
    if unit == "chars":
        length = len(completion)
    elif unit == "tokens":
        if "completion_tokens" not in meta:
            raise KeyError("rewards.length:penalty with unit='tokens' needs meta['completion_tokens']")
        length = int(meta["completion_tokens"])
    else:
        raise ValueError(f"rewards.length:penalty: unit must be 'chars' or 'tokens', got {unit!r}")
    window = target if window is None else window
    if window <= 0:
        raise ValueError(f"rewards.length:penalty: window must be positive, got {window}")
    excess = max(0, length - target)
    return -max_penalty * min(1.0, excess / window)
