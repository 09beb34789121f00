"""When speculative rollouts pay.

A plain decode step emits one token per row in d seconds. A speculative round (K draft steps of
the head plus one student forward over K + 1 positions) takes r seconds and emits, per row, the
acceptance length ℓ = 1 + (accepted drafts) tokens, 1 ≤ ℓ ≤ K + 1. Speculation pays when it
emits tokens faster:

    ℓ / r  >  1 / d      ⇔      ℓ  >  r / d   (the measured cost of a round in decode steps)

On a GPU a small student's decode step is bound by reading its weights, so a verify of K + 1
positions costs about one decode step at small batch (r / d ≈ 1 + the head's share) and
speculation pays with any acceptance; at large batch the step becomes compute-bound, r / d grows
towards K + 1 and it stops paying. Both sides are measured on the running engine, never assumed.
`min_accept` is the recipe's floor on the mean accepted drafts per round (ℓ − 1) on top of it.
"""

from __future__ import annotations


def speculation_pays(acceptance_length: float, round_s: float, decode_step_s: float, min_accept: float) -> bool:
    """True when a round's tokens come faster than plain decoding's and enough drafts are accepted."""
    if acceptance_length - 1.0 < min_accept:
        return False
    if round_s <= 0 or decode_step_s <= 0:
        return True  # a side not measured yet: the floor alone decides until both are
    return acceptance_length * decode_step_s > round_s
