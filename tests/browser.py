"""Headless Chromium for the tests that look at pages as a person does (the HTML report, the
dashboard): Debian's `chromium` through its `chromedriver`, a fresh profile, nothing in the
background that would reach the network, console and network events logged; screenshots for people
to look at (never compared)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@contextmanager
def chromium(tmp_path: Path, downloads: Path | None = None) -> Iterator[Any]:
    """A driver; skipped where the browser is not installed (failed in CI, which installs it).
    `downloads`: where files the page saves go."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        message = "needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)  # .ci/run installs them: in CI a missing browser is a broken setup
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    if downloads is not None:
        downloads.mkdir(parents=True, exist_ok=True)
        options.add_experimental_option(
            "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
        )
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        if downloads is not None:
            driver.execute_cdp_cmd(
                "Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
            )
        yield driver
    finally:
        driver.quit()


def screenshot_dir(tmp_path: Path) -> Path:
    """OPFUSE_SCREENSHOT_DIR, or the test's tmp dir."""
    folder = Path(os.environ.get("OPFUSE_SCREENSHOT_DIR") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def console_problems(driver: Any) -> list[dict[str, Any]]:
    """The console messages of level warning or worse since the last call."""
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def requested_urls(driver: Any) -> list[str]:
    """Every URL the browser asked for since the last call (data: URLs are no request)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            url = message["params"]["request"]["url"]
            if not url.startswith("data:"):
                urls.append(url)
    return urls


def full_page_screenshot(driver: Any, shot: Path) -> None:
    """The whole page as a PNG at `shot` (the window grows to the page's height, up to 12000 px)."""
    driver.execute_script("window.scrollTo(0, 0)")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, min(int(height) + 40, 12000))
    assert driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    driver.set_window_size(1280, 900)
