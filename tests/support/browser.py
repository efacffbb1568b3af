"""A real headless Chromium for tests (Debian's ``chromium`` and ``chromium-driver``, installed by
scripts/bootstrap), driven by Selenium. A missing browser fails the test: it does not skip."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")


@contextlib.contextmanager
def chromium(profile: Path, width: int = 1500, height: int = 1400) -> Iterator:
    """A fresh headless Chromium on its own profile directory; always quit."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists() and not shutil.which(Path(path).name):
            pytest.fail(f"{path} is missing: scripts/bootstrap installs chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, predicate: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.1):
    """Poll ``predicate`` until it returns something true; fail with the page's text otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(every_s)
    text = driver.execute_script("return document.body.innerText")[:2000]
    raise AssertionError(f"not {what} after {timeout_s} s; the page reads:\n{text}")


def full_screenshot(driver, path: Path) -> Path:
    """The whole page, not only the window: the window is grown to the document's height first."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(driver.get_window_size()["width"], min(max(height + 120, 600), 6000))
    driver.save_screenshot(str(path))
    return path
