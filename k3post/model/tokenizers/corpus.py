"""Text to train a tokenizer on: the built-in corpus, or the user's files.

The built-in corpus is English prose every Python installation carries, read offline:

1. `pydoc_data.topics` — the language reference's help topics (what `help("if")` prints),
   about 0.5 MB of plain English about programming;
2. the docstrings of the standard library's modules, classes and functions (the top-level
   modules and one level of packages; `test`, `idlelib`, `tkinter`, `lib2to3`, `turtledemo`
   and `site-packages` left out), in sorted file order — about 1.4 MB.

About 1.9 MB in all, read in ~2 s; a 12k-token BPE trains on it in about a second. It is
deterministic for one Python version: the same interpreter gives the same texts in the same
order, so the same tokenizer (the cache key of a transplant includes the version, see
`corpus_fingerprint`). k3post's built-in prompt sets are not in it: they live in the data
layer, which the model layer may not import (pyproject's import contracts), and they are a few
kB of templates; give them as a `corpus:` file if they matter.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from k3post.config.text_files import read_text

SKIPPED_PACKAGES = frozenset({"test", "idlelib", "tkinter", "lib2to3", "turtledemo", "site-packages"})
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
    return [p for p in files if p.parent == root or p.parent.name not in SKIPPED_PACKAGES]


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return  # an unreadable or py2-era file: skipped, the same way on every run
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED):
            text = ast.get_docstring(node)
            if text:
                yield text


def builtin_corpus() -> list[str]:
    """The built-in corpus (module docstring): help topics, then stdlib docstrings, in a fixed order."""
    from pydoc_data import topics  # noqa: PLC0415 - 0.5 MB module, only when a tokenizer is trained

    texts = [topics.topics[key] for key in sorted(topics.topics)]
    for path in _stdlib_files():
        texts.extend(_docstrings(path))
    return texts


def read_corpus(paths: list[str] | None) -> list[str]:
    """The texts of `paths` (UTF-8 files; a missing or binary one is a UserError naming it), or the
    built-in corpus when None. Each file is split at blank lines into paragraphs."""
    if paths is None:
        return builtin_corpus()
    texts = []
    for path in paths:
        texts.extend(p for p in read_text(Path(path), "corpus file").split("\n\n") if p.strip())
    return texts


def corpus_fingerprint(paths: list[str] | None) -> str:
    """What the corpus's content depends on beyond the spec: the Python version for the built-in
    one (its stdlib is the text), the bytes of each file otherwise (an edited file retrains)."""
    if paths is None:
        return f"builtin-python-{sys.version.split()[0]}"
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes() if Path(path).is_file() else b"<missing>")
    return digest.hexdigest()
