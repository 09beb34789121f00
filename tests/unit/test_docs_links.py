"""Every relative link in README.md and docs/*.md resolves: the file exists, and a `#anchor` into
a Markdown file names one of its headings (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"`|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    assert (REPO / "docs" / "quickstart.md").is_file()
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http:, https:, mailto: — not ours to check offline
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{target}: {path} does not exist")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading '#{anchor}' in {path.name}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)


TEST_PATH = re.compile(r"\btests/(?:unit|integration|vllm)/[A-Za-z0-9_]+\.py\b")
CITING = [*sorted((REPO / "k3post").rglob("*.py")), *sorted((REPO / "bench").rglob("*.py")), *DOCS]


def test_every_test_file_cited_in_the_code_and_docs_exists():
    """A module's docstring that sends the reader to a test file ("… (tests/unit/test_x.py)")
    names one that exists: a renamed or never-written test leaves a claim nobody checks."""
    missing = sorted({f"{path.relative_to(REPO)}: {cited}" for path in CITING
                      for cited in TEST_PATH.findall(path.read_text(encoding="utf-8"))
                      if not (REPO / cited).is_file()})
    assert len(CITING) > 100 and not missing, "; ".join(missing)
