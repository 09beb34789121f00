"""Reading a user's text file (recipe, teacher file, prompt file) with every failure explained.

A file the user names can be missing, a directory, unreadable (permissions), binary, or text in
an encoding other than UTF-8. Python reports these as FileNotFoundError, IsADirectoryError,
PermissionError and UnicodeDecodeError, none of which says what the user should do; here each one
becomes a `UserError` that names the file and, for bad bytes, the line where they are.
"""

from __future__ import annotations

from pathlib import Path

from k3post.config.errors import UserError, located


def check_readable_file(path: Path, what: str) -> None:
    """`path` exists, is a regular file and can be opened (`what`: "recipe", "prompt file", ...)."""
    if path.is_dir():
        raise UserError(located(path, f"expected a {what}, found a directory"))
    if not path.exists():
        raise UserError(located(path, f"{what} not found"))
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        raise UserError(located(path, f"cannot read this {what}: permission denied")) from None
    except OSError as err:
        raise UserError(located(path, f"cannot read this {what}: {err.strerror or err}")) from None


def decode_text(raw: bytes, path: Path, what: str) -> str:
    """UTF-8 text of `raw`; NUL bytes or invalid UTF-8 are a UserError naming the line."""
    if b"\0" in raw[:8192]:
        raise UserError(located(path, f"expected a UTF-8 text {what}, this looks like a binary file "
                                      "(it contains NUL bytes)"))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise UserError(located(path, f"line {line}: expected UTF-8 text in this {what} (byte "
                                      f"{raw[err.start:err.start + 1]!r} at offset {err.start} is not UTF-8; "
                                      "re-save the file as UTF-8)")) from None


def read_text(path: Path, what: str) -> str:
    """The whole file as UTF-8 text, or a UserError that says what is wrong with it."""
    check_readable_file(path, what)
    try:
        raw = path.read_bytes()
    except OSError as err:  # raced with a chmod/delete, or an I/O error
        raise UserError(located(path, f"cannot read this {what}: {err.strerror or err}")) from None
    return decode_text(raw, path, what)
