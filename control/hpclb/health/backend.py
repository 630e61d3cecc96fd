"""Is a backend up? The control plane's verdict from its two witnesses.

* **Probes** (``hpclb.health``): rise/fall verdicts with flap damping. A pool
  without a probe has no probe verdict: its backends count as answering.
* **Heartbeats** of the node's agent: once an agent has been heard, missing
  ``missed`` of its announced intervals in a row takes the backend down until
  the next heartbeat. A backend whose agent was never heard is not held to it
  (static pools need no agent).

A heartbeat is judged by when it arrived at the receiver, and only over time
the appliance could hear: ``expire`` takes ``heard_since``, the monotonic time
since which the receiving side had no trouble of its own (a stalled loop, a
paused listener, files exhausted). An agent is late only if it missed
``missed`` intervals counted from the later of its last heartbeat and that
time; while the appliance itself cannot hear, an overdue backend is *unknown*
(kept as it is, shown in the status), never DOWN.

A backend is up when both say so. Every change is returned as a
:class:`Change`; ``controller.backends`` logs it, tells the weight tracker
(``WeightTracker.set_up``: fresh smoothing after a return) and decides from the
verdict: DOWN at weight 0 at once (its flows re-hash at their next packet), and
after a return a slow start from :meth:`BackendHealth.up_since`. Pure: time is
passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Change:
    backend: str
    up: bool
    reason: str
    time: float  # wall clock, as telemetry and the slow start (up_since) count time


@dataclass(slots=True)
class _Backend:
    probe_up: bool = True
    beat_at: float | None = None  # monotonic time of the last heartbeat
    beat_interval: float = 0.0
    beats_missed: bool = False
    up: bool = True
    up_since: float | None = None  # wall time of the last down -> up
    beats_unknown: bool = False  # overdue, but the appliance could not hear meanwhile


class BackendHealth:
    def __init__(self, missed: int = 3) -> None:
        self.missed = missed
        self._b: dict[str, _Backend] = {}

    def _get(self, name: str) -> _Backend:
        return self._b.setdefault(name, _Backend())

    def _settle(self, name: str, b: _Backend, reason: str, wall: float) -> Change | None:
        up = b.probe_up and not b.beats_missed
        if up == b.up:
            return None
        b.up = up
        if up:
            b.up_since = wall
        return Change(name, up, reason, wall)

    def probe(self, name: str, up: bool, reason: str, wall: float) -> Change | None:
        b = self._get(name)
        b.probe_up = up
        return self._settle(name, b, f"probe: {reason}", wall)

    def heartbeat(self, name: str, interval_s: float, mono: float, wall: float) -> Change | None:
        b = self._get(name)
        b.beat_at, b.beat_interval = mono, max(interval_s, 0.0)
        b.beats_unknown = False
        if not b.beats_missed:
            return None
        b.beats_missed = False
        return self._settle(name, b, "agent heard again", wall)

    def expire(self, mono: float, wall: float,
               heard_since: float | None = -math.inf) -> list[Change]:
        """Backends whose agent went quiet for ``missed`` intervals while the
        appliance could hear (since ``heard_since``; None: it cannot now)."""
        changes = []
        for name, b in self._b.items():
            if b.beat_at is None or b.beats_missed:
                continue
            limit = self.missed * b.beat_interval
            overdue = mono - b.beat_at > limit
            b.beats_unknown = overdue and (
                heard_since is None or mono - max(b.beat_at, heard_since) <= limit)
            if overdue and not b.beats_unknown:
                b.beats_missed = True
                change = self._settle(
                    name, b, f"agent missed {self.missed} heartbeats "
                    f"({mono - b.beat_at:.1f}s since the last, interval {b.beat_interval:g}s)",
                    wall)
                if change:
                    changes.append(change)
        return changes

    def forget(self, name: str) -> None:
        self._b.pop(name, None)

    def is_up(self, name: str) -> bool:
        b = self._b.get(name)
        return b is None or b.up

    def up_since(self, name: str) -> float | None:
        b = self._b.get(name)
        return b.up_since if b else None

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {name: {"up": b.up, "probe_up": b.probe_up, "beats_missed": b.beats_missed,
                       "beats_unknown": b.beats_unknown}
                for name, b in sorted(self._b.items())}
