"""docs/sizing.md shows `k3post plan`'s own output under each command it gives.

    .venv/bin/python tools/sizing_outputs.py           # re-run every command, rewrite the outputs
    .venv/bin/python tools/sizing_outputs.py --check   # exit 1 if an output is not what plan prints now

A command is a ```bash block whose text starts with `k3post plan` (lines joined at a trailing `\\`);
its output is the ```text block that follows it (tests/unit/test_sizing_outputs.py runs the check).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "sizing.md"
_PAIR = re.compile(r"(```bash\n(k3post plan [^`]*?)\n```\n\n```text\n)([^`]*?)(\n```)", re.S)


def plan_output(command: str) -> str:
    """What `k3post plan` prints for a command of the page, run in this process from the repo root."""
    from k3post.cli.main import main  # noqa: PLC0415

    args = shlex.split(command.replace("\\\n", " "))[1:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), _in(REPO):
        main(args)
    return out.getvalue().rstrip("\n")


@contextlib.contextmanager
def _in(folder: Path):
    import os  # noqa: PLC0415

    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def rendered(text: str) -> str:
    """The page with every command's output re-printed."""
    return _PAIR.sub(lambda m: m.group(1) + plan_output(m.group(2)) + m.group(4), text)


def commands(text: str) -> list[str]:
    return [m.group(2) for m in _PAIR.finditer(text)]


def main(argv: list[str]) -> int:
    text = PAGE.read_text(encoding="utf-8")
    new = rendered(text)
    if "--check" in argv:
        if new != text:
            print(f"{PAGE.relative_to(REPO)}: an output differs from what `k3post plan` prints now; run "
                  f".venv/bin/python tools/sizing_outputs.py")
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
