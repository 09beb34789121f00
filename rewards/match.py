"""String-match correctness: exact match of the answer, or of what a regular expression extracts.

    exact_match(prompt, completion, meta, field="answer", ignore_case=True) -> float
    regex_match(prompt, completion, meta, pattern, field="answer", ignore_case=True) -> float

meta[field]: the gold answer (a string, or a list of accepted strings).

- exact_match: 1.0 when the completion, stripped of surrounding whitespace and a trailing
  period, equals a gold answer; 0.0 otherwise.
- regex_match: the *last* match of `pattern` in the completion (answers come at the end; a model
  that "thinks out loud" mentions other candidates first) — group 1 if the pattern has a group,
  else the whole match — compared the same way. No match scores 0.0.

Both fit the reward protocol (docs/rewards.md), so an RL recipe can use them too:

    rewards:
      - {fn: "rewards.match:regex_match", kwargs: {pattern: "answer: (\\\\w+)"}}
"""

from __future__ import annotations

import re


def _normalise(text: str, ignore_case: bool) -> str:
    text = text.strip().rstrip(".").strip()
    return text.lower() if ignore_case else text


def _golds(meta: dict, field: str) -> list[str]:
    if field not in meta:
        raise KeyError(f"needs meta[{field!r}] (the gold answer)")
    gold = meta[field]
    return [str(g) for g in gold] if isinstance(gold, (list, tuple)) else [str(gold)]


def exact_match(prompt: str, completion: str, meta: dict, field: str = "answer", ignore_case: bool = True) -> float:
    answer = _normalise(completion, ignore_case)
    return 1.0 if any(answer == _normalise(g, ignore_case) for g in _golds(meta, field)) else 0.0


def regex_match(prompt: str, completion: str, meta: dict, pattern: str = r"(-?\d+(?:\.\d+)?)",
                field: str = "answer", ignore_case: bool = True) -> float:
    golds = _golds(meta, field)
    matches = list(re.finditer(pattern, completion, flags=re.IGNORECASE if ignore_case else 0))
    if not matches:
        return 0.0
    last = matches[-1]
    found = last.group(1) if last.re.groups else last.group(0)
    answer = _normalise(found or "", ignore_case)
    return 1.0 if any(answer == _normalise(g, ignore_case) for g in golds) else 0.0
