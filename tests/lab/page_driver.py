"""Drives the status page in headless Chromium, one command at a time.

Run inside the network namespace the page is reached from (``ip netns exec NS
python page_driver.py``): chromedriver and Chromium are its children, so they
live in that namespace too and talk to each other over its loopback. Reads one
JSON command a line on stdin and answers each with one JSON line on stdout
(``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``); the first line it
prints is ``{"ok": true, "ready": ...}`` once the browser runs, or why it
could not start. Commands (``op``):

* ``open`` ``url``: load a page (the HTTP cache is off, so every load is cold).
* ``token`` ``token``: type a token into the page's token box and submit it.
* ``wait`` ``css`` [``text``] [``has_class``] [``timeout``]: until the element
  exists, its text contains ``text`` and it has the class ``has_class``;
  answers its text and how long it took, or the last text seen.
* ``click`` ``css``; ``fill`` ``css`` ``value``; ``read`` ``css``: text, classes,
  whether displayed (``found`` false when absent).
* ``script`` ``js``: ``execute_script``'s result.
* ``timing``: navigation and resource timing of the page loaded last.
* ``screenshot`` ``path``: a PNG of the window.
* ``console``: the browser's console messages so far (errors of the page).
* ``quit``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
BROWSER_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update")

# Navigation and resource timing of the current page, in milliseconds from the
# navigation's start, with the page's own mark for "tables filled".
TIMING_JS = """
const nav = performance.getEntriesByType("navigation")[0];
const mark = performance.getEntriesByName("hpclb-first-render")[0];
const res = performance.getEntriesByType("resource").map((r) => ({
  name: r.name, initiator: r.initiatorType, duration_ms: r.duration,
  transfer_bytes: r.transferSize, encoded_bytes: r.encodedBodySize,
  decoded_bytes: r.decodedBodySize}));
return {
  url: location.href,
  navigation: nav && {response_end_ms: nav.responseEnd,
    dom_content_loaded_ms: nav.domContentLoadedEventEnd, load_event_end_ms: nav.loadEventEnd,
    transfer_bytes: nav.transferSize, encoded_bytes: nav.encodedBodySize,
    decoded_bytes: nav.decodedBodySize},
  first_render_ms: mark ? mark.startTime : null,
  resources: res,
};
"""


def _browser(user_data: str) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (*BROWSER_ARGS, f"--user-data-dir={user_data}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": True})
    return driver


class Commands:
    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.console: list[dict[str, Any]] = []

    def _find(self, css: str) -> Any:
        from selenium.webdriver.common.by import By

        found = self.driver.find_elements(By.CSS_SELECTOR, css)
        return found[0] if found else None

    def open(self, url: str) -> dict[str, Any]:
        self.driver.get(url)
        return {"title": self.driver.title}

    def token(self, token: str) -> dict[str, Any]:
        box = self._find("#token")
        if box is None:
            raise LookupError("no #token box on the page")
        box.clear()
        box.send_keys(token)
        self._find("#connect").click()
        return {}

    def read(self, css: str) -> dict[str, Any]:
        from selenium.common.exceptions import StaleElementReferenceException

        try:
            e = self._find(css)
            if e is None:
                return {"found": False}
            return {"found": True, "text": e.text, "classes": (e.get_attribute("class") or "")
                    .split(), "displayed": e.is_displayed()}
        except StaleElementReferenceException:  # replaced while read: as if not yet there
            return {"found": False}

    def wait(self, css: str, text: str | None = None, has_class: str | None = None,
             timeout: float = 10.0) -> dict[str, Any]:
        start = time.monotonic()
        last: dict[str, Any] = {"found": False}
        while True:
            last = self.read(css)
            if (last["found"] and (text is None or text in last["text"])
                    and (has_class is None or has_class in last["classes"])):
                return {**last, "waited_s": round(time.monotonic() - start, 3)}
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{css}: wanted text {text!r} class {has_class!r} within "
                                   f"{timeout}s; last seen {last}")
            time.sleep(0.1)

    def click(self, css: str) -> dict[str, Any]:
        e = self._find(css)
        if e is None:
            raise LookupError(f"nothing matches {css}")
        e.click()
        return {}

    def fill(self, css: str, value: str) -> dict[str, Any]:
        e = self._find(css)
        if e is None:
            raise LookupError(f"nothing matches {css}")
        e.clear()
        e.send_keys(value)
        return {}

    def script(self, js: str) -> dict[str, Any]:
        return {"result": self.driver.execute_script(js)}

    def screenshot(self, path: str) -> dict[str, Any]:
        return {"saved": self.driver.save_screenshot(path)}

    def timing(self) -> dict[str, Any]:
        return {"timing": self.driver.execute_script(TIMING_JS)}

    def console_(self) -> dict[str, Any]:
        self.console += self.driver.get_log("browser")
        return {"messages": self.console}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    if missing:
        print(json.dumps({"ok": False, "error": f"not installed: {', '.join(missing)}"}),
              flush=True)
        return 2
    # Selenium Manager would look for drivers on the network: the paths are given.
    os.environ.setdefault("SE_OFFLINE", "true")
    user_data = tempfile.mkdtemp(prefix="hpclb-page-")
    try:
        try:
            driver = _browser(user_data)
        except Exception as err:  # selenium's errors carry chromedriver's reason
            print(json.dumps({"ok": False, "error": f"cannot start chromium: {err}"}),
                  flush=True)
            return 2
        try:
            caps = driver.capabilities
            print(json.dumps({"ok": True, "ready": {
                "browser": caps.get("browserVersion"),
                "chromedriver": (caps.get("chrome") or {}).get("chromedriverVersion", "")
                .split(" ")[0]}}), flush=True)
            commands = Commands(driver)
            for line in sys.stdin:
                if not line.strip():
                    continue
                request = json.loads(line)
                op = request.pop("op")
                if op == "quit":
                    print(json.dumps({"ok": True}), flush=True)
                    break
                handler = getattr(commands, "console_" if op == "console" else op, None)
                try:
                    if handler is None or op.startswith("_"):
                        raise LookupError(f"unknown op {op!r}")
                    answer = {"ok": True, **handler(**request)}
                except Exception as err:  # one bad step is an answer, not the end
                    answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
                print(json.dumps(answer, default=str), flush=True)
        finally:
            driver.quit()
    finally:
        shutil.rmtree(user_data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
