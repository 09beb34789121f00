"""Math answer correctness, decided by the math-verify library (not a hand-written parser).

    correctness(prompt: str, completion: str, meta: dict) -> float

meta["answer"]: the gold answer as text: "42", "\\frac{1}{2}", "$x^2+1$", "\\boxed{(1, 2)}".
Returns 1.0 if math-verify extracts an answer from the completion (a \\boxed{...}, a $...$
expression, or a final plain number; it tries them in order of specificity) that `verify`
judges equal to the gold answer — symbolically or numerically, so "\\dfrac{2}{4}" matches "0.5" —
and 0.0 otherwise, including when the completion has no answer at all.

Only the last `tail_chars` characters of the completion are parsed: answers come at the end,
and it bounds the work sympy can be made to do by a long or adversarial completion.

Timeouts: math-verify guards parsing and comparison with signal.alarm, which only works in the
main thread. There we keep its 5 s timeouts; in a worker thread (k3post's reward pool) they are
switched off and the pool's per-call timeout takes over (math-verify's documented advice).

    rewards:
      - {fn: "rewards.math:correctness", weight: 1.0}
"""

from __future__ import annotations

import threading

from math_verify import parse, verify

TIMEOUT_S = 5


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_gold(answer: str) -> list:
    """Gold answers are usually bare ("1/2", "x^2+1"); math-verify's LaTeX extractor wants
    delimiters, so a bare answer is wrapped in $...$ (falling back to the text as is)."""
    timeout = _timeout()
    if "$" not in answer and "\\boxed" not in answer:
        wrapped = parse(f"${answer}$", parsing_timeout=timeout)
        if wrapped:
            return wrapped
    return parse(answer, parsing_timeout=timeout)


def correctness(prompt: str, completion: str, meta: dict, tail_chars: int = 4000) -> float:
    if "answer" not in meta:
        raise KeyError("rewards.math:correctness needs meta['answer'] (the gold answer)")
    gold = parse_gold(str(meta["answer"]))
    if not gold:
        raise ValueError(f"math-verify could not parse the gold answer {meta['answer']!r}")
    predicted = parse(completion[-tail_chars:], parsing_timeout=_timeout())
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=_timeout()) else 0.0
