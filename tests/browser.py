"""Headless Chromium for the page tests: Debian's `chromium` package driven by Playwright for Python.

Not Playwright's own browser download (`playwright install` needs a network the CI machines lack): the
system's /usr/bin/chromium, which `make install` installs with apt. The flags keep a headless Chromium
off the network it would otherwise keep calling (updates, sync, field trials) and out of the sandbox a
container cannot give it; every launch gets a fresh profile.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def chromium_path() -> str | None:
    """The system Chromium ($PAGEDLLM_CHROMIUM first), or None."""
    for path in (os.environ.get("PAGEDLLM_CHROMIUM"), *CHROMIUM_CANDIDATES, shutil.which("chromium")):
        if path and Path(path).is_file() and os.access(path, os.X_OK):
            return path
    return None


def browser_required() -> bool:
    """CI sets PAGEDLLM_REQUIRE_BROWSER=1 (.ci/run): there a missing browser fails the page tests."""
    return os.environ.get("PAGEDLLM_REQUIRE_BROWSER") == "1"


def why_no_browser() -> str | None:
    """None when the page tests can run; else the reason they cannot (a skip says it, or a failure on CI)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -e '.[test]'"
    if chromium_path() is None:
        return "no Chromium at /usr/bin/chromium: `make install` installs Debian's chromium package (apt)"
    return None


def require_browser() -> None:
    """Skip (or, where a browser is required, fail) a test that needs Chromium when there is none."""
    reason = why_no_browser()
    if reason is None:
        return
    if browser_required():
        pytest.fail(f"PAGEDLLM_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@contextlib.contextmanager
def chromium(viewport: tuple[int, int] = (1400, 1000)) -> Iterator[Any]:
    """A Playwright BrowserContext of headless Chromium with a fresh profile, closed on exit."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="pagedllm-chromium-")
    try:
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                profile,
                executable_path=chromium_path(),
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": viewport[0], "height": viewport[1]},
            )
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


class ConsoleErrors:
    """Every console error and uncaught exception of a page, as text."""

    def __init__(self, page: Any):
        self.errors: list[str] = []
        page.on("console", lambda msg: msg.type == "error" and self.errors.append(f"console: {msg.text}"))
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))
