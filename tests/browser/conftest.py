"""Fixtures for checking the built HTML book in a real, headless Chromium.

`make browser` runs these tests after `make html`. The book is served from ``_build/html`` by
a local HTTP server on 127.0.0.1 (as GitHub Pages would serve it; ``file://`` pages cannot
load web fonts, which MathJax needs), and Chromium is the system's, never a downloaded build:
``$CHROMIUM`` if set, else the first of the usual Debian/Ubuntu paths.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"
SCREENSHOTS = ROOT / "_build" / "screenshots"

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
# The flags of the brief: headless, no sandbox (we run as root in CI), no GPU, and no
# background traffic of the browser's own (updates, sync), so that every request the test
# sees comes from the page.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_executable() -> str:
    env = os.environ.get("CHROMIUM", "").strip()
    if env:
        return env
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("no Chromium found: run `make chromium` or set CHROMIUM=/path/to/chromium")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="session")
def site() -> Iterator[str]:
    """Base URL of the built book, served from _build/html on a free loopback port."""
    if not (HTML / "index.html").is_file():
        pytest.fail(f"{HTML / 'index.html'} is missing: build the book first (make html)")
    handler = functools.partial(_QuietHandler, directory=str(HTML))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=chromium_executable(), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
