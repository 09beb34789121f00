"""The docs site (mkdocs.yml): its home page and its heading anchors.

As a script, writes docs/index.md, the site's home page, from README.md:

    .venv/bin/python tools/docs_site.py           # rewrite docs/index.md
    .venv/bin/python tools/docs_site.py --check   # exit 1 if docs/index.md is stale

README.md links from the repository root: `docs/x.md` becomes `x.md`, and a link to a file outside
docs/ (a recipe, cluster/README.md), which is not part of the site, becomes a code span naming the
path. Everything else is copied unchanged (tests/unit/test_docs_site.py checks the page is current).

As an mkdocs hook (`hooks:` in mkdocs.yml), gives headings GitHub's anchors, so that the
`page.md#anchor` links the docs use on GitHub (tests/unit/test_docs_links.py) also work on the site.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
INDEX = REPO / "docs" / "index.md"
COMMAND = ".venv/bin/python tools/docs_site.py"
HEADER = f"<!-- Generated from README.md by `{COMMAND}`: edit README.md, then re-run it. -->\n\n"

_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)


def _link(m: re.Match) -> str:
    text, target = m.group(1), m.group(2)
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("//", "#")):
        return m.group(0)  # a web address or an anchor on the same page
    if target.startswith("docs/"):
        return f"[{text}]({target[len('docs/'):]})"
    path = target.partition("#")[0]
    if text.strip("`") == path:
        return f"`{path}`"
    return f"{text} (`{path}`)"


def render(readme: str | None = None) -> str:
    """docs/index.md's text for README.md's text (read from the file if not given)."""
    text = README.read_text(encoding="utf-8") if readme is None else readme
    out, pos = [], 0
    for fence in _FENCE.finditer(text):  # code blocks are copied verbatim
        out.append(_LINK.sub(_link, text[pos:fence.start()]))
        out.append(fence.group(0))
        pos = fence.end()
    out.append(_LINK.sub(_link, text[pos:]))
    return HEADER + "".join(out)


def github_slug(value: str, separator: str = "-") -> str:
    """GitHub's anchor of a heading's text: lowercase, punctuation dropped, each space a '-'
    (runs of '-' are kept, unlike Python-Markdown's default slugify)."""
    return re.sub(r"[^\w\- ]", "", value.strip().lower()).replace(" ", separator)


def on_config(config, **kwargs):
    """mkdocs hook: headings get GitHub's anchors."""
    if "toc" not in config.markdown_extensions:
        config.markdown_extensions.append("toc")
    config.mdx_configs.setdefault("toc", {})["slugify"] = github_slug
    return config


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    page = render()
    if "--check" in args:
        if not INDEX.is_file() or INDEX.read_text(encoding="utf-8") != page:
            print(f"docs/index.md is stale (README.md changed); regenerate it with `{COMMAND}`",
                  file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
