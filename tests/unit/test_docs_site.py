"""The docs site (mkdocs.yml) builds with `mkdocs build --strict` (no warnings: no broken link or
anchor, no page left out of nav), every page under docs/ is in its nav or deliberately in
`not_in_nav`, and the built site is whole: every page is there as HTML, every <img> and every
internal link points to a file of the site. docs/index.md, the home page, is README.md with its
links made relative to docs/ (tools/docs_site.py) and must be current."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
CONFIG = REPO / "mkdocs.yml"


def _docs_site():
    spec = importlib.util.spec_from_file_location("docs_site", REPO / "tools" / "docs_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config() -> dict:
    return yaml.safe_load(CONFIG.read_text(encoding="utf-8"))


def _nav_pages(nav) -> list[str]:
    """The Markdown files a nav names (entries are 'x.md', {title: 'x.md'} or {title: [...]})."""
    out = []
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            if isinstance(value, list):
                out += _nav_pages(value)
            elif isinstance(value, str) and not urlsplit(value).scheme:
                out.append(value)
    return out


def test_index_is_the_readme_with_links_made_relative_to_docs():
    docs_site = _docs_site()
    assert (DOCS / "index.md").read_text(encoding="utf-8") == docs_site.render(), (
        f"docs/index.md is stale (README.md changed); regenerate it with `{docs_site.COMMAND}`")
    page = docs_site.render("See [docs/eval.md](docs/eval.md#tasks), [`recipes/a.yaml`](recipes/a.yaml), "
                            "[the guide](cluster/README.md) and [x](https://example.org).\n"
                            "```\n[kept](recipes/a.yaml)\n```\n")
    assert page.endswith("See [docs/eval.md](eval.md#tasks), `recipes/a.yaml`, the guide (`cluster/README.md`) "
                         "and [x](https://example.org).\n```\n[kept](recipes/a.yaml)\n```\n")


def test_headings_get_githubs_anchors():
    slug = _docs_site().github_slug
    assert slug("Pipelines (kind: pipeline): SFT → OPD → eval", "-") == "pipelines-kind-pipeline-sft--opd--eval"
    assert slug("Experiment tracking (track:)", "-") == "experiment-tracking-track"


def test_every_page_is_in_the_nav_or_deliberately_left_out():
    pathspec = pytest.importorskip("pathspec", reason="pathspec comes with mkdocs, which is not installed")
    config = _config()
    assert config["docs_dir"] == "docs" and config["site_name"] == "k3post"
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), "a page is twice in the nav"
    assert nav[0] == "index.md"
    missing = [page for page in nav if not (DOCS / page).is_file()]
    assert not missing, f"the nav names pages that do not exist: {missing}"
    left_out = pathspec.GitIgnoreSpec.from_lines((config.get("not_in_nav") or "").splitlines())
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    orphans = [p for p in pages if p not in nav and not left_out.match_file(p)]
    assert not orphans, (f"pages in neither the nav nor not_in_nav of mkdocs.yml: {orphans}; add each to the "
                         "nav, or to not_in_nav with a comment saying why")


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs: list[str] = []
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img" and attrs.get("src"):
            self.imgs.append(attrs["src"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])


def _resolves(site: Path, page: Path, ref: str) -> bool:
    """Whether an internal reference of a built page names a file of the built site."""
    path = unquote(urlsplit(ref).path)
    if not path:
        return True  # "#anchor": the page itself
    # "/x.html" (404.html, served at any address) is relative to the site's root.
    target = (site / path.lstrip("/") if path.startswith("/") else page.parent / path).resolve()
    if target.is_dir():
        target = target / "index.html"
    return target.is_file() and target.is_relative_to(site.resolve())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it is in the dev extra: make setup, or "
                    ".venv/bin/pip install -e '.[dev]')")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(CONFIG),
                            "--site-dir", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "NO_COLOR": "1"})
    log = build.stdout + build.stderr
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    assert "WARNING" not in log, log
    return out


def test_every_nav_page_is_built_as_html(site):
    pages = _nav_pages(_config()["nav"])
    assert _config().get("use_directory_urls") is False  # x.md -> x.html, readable from file://
    missing = [p for p in pages if not (site / p).with_suffix(".html").is_file()]
    assert not missing, f"pages of the nav not built: {missing}"


def test_every_image_and_internal_link_of_the_built_site_resolves(site):
    broken, shown = [], set()
    for page in sorted(site.rglob("*.html")):
        refs = _Refs()
        refs.feed(page.read_text(encoding="utf-8"))
        rel = page.relative_to(site)
        for src in refs.imgs:
            if src.startswith("data:"):
                continue
            if urlsplit(src).scheme or src.startswith("//") or not _resolves(site, page, src):
                broken.append(f"{rel}: <img src={src!r}> is not a file of the site")
            else:
                shown.add((page.parent / unquote(urlsplit(src).path)).resolve().relative_to(site.resolve()))
        for href in refs.hrefs:
            if urlsplit(href).scheme or href.startswith("//"):
                continue  # a web address (or mailto:): not ours to check offline
            if not _resolves(site, page, href):
                broken.append(f"{rel}: <a href={href!r}> is not a file of the site")
    assert not broken, "\n".join(broken)
    figures = {p.relative_to(DOCS) for p in (DOCS / "figures").rglob("*.png")}
    assert figures, "no figures under docs/figures"
    assert not figures - shown, f"figures that no built page shows: {sorted(map(str, figures - shown))}"
