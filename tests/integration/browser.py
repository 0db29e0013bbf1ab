"""A real browser for the dashboard tests: Debian's headless Chromium, run once per look (the
page loads, polls /api/status, draws; --virtual-time-budget lets its script run before the DOM
is dumped or the screenshot taken). Tests skip when no Chromium is installed
(`apt-get install chromium`; .ci/run installs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

BUDGET_MS = 4000  # virtual time for the page's first polls
HANG_S = 90  # one browser run; a loaded 2-core box is slow to start Chromium


def installed() -> str | None:
    """The browser's path, None when there is none."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium() -> str:
    """The browser's path, or a clean skip saying how to get it."""
    path = installed()
    if path:
        return path
    pytest.skip("no chromium on PATH (apt-get install -y chromium): the browser test needs one")


def _run(*args: str) -> str:
    # a profile of its own each time: no state (or lock) shared with another run or user
    with tempfile.TemporaryDirectory(prefix="meshtrain-chromium-") as profile:
        cmd = [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={BUDGET_MS}",
            *args,
        ]
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=HANG_S, start_new_session=True
        )
    if p.returncode != 0:
        raise AssertionError(f"chromium exited {p.returncode}: {p.stderr[-2000:]}")
    return p.stdout


def dump_dom(url: str) -> str:
    """The page's DOM after its script ran."""
    return _run("--dump-dom", url)


def screenshot(url: str, path: Path, size: str = "1240,760") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    _run(f"--screenshot={path}", f"--window-size={size}", "--hide-scrollbars", url)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no PNG written"
    return path


def shots_dir(default: Path) -> Path:
    """Where screenshots go: MESHTRAIN_SCREENSHOTS (the README's come from there) or a tmp."""
    return Path(os.environ.get("MESHTRAIN_SCREENSHOTS") or default)


class Page(HTMLParser):
    """What the dashboard drew: each grid cell's state, the loss chart's point count, its key
    (what lines and dots are) and its legend (the replicas), the bytes bars by link kind."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.cells: dict[str, str] = {}
        self.loss_points: int | None = None
        self.loss_key = ""
        self.legend: list[str] = []  # replicas, in the legend's order
        self.byte_kinds: list[str] = []
        self.pools: dict[str, str] = {}  # stage -> its pool cell's text
        self.polled = False
        self._in_key = False
        self._pool: str | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("data-cell"):
            self.cells[a["data-cell"]] = a.get("data-state") or ""
        if a.get("id") == "loss-chart" and a.get("data-points") is not None:
            self.loss_points = int(a["data-points"])
        if a.get("class") == "legend" and a.get("data-replica") is not None:
            self.legend.append(a["data-replica"] or "")
        if tag == "rect" and a.get("data-kind"):
            self.byte_kinds.append(a["data-kind"] or "")
        self._in_key = a.get("id") == "loss-key"
        self._pool = a.get("data-pool")
        if tag == "body" and a.get("data-polled"):
            self.polled = True

    def handle_data(self, data: str) -> None:
        if self._in_key:
            self.loss_key += data
        if self._pool is not None:
            self.pools[self._pool] = self.pools.get(self._pool, "") + data

    def handle_endtag(self, tag: str) -> None:
        self._in_key = False
        self._pool = None


def look(url: str) -> Page:
    return Page(dump_dom(url))
