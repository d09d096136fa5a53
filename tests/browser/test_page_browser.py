"""`ddp report --html`'s page in a real browser: Debian's chromium, headless, renders it with no console
error, and its inline script sorts the per-class table. `make test-browser` runs this (and fails where
chromium is missing, DDP_REQUIRE_BROWSER=1); elsewhere it skips without chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
CONSOLE = re.compile(r":CONSOLE[:(\]].*")  # chromium's --enable-logging=stderr line for a console message


def browser() -> str:
    found = next(filter(None, map(shutil.which, BROWSERS)), None)
    if found:
        return found
    why = "no chromium on PATH (apt-get install chromium)"
    if os.environ.get("DDP_REQUIRE_BROWSER"):
        pytest.fail(f"{why}: `make test-browser` needs it")
    pytest.skip(why)


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser, looked for before the page is made (a skip costs no training)."""
    return browser()


def render(chromium: str, page: Path) -> tuple[str, list[str]]:
    """(the DOM after the page's scripts ran, the console messages) of `page` in headless chromium."""
    with_profile = page.parent / f"{page.stem}-profile"  # its own profile: no state from another run
    result = subprocess.run(
        [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
         f"--user-data-dir={with_profile}", "--enable-logging=stderr", "--v=0",
         "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, [m.group(0) for m in map(CONSOLE.search, result.stderr.splitlines()) if m]


def test_the_page_renders_without_a_console_error(chromium, demo_page):
    dom, console = render(chromium, demo_page[0])
    assert console == []
    for key in ("glance", "curves", "startup", "classes", "mistakes"):
        assert f'<section id="{key}">' in dom
    assert dom.count("<svg") >= 3 and "data:image/jpeg;base64," in dom


def test_a_console_error_is_seen(chromium, demo_page, tmp_path: Path):
    """The detection is real: a copy of the page with a deliberate error is caught."""
    broken = tmp_path / "broken.html"
    broken.write_text(demo_page[0].read_text().replace("<script>", "<script>undefinedFunction();", 1))
    _, console = render(chromium, broken)
    assert any("undefinedFunction is not defined" in line for line in console), console


def test_the_per_class_table_sorts(chromium, demo_page, tmp_path: Path):
    """A click on the top-1 header sorts the rows by it (the page's inline script, run by the browser)."""
    clicked = tmp_path / "clicked.html"
    clicked.write_text(demo_page[0].read_text().replace(
        "</body>", "<script>document.querySelectorAll('#per-class th')[4].click();</script></body>"))
    dom, console = render(chromium, clicked)
    assert console == []
    table = dom[dom.index('id="per-class"'):]
    shares = [float(v) for v in re.findall(r'data-v="([-0-9.e]+)"', table[:table.index("</table>")])]
    assert len(shares) == 10 and shares == sorted(shares) and shares != sorted(shares, reverse=True)
