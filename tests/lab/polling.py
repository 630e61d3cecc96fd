"""Waiting for a lab appliance to show something: one poll loop for the suites
that read the REST API or the status."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 20.0,
             interval_s: float = 0.2) -> Any:
    """``probe()`` until it returns something true (returned); AssertionError
    naming ``what`` and the last value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s}s (last: {value!r})")
        time.sleep(interval_s)
