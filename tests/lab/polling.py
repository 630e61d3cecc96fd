"""Waiting for a lab appliance to show something: one poll loop for the suites
that read the REST API or the status."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Self


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 20.0,
             interval_s: float = 0.2, explain: Callable[[], str] | None = None) -> Any:
    """``probe()`` until it returns something true (returned); AssertionError
    naming ``what`` and the last value after ``timeout_s``, with what
    ``explain()`` says (logs, tables) appended."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s}s (last: {value!r})"
                                 + (f"\n{explain()}" if explain else ""))
        time.sleep(interval_s)


def held_at(what: str, probe: Callable[[], Any], timeout_s: float, interval_s: float,
            explain: Callable[[], str] | None = None,
            clock: Callable[[], float] = time.monotonic) -> float:
    """As :func:`wait_for`, returning ``clock()`` at the first poll where
    ``probe()`` held (within ``interval_s`` of the moment): for suites that
    time a change (figures, never asserted)."""
    wait_for(what, probe, timeout_s, interval_s, explain)
    return clock()


class Watcher:
    """Calls :meth:`look` every ``interval_s`` in a thread between ``with``'s
    enter and exit: for what must be watched while the test does something
    else (a route that may leave, rings that may change)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def look(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.look()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
