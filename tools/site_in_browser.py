"""The docs site in a real browser: every page renders, every image loads, every link resolves.

tests/unit/test_docs_site.py checks the built site's files statically; this loads each page in
headless Chromium, the way a reader sees it, and checks what the browser actually got:

    .venv/bin/python tools/site_in_browser.py                              # build, then check
    .venv/bin/python tools/site_in_browser.py --screenshots /tmp/site-shots   # + index/benchmarks PNGs
    .venv/bin/python tools/site_in_browser.py --screenshots docs/figures/site-shots --scale 0.5   # docs/docs-site.md's
    .venv/bin/python tools/site_in_browser.py --site site/ --chromium /usr/bin/chromium

Without --site it builds the site into a temporary directory (`mkdocs build --strict`, with this
Python's mkdocs). It serves the site on 127.0.0.1 (http.server, in a thread), starts headless
Chromium and drives it over the Chrome DevTools Protocol (the `websockets` package, sync client).
For every HTML page but 404.html and search.html it checks: the title is set and the main content
element has text; every <img> loaded (complete, naturalWidth > 0); every same-origin link target
answers HTTP 200, and a link's #fragment names an element id of its target page; no JS exception
or console/log error. It prints one line per page and a summary.

Exit status: 0 no problems, 1 problems (or the build failed), 2 no Chromium (or no websockets).
Tests: tests/unit/test_site_in_browser.py (it skips where Chromium is missing).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.parse import quote, unquote, urldefrag, urljoin
from urllib.request import ProxyHandler, build_opener

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
PAGE_TIMEOUT = 30.0  # seconds for one page: navigation, load, evaluation
VIEWPORT = (1280, 2000)  # width x height of every page, and of the screenshots
SCREENSHOTS = ("index.html", "benchmarks.html")
SKIPPED = ("404.html", "search.html")  # served for missing addresses / filled in by the search JS
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-port=0")

# Evaluated in each page once it has loaded; returns everything the checks need in one round trip.
# Images still loading (loading="lazy" below the viewport) are made eager and waited for, so that an
# image counts as broken only when it failed, not when it was merely not needed yet.
COLLECT_JS = r"""
(async () => {
  const pending = [...document.images].filter(i => !i.complete);
  await Promise.all(pending.map(i => new Promise(done => {
    i.addEventListener('load', done); i.addEventListener('error', done);
    i.loading = 'eager'; setTimeout(done, 10000);
  })));
  const main = document.querySelector('[role=main]') || document.querySelector('main');
  return {
    title: document.title,
    main: main === null ? null : main.innerText.trim().length,
    images: document.images.length,
    broken_images: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0))
                                       .map(i => i.getAttribute('src') || i.currentSrc),
    links: [...document.querySelectorAll('a[href]')]
             .filter(a => { try { return new URL(a.href).origin === location.origin; } catch (e) { return false; } })
             .map(a => ({href: a.getAttribute('href'), url: a.href})),
    ids: [...document.querySelectorAll('[id]')].map(e => e.id)
           .concat([...document.querySelectorAll('a[name]')].map(a => a.name)),
  };
})()
"""


class BrowserError(RuntimeError):
    """Chromium could not be started, refused a command, or did not answer in time."""


class BrowserGone(BrowserError):
    """The DevTools connection closed (Chromium exited): no later page can be checked either."""


@dataclass
class PageReport:
    """What one page showed in the browser: its title, counts, and the problems found."""

    page: str  # relative to the site, e.g. "reference/recipes.html"
    title: str = ""
    images: int = 0
    links: list = field(default_factory=list)  # [{"href": as written, "url": absolute}], same origin
    ids: set = field(default_factory=set)
    problems: list = field(default_factory=list)

    def line(self) -> str:
        """The page's line of the printed report."""
        if not self.problems:
            return f"ok    {self.page}  ({self.title!r}, {self.images} images, {len(self.links)} links)"
        return f"FAIL  {self.page}: " + "; ".join(self.problems)


def find_chromium(path: str | None = None) -> str | None:
    """The Chromium executable to use (`path`, else /usr/bin/chromium, else one on PATH), or None."""
    if path:
        return path if os.access(path, os.X_OK) else None
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    return next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)


