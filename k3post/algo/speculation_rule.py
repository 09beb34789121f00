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

A batch. Rows accept independently, but a call runs until its last row stops: plain decoding
takes T steps for a call whose longest row has T tokens, speculation as many rounds R as its
slowest row needs. So a round replaces T / R decode steps (the steps per round, s). The rows'
mean ℓ overstates s when the rows that need the most rounds accept less than the rest, which
grows likelier with more rows (a call waits for the slowest of them): measured on one H100 at
batch 32, ℓ 1.59 while the call ran at 0.92× plain decoding. The rule compares what a call costs:

    s · d  >  r      ⇔      R · r  <  T · d

(at batch 1, s = ℓ but for the prefill's token).

Near break-even. A switch needs the other mode to be faster by `SWITCH_MARGIN`: speculating goes
on when s · d > (1 + m) r and off when s · d < (1 − m) r. Within the margin both modes cost the same
to within the timings' own noise, and a rule without it flips on that noise call after call (on
one H100 at s · d ≈ r, four switches in one benchmark's rule arm), a log line each, for no speed.
"""

from __future__ import annotations

SWITCH_MARGIN = 0.03


def speculation_pays(acceptance_length: float, steps_per_round: float, round_s: float, decode_step_s: float,
                     min_accept: float, speculating: bool = False) -> bool:
    """True when a call's rounds take less time than its decode steps would (s · d > r, past the
    switch margin from the mode in use: `speculating`) and enough drafts are accepted (ℓ − 1 ≥
    min_accept)."""
    if acceptance_length - 1.0 < min_accept:
        return False
    if round_s <= 0 or decode_step_s <= 0:
        return True  # a side not measured yet: the floor alone decides until both are
    margin = -SWITCH_MARGIN if speculating else SWITCH_MARGIN
    return steps_per_round * decode_step_s > (1.0 + margin) * round_s


def steps_per_round(longest_row: int, rounds: int) -> float:
    """s = T / R: the decode steps a plain call would take for the longest row's T tokens, per round."""
    return longest_row / max(rounds, 1)
