"""A real Chromium (Debian's `chromium` and `chromium-driver`), driven by Selenium, for the console's tests.

Nothing is downloaded: the browser and its driver are the system's (`CHROMIUM`, `CHROMEDRIVER`). Each
browser gets a new, empty profile and the flags a machine without a network needs. Selenium blocks, so
every call runs on a worker thread while the console serves on the test's event loop; every wait is
bounded (`WebDriverWait`), none sleeps.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = os.environ.get("HAIL_GUARD_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("HAIL_GUARD_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
)
WAIT_SECONDS = 20.0
SCREENSHOTS_ENV = "HAIL_GUARD_CONSOLE_SCREENSHOTS"
"""A folder to also save each screenshot to (docs/, to refresh the pictures of docs/how-to/console.md)."""

_T = TypeVar("_T")


def missing_reason() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed (apt-get install chromium chromium-driver)"
    return None


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    profile = tempfile.mkdtemp(prefix="hail-guard-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Browser:
    """One Chromium, used from async tests (each call on a worker thread)."""

    def __init__(self, driver: webdriver.Chrome, shots: Path) -> None:
        self.driver, self.shots = driver, shots

    async def run(self, call: Callable[[], _T]) -> _T:
        return await anyio.to_thread.run_sync(call)

    async def open(self, url: str) -> None:
        await self.run(lambda: self.driver.get(url))

    async def fill(self, form: str, **fields: str) -> None:
        """Type into the named fields of the form matching the CSS selector `form`."""

        def type_in() -> None:
            scope = self.driver.find_element(By.CSS_SELECTOR, form)
            for name, value in fields.items():
                element = scope.find_element(By.NAME, name)
                if element.tag_name == "select":
                    element.find_element(By.CSS_SELECTOR, f'option[value="{value}"]').click()
                else:
                    element.clear()
                    element.send_keys(value)

        await self.run(type_in)

    async def click(self, css: str) -> None:
        await self.run(lambda: self.driver.find_element(By.CSS_SELECTOR, css).click())

    async def text(self, css: str = "body") -> str:
        return await self.run(lambda: self.driver.find_element(By.CSS_SELECTOR, css).text)

    async def source(self) -> str:
        return await self.run(lambda: self.driver.page_source)

    async def script(self, code: str, *args: Any) -> Any:
        return await self.run(lambda: self.driver.execute_script(code, *args))

    async def wait_until(self, ready: Callable[[webdriver.Chrome], Any], what: str) -> Any:
        waiting = WebDriverWait(self.driver, WAIT_SECONDS, ignored_exceptions=(StaleElementReferenceException,))
        return await self.run(lambda: waiting.until(ready, what))

    async def wait_for_text(self, text: str, css: str = "body") -> None:
        def shown(driver: webdriver.Chrome) -> bool:
            found: list[WebElement] = driver.find_elements(By.CSS_SELECTOR, css)
            return any(text in element.text for element in found)

        await self.wait_until(shown, f"{text!r} in {css}")

    async def screenshot(self, name: str) -> Path:
        """Saved with the test's files, and in $HAIL_GUARD_CONSOLE_SCREENSHOTS when set."""
        path = self.shots / f"console-{name}.png"
        await self.run(lambda: self.driver.save_screenshot(str(path)))
        if folder := os.environ.get(SCREENSHOTS_ENV):
            shutil.copyfile(path, Path(folder) / path.name)
        assert path.stat().st_size > 0
        return path
