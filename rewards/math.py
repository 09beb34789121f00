"""Math answer correctness: what the completion states as its answer, compared by math-verify.

    correctness(prompt: str, completion: str, meta: dict) -> float

meta["answer"]: the gold answer as text: "42", "\\frac{1}{2}", "$x^2+1$", "\\boxed{(1, 2)}".
Returns 1.0 if the answer the completion *states* is judged equal to the gold answer by
math-verify's `verify` (symbolically or numerically, so "\\dfrac{2}{4}" matches "0.5"), and 0.0
otherwise, including when the completion states no answer.

What the completion states as its answer (`stated_answer`), the first rule that finds one:

1. its last \\boxed{...} (or \\fbox{...});
2. its last "the answer is X" / "answer: X" (X up to the end of the sentence);
3. a number after a final "=": "11 + 6 = 17" (the completion ends there);
4. the last value it states: its last $...$ / \\(...\\) / \\[...\\] formula or its last number
   outside formulas, whichever comes later.

Of an answer with an "=" ("$x = 5$", "\\boxed{11 + 6 = 17}") the right-hand side is taken. An answer
that is an expression copied from the prompt (whitespace aside) is no answer (`is_echo`): for
"What is 11 + 6?", "11 + 6 is a well-known calculation" states nothing, though math-verify would
evaluate the echoed "11 + 6" to 17 - a reward that paid for it would teach an RL policy to echo the
question; so is the prompt's arithmetic rearranged ("6 + 11"). A literal found in the prompt still
counts ("What is 34 - 17?" → "17").

Why not math-verify's own extraction on the whole completion: it takes the first parseable
expression of its most specific kind, which may be the question restated. Here math-verify parses
only the extracted answer. Arithmetic on the prompt's own numbers left unevaluated
("\\boxed{6 + 11}", "2 \\times 5" for "What is 5 times 2?") is an echo too (`is_rearranged`).
Limits: numbers written in words are not read ("seventeen").

Only the last `tail_chars` characters of the completion are read: answers come at the end, and it
bounds the work sympy can be made to do by a long or adversarial completion.

Timeouts: math-verify guards parsing and comparison with signal.alarm, which only works in the
main thread. There we keep its 5 s timeouts; in a worker thread (k3post's reward pool) they are
switched off and the pool's per-call timeout takes over (math-verify's documented advice).

    rewards:
      - {fn: "rewards.math:correctness", weight: 1.0}
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

TIMEOUT_S = 5
NUMBER = r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?(?![\w])"
LITERAL = rf"{NUMBER}|-?\\[dt]?frac\{{\d+\}}\{{\d+\}}"
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*(.+?)\s*(?:[.!?;](?=\s|$)|,(?=\s)|\n|$)", re.I)
_FINAL_EQUALS = re.compile(rf"=\s*({NUMBER})\s*[.!]?\s*$")
_FORMULA = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse_expression(text: str) -> list:
    """math-verify's parse of one answer. Answers are usually bare ("1/2", "x^2+1"); its LaTeX
    extractor wants delimiters, so a bare answer is wrapped in $...$ (falling back to the text)."""
    timeout = _timeout()
    if "$" not in text and "\\boxed" not in text:
        wrapped = parse(f"${text}$", parsing_timeout=timeout)
        if wrapped:
            return wrapped
    return parse(text, parsing_timeout=timeout)


def parse_gold(answer: str) -> list:
    return _parse_expression(answer)


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces matched; None if none (or it never closes)."""
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _last_value(text: str) -> str | None:
    """The later of the last formula and the last number outside formulas."""
    formulas = list(_FORMULA.finditer(text))
    spans = [m.span() for m in formulas]
    numbers = [m for m in re.finditer(NUMBER, text) if not any(a <= m.start() < b for a, b in spans)]
    formula = formulas[-1] if formulas else None
    number = numbers[-1] if numbers else None
    if formula is None and number is None:
        return None
    if number is None or (formula is not None and formula.end() > number.end()):
        return next(g for g in formula.groups() if g is not None)
    return number.group(0)


def stated_answer(completion: str) -> str | None:
    """What the completion states as its answer (module docstring, rules 1-4), as text, or None."""
    text = completion.strip()
    answer = _last_boxed(text)
    if answer is None:
        found = list(_ANSWER_IS.finditer(text))
        answer = found[-1].group(1) if found else None
    if answer is None:
        final = _FINAL_EQUALS.search(text)
        answer = final.group(1) if final else _last_value(text)
    if answer is None:
        return None
    answer = answer.rsplit("=", 1)[-1].strip().strip("$").strip()
    if re.fullmatch(NUMBER, answer):
        answer = answer.replace(",", "")
    return answer or None


def _squeezed(text: str) -> str:
    return re.sub(r"[\s$]", "", text).rstrip(".!?")


def is_echo(answer: str, prompt: str) -> bool:
    """An expression that appears in the prompt, whitespace and $ aside, or arithmetic on the
    prompt's own numbers left unevaluated (`is_rearranged`). A literal (a number, a fraction of
    integers: "17", "3/4", "\\frac{3}{4}") is never an echo: a question may well name its own
    answer ("Which is larger, 3/4 or 2/3?")."""
    if re.fullmatch(LITERAL, answer.replace(" ", "")):
        return False
    return _squeezed(answer) in _squeezed(prompt) or is_rearranged(answer, prompt)


_OPERATORS = {"\\times": "*", "\\cdot": "*", "\\div": "/", "×": "*", "÷": "/", "−": "-"}
_ARITHMETIC = re.compile(r"[\d.+\-*/^()]+")
_BINARY = re.compile(r"[\d)][+\-*/^]")  # an operator after an operand: "6+11", "(6)+(11)", not "-5"
_OPERAND = re.compile(r"\d+(?:\.\d+)?")


def is_rearranged(answer: str, prompt: str) -> bool:
    """Numbers and operators only (no variable, no function), with an operator between them, whose
    numbers are all the prompt's ("\\boxed{6 + 11}" for "What is 11 + 6?"): the question's sum
    reordered, which math-verify would evaluate to the answer without the completion stating it.
    Not an echo: any answer with a letter in it ("x^2+1", "2\\sqrt{3}"), and arithmetic on a number
    the prompt does not hold ("11 + 6 + 0.5" is the completion's own, and wrong or right on its own)."""
    squeezed = re.sub(r"\s", "", answer)
    for latex, plain in _OPERATORS.items():
        squeezed = squeezed.replace(latex, plain)
    if not (_ARITHMETIC.fullmatch(squeezed) and _BINARY.search(squeezed)):
        return False
    have = _OPERAND.findall(prompt.replace(",", ""))
    for number in _OPERAND.findall(squeezed):
        if number not in have:
            return False
        have.remove(number)
    return True


def correctness(prompt: str, completion: str, meta: dict, tail_chars: int = 4000) -> float:
    if "answer" not in meta:
        raise KeyError("rewards.math:correctness needs meta['answer'] (the gold answer)")
    gold = parse_gold(str(meta["answer"]))
    if not gold:
        raise ValueError(f"math-verify could not parse the gold answer {meta['answer']!r}")
    answer = stated_answer(completion[-tail_chars:])
    if answer is None or is_echo(answer, prompt):
        return 0.0
    predicted = _parse_expression(answer)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=_timeout()) else 0.0
