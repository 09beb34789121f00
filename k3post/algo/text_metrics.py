"""What a completion's text says about collapse and behaviour: pure functions over strings.

A distilled student can lower its reverse KL to a teacher while its answers degenerate (in
a peer trainer, a student answered in newline-separated single letters; reverse KL fell 83%,
forward KL 12%). The KL figures cannot see that; these can:

- length: completion tokens per sample (the caller counts them);
- distinct-n: the share of a completion's word n-grams that are distinct (Li et al. 2016 use the
  corpus-level ratio; here per completion, pooled as Σ distinct / Σ total, so an interval can be
  put on it over completions). 1.0 for text that never repeats a bigram;
- repetition (seq-rep-n, Welleck et al. 2019): the share of a completion's word n-grams that
  repeat an earlier n-gram of the same completion, 1 − distinct-n per completion. "a\\na\\na\\na"
  has every 4-gram after the first repeated.

Words are whitespace-separated (tokeniser-free: a peer trainer's texts are scored the same way).

Behaviour scores: `BEHAVIOUR_SCORES` maps a name to a rule text → 0 or 1 (did the completion do
what the teacher's system prompt asks). The format rules read the start of the text, so a
completion cut at max_new_tokens is still judged fairly; `brief` counts its words.
"""

from __future__ import annotations

import re
from collections.abc import Callable


def words(text: str) -> list[str]:
    return text.split()


def ngram_counts(text: str, n: int) -> tuple[int, int]:
    """(distinct, total) word n-grams of `text`; (0, 0) when it has fewer than n words."""
    w = words(text)
    grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    return len(set(grams)), len(grams)


def distinct_n(texts: list[str], n: int = 2) -> float:
    """Σ distinct n-grams / Σ n-grams over completions (1.0 when none has n words)."""
    counts = [ngram_counts(t, n) for t in texts]
    total = sum(c[1] for c in counts)
    return sum(c[0] for c in counts) / total if total else 1.0


def repetition_rate(texts: list[str], n: int = 4) -> float:
    """Σ repeated n-grams / Σ n-grams over completions (seq-rep-n; 0.0 when none has n words)."""
    counts = [ngram_counts(t, n) for t in texts]
    total = sum(c[1] for c in counts)
    return sum(c[1] - c[0] for c in counts) / total if total else 0.0


_ANSWER_PREFIX = re.compile(r"^\s*\**answer\**\s*:", re.IGNORECASE)
_NUMBERED_ITEM = re.compile(r"^\s*\**\s*(\d+)[.)]\**\s+\S", re.MULTILINE)


def answer_prefix(text: str) -> float:
    """1 if the completion begins with "Answer:" (any case, markdown bold allowed)."""
    return float(bool(_ANSWER_PREFIX.match(text)))


def numbered_list(text: str) -> float:
    """1 if the completion holds a numbered list: lines starting "1." and "2." (or "1)", "2)")."""
    numbers = {int(m.group(1)) for m in _NUMBERED_ITEM.finditer(text)}
    return float({1, 2} <= numbers)


BRIEF_WORDS = 20


def brief(text: str) -> float:
    """1 if the completion is at most BRIEF_WORDS words long (the teacher asked for one sentence
    of at most ten words; SmolLM2-135M-Instruct's replies run ~35 words unasked). A reply cut at
    max_new_tokens (48 tokens is ~35 words) is long, and judged so."""
    return float(len(words(text)) <= BRIEF_WORDS)


BEHAVIOUR_SCORES: dict[str, Callable[[str], float]] = {
    "answer_prefix": answer_prefix,
    "numbered_list": numbered_list,
    "brief": brief,
}


def behaviour_score(name: str, text: str) -> float:
    if name not in BEHAVIOUR_SCORES:
        raise ValueError(f"unknown behaviour score {name!r}; known: {', '.join(BEHAVIOUR_SCORES)}")
    return BEHAVIOUR_SCORES[name](text)
