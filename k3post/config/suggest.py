"""'Did you mean …?' for a name the user typed that is not one of the known ones."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def nearest(word: str, candidates: Iterable[str]) -> str | None:
    """The known name most like `word` (difflib's ratio ≥ 0.6), or None."""
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return close[0] if close else None


def did_you_mean(word: str, candidates: Iterable[str], shown: str = "{}") -> str:
    """'; did you mean 'X'?' for the nearest candidate (`shown` formats it), else ''."""
    found = nearest(word, candidates)
    return f"; did you mean {shown.format(found)!r}?" if found is not None else ""
