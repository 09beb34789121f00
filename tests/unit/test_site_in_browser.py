"""The docs site in headless Chromium (tools/site_in_browser.py): every page of the built site
renders, every image loads, every same-origin link and #fragment resolves, no JS error. And the
check can fail: on a copy of the site with one image deleted and two links broken it reports
exactly those problems, nothing else. Skips, saying why, where Chromium (or websockets, or mkdocs)
is missing; `make test` installs Chromium first where it runs as root with apt-get (the Makefile's
`browser` rule), so CI on a clean Debian machine runs it.
One Chromium serves every test of the module."""

from __future__ import annotations

import importlib.util
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("site_in_browser", REPO / "tools" / "site_in_browser.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


tool = _tool()


def test_no_chromium_exits_2(capsys):
    assert tool.main(["--chromium", "/nonexistent/chromium"]) == 2
    assert "no Chromium" in capsys.readouterr().err


@pytest.fixture(scope="module")
def browser():
    executable = tool.find_chromium()
    if executable is None:
        pytest.skip(f"no Chromium at {tool.CHROMIUM} or on PATH: `make test` installs it as root where apt-get "
                    "works (`make browser`); elsewhere install chromium to run this check")
    pytest.importorskip("websockets.sync.client", reason="the websockets package is not installed")
    with tool.Chromium(executable) as running:
        yield running


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it is in the dev extra)")
    out = tmp_path_factory.mktemp("site") / "site"
    tool.build_site(out)
    return out


def test_every_page_renders_with_its_images_and_links(site, browser, tmp_path):
    reports = tool.check_site(site, browser, tmp_path / "shots", scale=0.5)
    for name in ("index.png", "benchmarks.png"):  # half the viewport's size
        header = (tmp_path / "shots" / name).read_bytes()[:24]
        assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) == (
            tool.VIEWPORT[0] // 2, tool.VIEWPORT[1] // 2), name
    problems = [report.line() for report in reports if report.problems]
    assert not problems, "\n".join(problems)
    assert sorted(r.page for r in reports) == tool.site_pages(site)
    assert {"index.html", "benchmarks.html", "reference/recipes.html"} <= {r.page for r in reports}
    assert all(r.title.endswith("k3post") for r in reports)
    assert sum(r.images for r in reports) >= len(list((site / "figures").rglob("*.png")))
    assert all(r.links for r in reports)


def _an_image_shown_once(site: Path) -> tuple[str, str]:
    """(page, src) of an image that exactly one page shows and no page links to."""
    pages = {p.relative_to(site).as_posix(): p.read_text(encoding="utf-8") for p in site.rglob("*.html")}
    shown = [(page, src) for page, html in pages.items() for src in re.findall(r'<img [^>]*src="([^"]+)"', html)]
    for page, src in shown:
        name = Path(src).name
        if sum(name in s for _, s in shown) == 1 and not any(f'{name}"' in re.sub(r"<img [^>]*>", "", html)
                                                            for html in pages.values()):
            return page, src
    raise AssertionError("no image of the site is shown by exactly one page")


def test_a_missing_image_and_broken_links_are_reported(site, browser, tmp_path):
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    image_page, src = _an_image_shown_once(copy)
    (copy / image_page).parent.joinpath(src).unlink()
    link_page = "quickstart.html" if image_page != "quickstart.html" else "recipes.html"
    html = (copy / link_page).read_text(encoding="utf-8")
    assert html.count('href="index.html"') >= 2
    html = html.replace('href="index.html"', 'href="no-such-page.html"', 1)
    html = html.replace('href="index.html"', 'href="index.html#no-such-heading"', 1)
    (copy / link_page).write_text(html, encoding="utf-8")

    reports = {r.page: r.problems for r in tool.check_site(copy, browser) if r.problems}
    assert reports == {
        image_page: [f"broken image {src}"],
        link_page: ["broken link no-such-page.html (HTTP 404)",
                    "broken link index.html#no-such-heading (no element with id 'no-such-heading')"],
    }


def _fake_bin(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + script + "\n", encoding="utf-8")
    path.chmod(0o755)


@pytest.mark.parametrize("uid", [0, 1000])
def test_make_browser_installs_chromium_only_where_root_can(tmp_path, uid):
    """`make test` runs the Makefile's `browser` rule first: with no Chromium on PATH, as root
    with apt-get, it runs `apt-get update` and `apt-get install chromium`, once; not as root, it
    says in one line that the browser check will skip, and installs nothing."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "apt.log"
    for tool in ("cat", "sha1sum", "cut"):  # what the Makefile's variables call when it is read
        if shutil.which(tool):
            (bin_ / tool).symlink_to(shutil.which(tool))
    _fake_bin(bin_, "id", f'echo {uid}')
    _fake_bin(bin_, "apt-get", f'echo "$*" >> {log}\n'
                               f'case "$*" in *install*chromium*) printf "#!/bin/sh\\n" > {bin_}/chromium; '
                               f'{shutil.which("chmod")} +x {bin_}/chromium;; esac')
    env = {"PATH": str(bin_), "HOME": str(tmp_path)}

    def run() -> str:
        out = subprocess.run([make, "-s", "-C", str(REPO), "browser"], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    first = run()
    if uid == 0:
        assert "installing Chromium" in first
        assert log.read_text().split("\n")[:2] == ["update -qq", "install -y -qq --no-install-recommends chromium"]
        assert run() == "" and len(log.read_text().splitlines()) == 2  # found now: nothing again
    else:
        assert "needs root" in first and "test_site_in_browser.py will skip" in first
        assert not log.exists()
