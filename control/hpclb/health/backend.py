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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


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

    # --- checkpoint (hpclb.controller.statefile) -------------------------------

    def to_state(self) -> dict[str, Any]:
        """The verdicts as JSON-able data. A heartbeat's monotonic time means
        nothing to another process: only whether the agent was heard is kept."""
        return {name: {"probe_up": b.probe_up, "beats_missed": b.beats_missed, "up": b.up,
                       "up_since": b.up_since, "beat_interval": b.beat_interval,
                       "heard": b.beat_at is not None}
                for name, b in sorted(self._b.items())}

    def from_state(self, state: object, mono: float,
                   keep: Callable[[str], bool] = lambda name: True,
                   grace_s: float = 0.0) -> None:
        """Replace the verdicts with ``state`` (``to_state``'s), for the backends
        ``keep`` accepts. Checked whole first: ValueError naming the bad field,
        and nothing changed. An agent heard before must be heard again within
        ``grace_s`` or its ``missed`` intervals, whichever is longer, from
        ``mono`` (now), or it goes down: a restart is the appliance's own doing,
        and its agents need a moment to reconnect to a new receiver."""
        if not isinstance(state, Mapping):
            raise ValueError("health: expected a mapping of backends")
        restored: dict[str, _Backend] = {}
        for name, raw in state.items():
            where = f"health.{name}"
            if not isinstance(raw, Mapping):
                raise ValueError(f"{where}: expected a mapping")
            probe_up = _flag(raw, "probe_up", where)
            missed = _flag(raw, "beats_missed", where)
            up = _flag(raw, "up", where)
            if up != (probe_up and not missed):
                raise ValueError(f"{where}.up: {up} contradicts probe_up={probe_up}, "
                                 f"beats_missed={missed}")
            up_since = raw.get("up_since")
            if up_since is not None and not _finite(up_since):
                raise ValueError(f"{where}.up_since: expected a finite number or null")
            interval = raw.get("beat_interval")
            if not _finite(interval) or interval < 0:
                raise ValueError(f"{where}.beat_interval: expected a finite number >= 0")
            heard = _flag(raw, "heard", where)
            # As if last heard so late that the full limit ends at mono + grace.
            beat_at = mono + max(grace_s - self.missed * float(interval), 0.0)
            if keep(str(name)):
                restored[str(name)] = _Backend(
                    probe_up=probe_up, beat_at=beat_at if heard else None,
                    beat_interval=float(interval), beats_missed=missed, up=up,
                    up_since=None if up_since is None else float(up_since))
        self._b = restored


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _flag(raw: Mapping[str, object], key: str, where: str) -> bool:
    value = raw.get(key)
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key}: expected true or false, got {value!r}")
    return value