def build_site(out: Path) -> None:
    """Builds the docs site into `out` with `mkdocs build --strict` (this Python's mkdocs), so that
    the check sees what the repository's docs build to now. Raises RuntimeError with the log."""
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                            str(REPO / "mkdocs.yml"), "--site-dir", str(out)], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"})
    if build.returncode != 0:
        raise RuntimeError(f"mkdocs build --strict failed:\n{build.stdout}{build.stderr}")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass  # one line per request on stderr would drown the report


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)
        # else: the browser dropped a response it no longer needed (it navigated on): not a problem


class SiteServer:
    """Serves a directory on 127.0.0.1 on a free port from a thread (a context manager), so that the
    browser loads pages over HTTP as readers do and a missing file is a 404."""

    def __init__(self, site: Path):
        handler = functools.partial(_QuietHandler, directory=str(site))
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "SiteServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


class DevTools:
    """A Chrome DevTools Protocol connection: numbered calls, with the events that arrive meanwhile
    kept in `events`, and a deadline on every wait so that a stuck browser fails instead of hanging."""

    def __init__(self, ws_url: str, timeout: float = PAGE_TIMEOUT):
        from websockets.sync.client import connect

        self._stack = contextlib.ExitStack()  # websockets wants connect() used as a context manager
        self.ws = self._stack.enter_context(connect(ws_url, max_size=None, open_timeout=timeout))
        self.timeout = timeout
        self.last_id = 0
        self.events: list[dict] = []

    def _receive(self, deadline: float, waiting_for: str) -> dict:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            return json.loads(self.ws.recv(timeout=left))
        except TimeoutError:
            raise BrowserError(f"timed out after {self.timeout:g} s waiting for {waiting_for}") from None
        except Exception as exc:  # the connection closed: Chromium exited
            raise BrowserGone(f"lost the browser waiting for {waiting_for}: {exc}") from None

    def call(self, method: str, params: dict | None = None, target_session: str | None = None) -> dict:
        """Sends one command (to a page's `target_session`, or to the browser) and returns its result."""
        self.last_id += 1
        message = {"id": self.last_id, "method": method, "params": params or {}}
        if target_session:
            message["sessionId"] = target_session
        self.ws.send(json.dumps(message))
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._receive(deadline, f"the answer to {method}")
            if reply.get("id") == self.last_id:
                if "error" in reply:
                    raise BrowserError(f"{method} failed: {reply['error'].get('message', reply['error'])}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_for(self, method: str, target_session: str) -> dict:
        """Waits for an event of `target_session` (one already received counts) and returns it."""
        deadline = time.monotonic() + self.timeout
        while True:
            for i, event in enumerate(self.events):
                if event["method"] == method and event.get("sessionId") == target_session:
                    return self.events.pop(i)
            message = self._receive(deadline, method)
            if "method" in message:
                self.events.append(message)

    def close(self) -> None:
        try:
            self._stack.close()
        except Exception:  # closing a connection the browser already dropped
            pass


class Chromium:
    """Headless Chromium with a fresh profile, started and stopped as a context manager; its
    DevTools address is read from its stderr ("DevTools listening on ws://...")."""

    def __init__(self, executable: str, timeout: float = PAGE_TIMEOUT):
        self.executable, self.timeout = executable, timeout
        self.profile = tempfile.mkdtemp(prefix="site-in-browser-profile-")
        self.proc: subprocess.Popen | None = None
        self.devtools: DevTools | None = None
        self.stderr_tail: list[str] = []

    def __enter__(self) -> "Chromium":
        try:
            self.devtools = DevTools(self._start(), self.timeout)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> str:
        """Starts the process and returns its DevTools websocket address."""
        self.proc = subprocess.Popen([self.executable, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
                                      "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        lines: queue.Queue = queue.Queue()

        def drain():  # read stderr to its end, so that Chromium never blocks on a full pipe
            for line in self.proc.stderr:
                self.stderr_tail = (self.stderr_tail + [line.rstrip()])[-20:]
                lines.put(line)
            lines.put(None)

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise BrowserGone(f"{self.executable} exited ({self.proc.wait()}) before DevTools "
                                   "listened:\n" + "\n".join(self.stderr_tail))
            if m := re.search(r"DevTools listening on (ws://\S+)", line):
                return m.group(1)
        raise BrowserError(f"{self.executable} did not open DevTools within {self.timeout:g} s")

    def __exit__(self, *exc) -> None:
        """Closes the browser (politely, then by signal to the process group it leads) and deletes
        its profile, whatever happened before."""
        if self.devtools is not None:
            try:
                self.devtools.call("Browser.close")
            except BrowserError:
                pass
            self.devtools.close()
        if self.proc is not None:
            self._stop()
        shutil.rmtree(self.profile, ignore_errors=True)

    def _stop(self) -> None:
        """Waits 5 s for the process to exit (after Browser.close), then sends SIGTERM, then
        SIGKILL to the process group it leads (start_new_session: its helper processes too)."""
        for send in (None, self.proc.terminate, lambda: os.killpg(self.proc.pid, signal.SIGKILL)):
            if send is not None:
                try:
                    send()
                except ProcessLookupError:
                    return
            try:
                self.proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue


def open_page(devtools: DevTools) -> tuple[str, str]:
    """Opens a blank tab with the viewport VIEWPORT and the events the checks read enabled;
    returns (target id, its `target_session` id)."""
    target = devtools.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    target_session = devtools.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log"):
        devtools.call(f"{domain}.enable", target_session=target_session)
    width, height = VIEWPORT
    devtools.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                         "deviceScaleFactor": 1, "mobile": False}, target_session)
    return target, target_session


def _errors(events: list[dict], target_session: str, broken_urls: set[str]) -> list[str]:
    """The JS exceptions and console/log errors among a page's events. A failed load of an image
    already reported as broken is not reported twice."""
    out = []
    for event in events:
        if event.get("sessionId") != target_session:
            continue
        params = event["params"]
        if event["method"] == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            out.append("JS exception: " + details.get("exception", {}).get("description", details["text"]))
        elif event["method"] == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            out.append(f"console.{params['type']}: {text}")
        elif event["method"] == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            if entry.get("url") not in broken_urls:
                out.append(f"log error ({entry['source']}): {entry['text']} {entry.get('url', '')}".rstrip())
    return out


def visit(devtools: DevTools, target_session: str, url: str, page: str) -> PageReport:
    """Loads one page in the tab and collects what it shows, with its own problems (not rendered,
    broken images, JS errors); its links are checked later, across pages (check_links)."""
    devtools.events.clear()
    report = PageReport(page)
    nav = devtools.call("Page.navigate", {"url": url}, target_session)
    if nav.get("errorText"):
        report.problems.append(f"navigation failed: {nav['errorText']}")
        return report
    devtools.wait_for("Page.loadEventFired", target_session)
    result = devtools.call("Runtime.evaluate", {"expression": COLLECT_JS, "returnByValue": True,
                                                "awaitPromise": True}, target_session)
    if "exceptionDetails" in result:
        report.problems.append(f"the collecting script failed: {result['exceptionDetails'].get('text')}")
        return report
    got = result["result"]["value"]
    report.title, report.images, report.links, report.ids = got["title"], got["images"], got["links"], set(got["ids"])
    if not report.title.strip():
        report.problems.append("no <title>")
    if got["main"] is None:
        report.problems.append("no main content element ([role=main] or <main>)")
    elif got["main"] == 0:
        report.problems.append("the main content is empty (the page did not render)")
    report.problems += [f"broken image {src}" for src in got["broken_images"]]
    broken_urls = {urljoin(url, src) for src in got["broken_images"]}
    report.problems += _errors(devtools.events, target_session, broken_urls)
    return report


def http_status(url: str, timeout: float = PAGE_TIMEOUT) -> int | str:
    """The HTTP status of a GET of `url` (no proxy: the server is local), or the error in words."""
    try:
        with build_opener(ProxyHandler({})).open(url, timeout=timeout) as response:
            return response.status
    except HTTPError as exc:
        return exc.code
    except (URLError, OSError) as exc:
        return f"no answer ({exc})"


def check_links(reports: list[PageReport], ids_of) -> None:
    """Adds each page's broken links to its problems: a target that does not answer 200 (each
    distinct target is fetched once), or a #fragment naming no element id of its target page.
    `ids_of(url)` gives the ids of a page by its address without fragment."""
    status: dict[str, int | str] = {}
    for report in reports:
        for link in report.links:
            target, fragment = urldefrag(link["url"])
            if target not in status:
                status[target] = http_status(target)
            if status[target] != 200:
                report.problems.append(f"broken link {link['href']} (HTTP {status[target]})")
            elif fragment and fragment.lower() != "top" and unquote(fragment) not in ids_of(target):
                report.problems.append(f"broken link {link['href']} (no element with id {unquote(fragment)!r})")


def site_pages(site: Path) -> list[str]:
    """The pages to check: every .html file of the site but SKIPPED, as paths relative to it."""
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    return [p for p in pages if p not in SKIPPED]


def screenshot(devtools: DevTools, target_session: str, out: Path, scale: float = 1.0) -> None:
    """Saves the tab's viewport (VIEWPORT: the page's whole width) as a PNG, `scale` times its size."""
    params = {"format": "png"}
    if scale != 1.0:
        params["clip"] = {"x": 0, "y": 0, "width": VIEWPORT[0], "height": VIEWPORT[1], "scale": scale}
    data = devtools.call("Page.captureScreenshot", params, target_session)["data"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(base64.b64decode(data))


def check_site(site: Path, browser: Chromium, screenshots: Path | None = None, scale: float = 1.0) -> list[PageReport]:
    """Checks every page of a built site in `browser` (one tab for all pages), served from a local
    HTTP server for the duration; with `screenshots`, saves index.png and benchmarks.png there
    (`scale` times the viewport's size).
    Returns one report per page (a page that timed out reports that as its problem)."""
    devtools = browser.devtools
    target, target_session = open_page(devtools)
    reports: dict[str, PageReport] = {}
    try:
        with SiteServer(site) as server:
            url_of = {page: server.base + quote(page) for page in site_pages(site)}
            for page, url in url_of.items():
                try:
                    reports[page] = visit(devtools, target_session, url, page)
                    if screenshots is not None and page in SCREENSHOTS:
                        screenshot(devtools, target_session, screenshots / page.replace(".html", ".png"), scale)
                except BrowserGone:
                    raise
                except BrowserError as exc:  # this page timed out: say so, and go on with the next
                    reports[page] = PageReport(page, problems=[str(exc)])
            if screenshots is not None:
                for page in SCREENSHOTS:
                    if page not in url_of:
                        reports[page] = PageReport(page, problems=["missing: no page to take a screenshot of"])
            by_url = {url: reports[page] for page, url in url_of.items()}

            def ids_of(url: str) -> set:
                if url not in by_url:  # an HTML page not checked itself (search.html): load it for its ids
                    try:
                        by_url[url] = visit(devtools, target_session, url, url)
                    except BrowserGone:
                        raise
                    except BrowserError:
                        by_url[url] = PageReport(url)  # no ids: its fragments are reported
                return by_url[url].ids

            check_links(list(reports.values()), ids_of)
    finally:
        try:
            devtools.call("Target.closeTarget", {"targetId": target})
        except BrowserError:
            pass  # the browser is gone or stuck; Chromium.__exit__ stops it
    return list(reports.values())


def summary(reports: list[PageReport]) -> str:
    """The report's last line: pages, images and links checked, and the problems found."""
    problems = sum(len(r.problems) for r in reports)
    failing = sum(1 for r in reports if r.problems)
    images = sum(r.images for r in reports)
    links = len({link["url"] for r in reports for link in r.links})
    verdict = "no problems" if not problems else f"{problems} problems on {failing} pages"
    return f"{len(reports)} pages checked ({images} images, {links} distinct same-origin links): {verdict}"


def main(argv: list[str] | None = None) -> int:
    """The command line (the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, help="a built site to check (default: build one now)")
    parser.add_argument("--chromium", help=f"the Chromium executable (default: {CHROMIUM})")
    parser.add_argument("--screenshots", type=Path, help="save index.png and benchmarks.png here")
    parser.add_argument("--scale", type=float, default=1.0,
                        help=f"the screenshots' size against the viewport's {VIEWPORT[0]} x {VIEWPORT[1]} pixels")
    args = parser.parse_args(argv)
    executable = find_chromium(args.chromium)
    if executable is None:
        print(f"no Chromium at {args.chromium or CHROMIUM} (pass --chromium PATH)", file=sys.stderr)
        return 2
    try:
        import websockets.sync.client  # noqa: F401
    except ImportError:
        print("the websockets package is missing (.venv/bin/pip install websockets)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="site-in-browser-") as tmp:
        site = args.site
        if site is None:
            site = Path(tmp) / "site"
            try:
                build_site(site)
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                return 1
        try:
            with Chromium(executable) as browser:
                reports = check_site(site, browser, args.screenshots, args.scale)
        except BrowserError as exc:
            print(f"the browser failed: {exc}", file=sys.stderr)
            return 1
    for report in reports:
        print(report.line())
    print(summary(reports))
    if args.screenshots is not None:
        print(f"screenshots: {', '.join(str(args.screenshots / p.replace('.html', '.png')) for p in SCREENSHOTS)}")
    return 1 if any(r.problems for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
