"""`ckptless report --html`: the page renders in headless Chromium without console errors and shows the plot.

Why a real browser: the page is hand-written SVG and CSS; only a browser
tells whether it loads cleanly and whether the plot has a size. The
screenshot is kept (``$CKPTLESS_TEST_ARTIFACTS``, default
``tests/artifacts/``, git-ignored) for a human to look at. Chromium comes
from Debian (``make browser``); when it is missing this test FAILS with the
command to install it, it never skips.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptless.cli import main

from ..harness.repo import REPO
from ..harness.report_fixtures import write_run

CHROMIUM = os.environ.get("CKPTLESS_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CKPTLESS_CHROMEDRIVER", "/usr/bin/chromedriver")
ARTIFACTS = Path(os.environ.get("CKPTLESS_TEST_ARTIFACTS", REPO / "tests" / "artifacts"))
# A closed network makes a default Chromium log errors (component updates, sync, QUIC probes).
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"headless Chromium is required and missing ({', '.join(missing)}): run `make browser` "
                    "(apt-get install -y --no-install-recommends chromium chromium-driver)", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is required: pip install -e '.[test]'", pytrace=False)
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path / 'profile'}")  # a fresh profile every run
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _render(driver: object, page: Path, shot: Path) -> dict[str, object]:
    from selenium.webdriver.common.by import By

    d: object = driver
    d.set_window_size(1280, 900)  # type: ignore[attr-defined]
    d.get(page.as_uri())  # type: ignore[attr-defined]
    plot = d.find_element(By.ID, "timeline")  # type: ignore[attr-defined]
    info: dict[str, object] = {
        "size": plot.size,
        "phases": len(d.find_elements(By.CSS_SELECTOR, "#timeline rect.phase")),  # type: ignore[attr-defined]
        "lines": len(d.find_elements(By.CSS_SELECTOR, "#timeline polyline.steps")),  # type: ignore[attr-defined]
        "breakdown": d.find_element(By.ID, "breakdown").size,  # type: ignore[attr-defined]
        "title": d.title,  # type: ignore[attr-defined]
        "text": d.find_element(By.TAG_NAME, "body").text,  # type: ignore[attr-defined]
    }
    height = d.execute_script("return document.documentElement.scrollHeight")  # type: ignore[attr-defined]
    d.set_window_size(1280, int(height) + 40)  # type: ignore[attr-defined]
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert d.save_screenshot(str(shot)), f"could not save {shot}"  # type: ignore[attr-defined]
    info["errors"] = [e for e in d.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")]  # type: ignore[attr-defined]
    return info


def _check(info: dict[str, object], shot: Path) -> None:
    assert info["errors"] == [], f"console errors: {info['errors']}"
    size = info["size"]
    assert isinstance(size, dict) and size["width"] > 500 and size["height"] > 200, size
    breakdown = info["breakdown"]
    assert isinstance(breakdown, dict) and breakdown["width"] > 500 and breakdown["height"] > 100
    assert shot.stat().st_size > 20_000  # a real picture, not a blank page
    assert "ckptless report" in str(info["title"])


def test_html_report_renders_in_headless_chromium(browser: object, tmp_path: Path) -> None:
    gdir = write_run(tmp_path / "run" / "goodput")
    page = tmp_path / "report.html"
    assert main(["report", str(gdir.parent), "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    # self-contained: nothing fetched (no http(s) URLs in src/href, no script)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text) and "<script" not in text
    shot = ARTIFACTS / "report_html.png"
    info = _render(browser, page, shot)
    _check(info, shot)
    assert info["phases"] >= 5 and info["lines"] >= 4  # detection..first step + re-protection; a line per rank
    body = str(info["text"])
    assert "kill → first step" in body and "1.82 s" in body and "ESTIMATE" in body


def test_html_report_of_an_old_ledger_renders(browser: object, tmp_path: Path) -> None:
    """Ledgers written before t_wall (and the real kill-worker run, when present) render too."""
    gdir = write_run(tmp_path / "old" / "goodput", wall=False, with_new_kinds=False)
    real = Path(os.environ.get("CKPTLESS_REPORT_RUN", "/tmp/report_run/kill-worker"))
    src = real if (real / "goodput").is_dir() else gdir.parent
    page = tmp_path / "old.html"
    assert main(["report", str(src), "--html", str(page)]) == 0
    shot = ARTIFACTS / ("report_html_real.png" if src == real else "report_html_old.png")
    info = _render(browser, page, shot)
    _check(info, shot)
    assert "monotonic" in str(info["text"])
    shutil.copy(page, ARTIFACTS / (shot.stem + ".html"))
