"""Timeouts for many concurrent operations at the cost of a few timers.

A probe's deadline is its start time plus its timeout, and the timeouts in use
are few (one per pool configuration), so the operations sharing a timeout expire
in the order they started: one FIFO per timeout value, one event-loop timer per
FIFO, armed for its head. With 10,000 probes in flight this replaces 10,000 timer
handles in the loop's heap (whose Python-level comparisons dominated the cost of
a probe) by a deque append each.

Entries are not removed when an operation finishes early; the owner's expiry
callback is still called at the deadline with the entry's two integer keys and
must check whether that operation is still live. The entries hold integers only,
not the operations: an entry outlives a fast probe by its whole timeout, and
objects that live that long reach the garbage collector's oldest generation and
trigger full collections (tens of ms at 10,000 targets) every few seconds;
tuples of numbers are untracked by the collector.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Expiries handled per timer callback before letting I/O in (a rack going away
#: times out thousands of probes at once).
_BATCH = 1024


def check_timeout(timeout: float) -> float:
    """``timeout`` if it is a positive finite number of seconds; else ValueError."""
    if not (isinstance(timeout, int | float) and timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"probe timeout {timeout!r} s: must be a positive number")
    return timeout


class _Fifo:
    __slots__ = ("handle", "queue")

    def __init__(self) -> None:
        self.queue: deque[tuple[float, int, int]] = deque()
        self.handle: asyncio.TimerHandle | None = None


class Deadlines:
    """Calls ``on_expire(a, b)`` ``timeout`` seconds (loop time) after ``add(timeout, a, b)``."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_expire: Callable[[int, int], object]) -> None:
        self._loop = loop
        self._on_expire = on_expire
        self._fifos: dict[float, _Fifo] = {}

    def add(self, timeout: float, a: int, b: int) -> None:
        check_timeout(timeout)  # a NaN deadline would never expire
        fifo = self._fifos.get(timeout)
        if fifo is None:
            fifo = self._fifos[timeout] = _Fifo()
        deadline = self._loop.time() + timeout
        fifo.queue.append((deadline, a, b))
        if fifo.handle is None:
            fifo.handle = self._loop.call_at(deadline, self._expire, fifo)

    def _expire(self, fifo: _Fifo) -> None:
        fifo.handle = None
        queue = fifo.queue
        now = self._loop.time()
        for _ in range(_BATCH):
            if not queue or queue[0][0] > now:
                break
            _, a, b = queue.popleft()
            try:
                self._on_expire(a, b)
            except Exception:  # one broken expiry must not strand the others
                log.exception("expiry callback failed")
        if queue:
            fifo.handle = self._loop.call_at(queue[0][0], self._expire, fifo)

    def __len__(self) -> int:
        return sum(len(f.queue) for f in self._fifos.values())

    def close(self) -> None:
        """Drop every pending expiry without calling it."""
        for fifo in self._fifos.values():
            if fifo.handle is not None:
                fifo.handle.cancel()
        self._fifos.clear()
