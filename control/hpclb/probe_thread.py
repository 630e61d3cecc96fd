"""The health checker (hpclb.probes, asyncio) in its own thread, for the
synchronous controller.

The thread enters the appliance's network namespace first, so the probes
leave from where the data plane forwards (the lab's appliance namespace; on a
gateway host, the host's own). Transitions and the latest round-trip times
reach the controller through a queue and a dict it only reads; targets are
changed with :meth:`ProbeThread.sync`, which runs in the checker's loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any

from hpclb.netns import enter_netns
from hpclb.probes import HealthChecker, ProbeConfig, ProbeOutcome, Transition

log = logging.getLogger("hpclb.probes")

Targets = dict[str, tuple[str, ProbeConfig]]  # backend name -> (address, probe)


class ProbeThread:
    def __init__(self, events: queue.Queue[Any], wake: threading.Event,
                 netns: str | None = None) -> None:
        self.events = events
        self.wake = wake
        self.netns = netns
        #: name -> last round trip in ms (None after a failed probe). Written in
        #: the checker's thread one key at a time, read by the controller.
        self.rtts: dict[str, float | None] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._checker: HealthChecker | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started: Future[None] = Future()
        self._targets: Targets = {}

    def start(self, timeout: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._main, name="hpclb-probes", daemon=True)
        self._thread.start()
        self._started.result(timeout)

    def _main(self) -> None:
        try:
            if self.netns:
                enter_netns(self.netns)
        except OSError as err:
            self._started.set_exception(err)
            return
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._checker = HealthChecker(self._on_transition, on_result=self._on_result)
        self._started.set_result(None)
        try:
            await self._stop.wait()
        finally:
            self._checker.close()

    def _on_transition(self, t: Transition) -> None:
        self.events.put(("probe", t))
        self.wake.set()

    def _on_result(self, outcome: ProbeOutcome) -> None:
        self.rtts[outcome.name] = outcome.result.rtt_ms

    def _apply(self, targets: Targets) -> None:
        checker = self._checker
        assert checker is not None
        for name in [n for n in self._targets if n not in targets]:
            checker.remove(name)
            self.rtts.pop(name, None)
        for name, (address, config) in targets.items():
            try:
                if name not in self._targets:
                    checker.add(name, address, config)
                elif self._targets[name] != (address, config):
                    checker.update(name, address, config)
            except Exception as err:  # one bad target must not stop the others
                log.error("cannot probe backend %s (%s): %s", name, address, err)
                continue
        self._targets = dict(targets)

    def sync(self, targets: Targets, timeout: float = 10.0) -> None:
        """Probe exactly these backends (added, updated, removed as needed)."""
        if self._loop is None:
            raise RuntimeError("probe thread not running")

        async def call() -> None:
            self._apply(targets)

        asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout)

    def is_up(self, name: str) -> bool:
        checker = self._checker
        return checker is None or name not in self._targets or checker.is_up(name)

    def stats(self, timeout: float = 5.0) -> dict[str, int]:
        if self._loop is None or self._checker is None:
            return {}
        checker = self._checker

        async def call() -> dict[str, int]:
            return checker.stats()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass
        self._thread.join(timeout)
        self._thread = None
