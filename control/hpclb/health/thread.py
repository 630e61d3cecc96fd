"""The health checker (hpclb.health, asyncio) in its own thread, for the
synchronous controller.

The thread enters the appliance's network namespace first, so the probes
leave from where the data plane forwards (the lab's appliance namespace; on a
gateway host, the host's own). Transitions and the latest round-trip times
reach the controller through a queue and a dict it only reads; targets are
changed with :meth:`ProbeThread.sync`, which runs in the checker's loop.

Everything else the controller reads (counters, per-backend views, the alarm)
comes from :meth:`ProbeThread.snapshot`, a dict the probe loop rebuilds every
SNAPSHOT_PERIOD_S and right after a transition, and the controller reads without
waiting: a stalled probe loop or a starved process must not stall the status
writer too (the snapshot's ``at`` tells how old it is).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from hpclb.config.probes import ProbeConfig
from hpclb.health import HealthChecker, ProbeOutcome, Transition
from hpclb.host.loop_thread import LoopThread

log = logging.getLogger(__name__)

Targets = dict[str, tuple[str, ProbeConfig]]  # backend name -> (address, probe)

#: How often the probe loop rebuilds the snapshot the controller reads.
SNAPSHOT_PERIOD_S = 0.5
#: After a change, the snapshot is rebuilt at once, but not more often than this:
#: a rack going down is transitions in loop turn after loop turn.
SNAPSHOT_MIN_GAP_S = 0.05


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """A backend's probe verdict changed (rise/fall, damping)."""

    transition: Transition




class ProbeThread:
    def __init__(self, events: queue.Queue[Any], wake: threading.Event,
                 netns: str | None = None) -> None:
        self.events = events
        self.wake = wake
        self.netns = netns
        #: name -> last round trip in ms (None after a failed probe; an unknown
        #: result leaves it as it was). Written in the checker's thread one key at
        #: a time, read by the controller.
        self.rtts: dict[str, float | None] = {}
        self._thread = LoopThread("hpclb-probes", netns)
        self._checker: HealthChecker | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._targets: Targets = {}
        # Replaced whole, never changed in place: a reader holding the old one
        # keeps a consistent view.
        self._snapshot: dict[str, Any] = self._empty_snapshot()
        self._refresh_soon: asyncio.TimerHandle | None = None
        self._refreshed = -math.inf  # when the snapshot was last rebuilt

    @staticmethod
    def _empty_snapshot() -> dict[str, Any]:
        return {"stats": {}, "backends": {}, "alarm": None, "at": time.monotonic()}

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start(self._setup, self._teardown, timeout)

    async def _setup(self) -> None:
        self._checker = HealthChecker(self._on_transition, on_result=self._on_result)
        self._refresh()
        self._refresher = asyncio.create_task(self._refresh_every(SNAPSHOT_PERIOD_S))

    async def _teardown(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self._checker is not None:
            self._checker.close()

    async def _refresh_every(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                self._refresh()
            except Exception:  # a report is not worth stopping the probes
                log.exception("probe snapshot failed")

    def _refresh(self) -> None:
        if self._refresh_soon is not None:  # this one serves for it too
            self._refresh_soon.cancel()
            self._refresh_soon = None
        checker = self._checker
        assert checker is not None
        now = time.monotonic()  # the checker's clock
        self._snapshot = {
            "stats": checker.stats(),
            "backends": checker.views(),
            "alarm": checker.alarm(now),
            "at": now,
        }
        self._refreshed = now

    def _refresh_after_change(self) -> None:
        # Coalesced: a rack going down is thousands of transitions, and one
        # snapshot after a batch of them serves.
        loop = self._thread.loop
        if self._refresh_soon is None and loop is not None:
            delay = max(0.0, self._refreshed + SNAPSHOT_MIN_GAP_S - time.monotonic())
            self._refresh_soon = loop.call_later(delay, self._refresh)

    def _on_transition(self, t: Transition) -> None:
        self.events.put(ProbeVerdict(t))
        self.wake.set()
        self._refresh_after_change()

    def _on_result(self, outcome: ProbeOutcome) -> None:
        if not outcome.result.local:  # an unknown result says nothing about the RTT
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
        self._refresh_after_change()

    def sync(self, targets: Targets, timeout: float = 10.0) -> None:
        """Probe exactly these backends (added, updated, removed as needed)."""
        self._thread.call(lambda: self._apply(targets), timeout)

    def is_up(self, name: str) -> bool:
        checker = self._checker
        return checker is None or name not in self._targets or checker.is_up(name)

    def snapshot(self) -> dict[str, Any]:
        """The probes' latest state, without waiting for the probe loop.

        Keys: ``stats`` (HealthChecker.stats()), ``backends`` ({name: {"up",
        "raw_up", "unknown" (the last result was unknown), "suppressed", "penalty",
        "release_at" (wall clock, None unless suppressed), "last_reason", "rtt_ms",
        "failures", "successes"}}), ``alarm`` (HealthChecker.alarm(): a sentence or
        None) and ``at`` (time.monotonic() when it was taken). Do not modify it.
        """
        return self._snapshot

    def stats(self, timeout: float = 5.0) -> dict[str, int]:
        """The checker's counters, from the snapshot (``timeout`` is no longer used:
        nothing is waited for)."""
        stats: dict[str, int] = self._snapshot["stats"]
        return stats

    def stop(self, timeout: float = 10.0) -> None:
        self._thread.stop(timeout)
