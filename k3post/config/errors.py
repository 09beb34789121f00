"""User-facing errors: the CLI prints these as one message, without a traceback.

The contract (docs/recipes.md, "Errors"): every mistake in the user's input is reported as

    FILE[: KEY.PATH | : row N]: what was expected (got VALUE)

with VALUE shortened (`shorten`), so that a megabyte prompt or an alias bomb never floods the
terminal. `located()` builds that line; code that finds a mistake raises `UserError(located(...))`.
Anything that is not a `UserError` is a bug in k3post: the CLI keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path

_MISSING = object()
MAX_SHOWN = 80  # characters of a value shown in a message


class UserError(Exception):
    """A mistake in the user's input (recipe, data file, model or run directory, command line),
    explained in words that name the file and, where there is one, the key path or the row."""


class RunStopped(RuntimeError):
    """A run stopped for a reason outside k3post and the user's input (a process of the run died):
    the CLI prints the message as one line (what died, and that re-running resumes), exit 1."""


class StepStopped(RunStopped):
    """A run stopped by a check on one step's own figures (the drift gate). `metrics` are that
    step's, as far as they were measured: the training loop logs them like any step's
    (metrics.jsonl and the recipe's sinks) before the error ends the run."""

    def __init__(self, message: str, metrics: dict[str, float] | None = None):
        super().__init__(message)
        self.metrics: dict[str, float] = dict(metrics or {})


class RecipeError(UserError):
    """A recipe file failed to load: the message names the file, the key path and what was expected."""


def shorten(value: object, limit: int = MAX_SHOWN) -> str:
    """`repr(value)` cut to about `limit` characters, saying how long the whole was.

    A value too big to even build a repr of (a list of millions of items) is described by its type
    and length instead; `repr` of huge containers is what turned one bad key into a gigabyte message.
    """
    size = len(value) if isinstance(value, (list, tuple, dict, set)) else None
    if size is not None and size > limit:
        return f"a {type(value).__name__} of {size} items"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 1]}… ({len(text)} characters)"


def located(file: str | Path | None, what: str, *, key: str | None = None, row: int | None = None,
            got: object = _MISSING) -> str:
    """The one message shape: `file[: key | : row N]: what (got …)`.

    `row` is 0-based, the index a generated row id uses (`<stem>-<row>`).
    """
    parts = [str(file)] if file is not None else []
    if key:
        parts.append(key)
    if row is not None:
        parts.append(f"row {row}")
    got_text = "" if got is _MISSING else f" (got {shorten(got)})"
    return ": ".join([*parts, what]) + got_text
