"""An asyncio loop in a thread of its own, inside a network namespace.

The probes and the telemetry receiver are asyncio code serving a synchronous
controller. Each runs in such a thread: the thread enters the appliance's
network namespace first (a namespace is per thread, so probes leave from, and
agents connect to, where the data plane forwards), then runs its loop until it
is asked to stop. The controller's thread talks to it only through
:meth:`LoopThread.call` (which waits) and snapshots its owner publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import TypeVar

from hpclb.host.netns import enter_netns

T = TypeVar("T")


class LoopThread:
    """``start(setup, teardown)``: in a new thread, enter ``netns``, run a loop,
    await ``setup()`` and report its outcome to the caller of ``start`` (which
    re-raises an error of the namespace entry or of ``setup``, a bind for
    instance); then serve until :meth:`stop`, which awaits ``teardown()`` in
    the loop and joins the thread."""

    def __init__(self, name: str, netns: str | None = None) -> None:
        self.name = name
        #: Network namespace (name or /proc/PID/ns/net path) entered first.
        self.netns = netns
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started: Future[None] = Future()

    def start(self, setup: Callable[[], Awaitable[None]],
              teardown: Callable[[], Awaitable[None]], timeout: float = 10.0) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} thread already started")
        self._thread = threading.Thread(target=self._main, args=(setup, teardown),
                                        name=self.name, daemon=True)
        self._thread.start()
        self._started.result(timeout)

    def _main(self, setup: Callable[[], Awaitable[None]],
              teardown: Callable[[], Awaitable[None]]) -> None:
        if self.netns:
            try:
                enter_netns(self.netns)
            except OSError as err:
                self._started.set_exception(err)
                return

        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                await setup()
            except BaseException as err:
                self._started.set_exception(err)
                return
            self._started.set_result(None)
            try:
                await self._stop.wait()
            finally:
                await teardown()

        asyncio.run(serve())

    @property
    def running(self) -> bool:
        return self.loop is not None and self._started.done() \
            and self._started.exception() is None

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``fn`` in the loop (the owner's state is only touched there) and
        wait for its result."""
        if not self.running:
            raise RuntimeError(f"{self.name} thread not running")
        assert self.loop is not None

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop and join the thread; False if it did not end in time.
        Idempotent."""
        if self._thread is None:
            return True
        loop, stop = self.loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        self._thread = None
        return ended
