"""When each target is probed: per-target intervals, spread phases, no drift.

Every target has a *phase* in ``[0, interval)`` and is due at
``epoch + phase + k·interval`` for k = 0, 1, 2, ...: the due times are computed
from k, never by adding intervals to the time a probe actually went out, so a late
wake-up delays one probe and not all the following ones. A slot reached a whole
interval (or more) late is skipped and counted in ``missed``: the target's next
slot is due as well, and one probe serves, rather than a burst to catch up.

Phases are handed out so that targets of one interval are evenly spread: targets
added together (say, a pool at start-up: all ``add`` calls made before the loop
runs again) split the largest gaps between the phases already in use into equal
parts; on an empty scheduler that is exactly ``i·interval/N``. Existing targets
keep their phases, so adding or removing one never moves the others.

Targets of one interval form a group whose due times come round in phase
order, so a group needs one loop timer and a cursor, not a timer per target: at
10,000 targets the loop's timer heap (compared in Python) would cost more than
the probes themselves.

One probe per target is in flight at a time. A probe still unanswered when its
target is due again counts as a timeout (its timeout is at most the interval, so
it had its chance) and is cancelled; results therefore arrive in order.

The scheduler also watches its own loop (:class:`LoopStalls`): a probe that timed
out while the loop was not looking (the process starved, a long callback, the
GIL held by another thread) says nothing about its target, and
:func:`stall_during` tells the checker how long the loop was blind while a probe
was owed attention.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from hpclb.config.probes import MIN_INTERVAL_S

from .result import TIMEOUT, ProbeResult

log = logging.getLogger(__name__)

ProbeFn = Callable[[], Awaitable[ProbeResult]]


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """A probe's result and its timing, in event-loop time (seconds, monotonic)."""

    name: str
    result: ProbeResult
    scheduled: float  # when it was due
    started: float  # when it was launched (>= scheduled)
    finished: float  # when its result was taken


#: How often the loop's punctuality is sampled. A stall is measured to within
#: this much (the sample sees how late it ran, not when the stall began), which
#: is small next to the shortest sensible probe timeout; 50 trivial callbacks a
#: second cost nothing next to the probes.
WATCH_PERIOD_S = 0.02
#: Lateness below this is ordinary jitter and not remembered (it is far below
#: half of any timeout that makes sense on a 0.1 s interval).
STALL_MIN_S = 0.01
#: Stalls remembered. Even a loop late at every sample keeps the last 20 s, longer
#: than the default 2 s timeout; an older stall that reached a probe's deadline
#: still shows as that probe's late result (see stall_during).
STALL_MEMORY = 1024


class LoopStalls:
    """Stretches of loop time during which the loop ran none of its callbacks
    (so read no socket either), oldest first."""

    __slots__ = ("_stalls", "count")

    def __init__(self, memory: int = STALL_MEMORY) -> None:
        self._stalls: deque[tuple[float, float]] = deque(maxlen=memory)
        #: Stalls recorded in all (the deque keeps the latest only).
        self.count = 0

    def record(self, start: float, end: float) -> None:
        """The loop did nothing from ``start`` to ``end`` (call in time order)."""
        if end - start >= STALL_MIN_S:
            self._stalls.append((start, end))
            self.count += 1

    def longest(self, t0: float, t1: float) -> float:
        """The longest part of one stall that lies within ``[t0, t1]``."""
        longest = 0.0
        for start, end in reversed(self._stalls):  # newest first: usually few to look at
            if end < t0:
                break
            longest = max(longest, min(end, t1) - max(start, t0))
        return longest


def stall_during(outcome: ProbeOutcome, timeout: float, stalls: LoopStalls) -> float:
    """The longest time the loop was not looking while ``outcome``'s probe was owed
    attention, from its slot to its result.

    Three witnesses, each a stretch of blindness: the launch (how late after its
    slot the probe went out), the result (how long after the probe's own deadline
    it was taken: a built-in probe resolves itself at its deadline, so a result
    later than that was waiting for the loop, or for a bug of ours) and the
    loop-watch samples between the two.
    """
    launch = outcome.started - outcome.scheduled
    verdict = outcome.finished - (outcome.started + timeout)
    return max(launch, verdict, stalls.longest(outcome.scheduled, outcome.finished))


def place_phases(existing: Sequence[float], period: float, count: int) -> list[float]:
    """``count`` new phases in ``[0, period)``, spread into the gaps of ``existing``.

    Each new phase goes to the gap whose sub-gaps would be longest, and the
    phases a gap receives divide it evenly. Without existing phases the result is
    ``[i·period/count]``. O((len(existing) + count) · log len(existing)).
    """
    if count <= 0:
        return []
    if not existing:
        return [i * period / count for i in range(count)]
    points = sorted(p % period for p in existing)
    gaps = [(points[i], points[i + 1] - points[i]) for i in range(len(points) - 1)]
    gaps.append((points[-1], points[0] + period - points[-1]))  # the one across 0
    given = [0] * len(gaps)
    # Max-heap on the length each gap's sub-gaps would have with one more phase.
    heap = [(-length, i) for i, (_, length) in enumerate(gaps)]
    heapq.heapify(heap)
    for _ in range(count):
        _, i = heapq.heappop(heap)
        given[i] += 1
        heapq.heappush(heap, (-gaps[i][1] / (given[i] + 1), i))
    phases: list[float] = []
    for (start, length), n in zip(gaps, given, strict=True):
        phases.extend((start + j * length / (n + 1)) % period for j in range(1, n + 1))
    return phases


class _Entry:
    """One target's schedule."""

    __slots__ = ("done_cb", "group", "inflight", "name", "phase", "probe", "scheduled",
                 "started")

    def __init__(self, name: str, probe: ProbeFn) -> None:
        self.name = name
        self.probe = probe
        self.phase = 0.0
        self.group: _Group | None = None  # None until placed
        self.inflight: asyncio.Future[ProbeResult] | None = None
        self.scheduled = 0.0
        self.started = 0.0
        self.done_cb: Callable[[asyncio.Future[ProbeResult]], None] | None = None


class _Group:
    """The targets of one interval, in phase order, and where the round is.

    The cursor (``cycle``, ``index``) is the next slot to run: ``entries[index]``
    at ``epoch + phase + cycle·interval``. Entries before ``index`` have had their
    slot of this cycle.
    """

    __slots__ = ("cycle", "entries", "handle", "index", "interval", "phases")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.entries: list[_Entry] = []
        self.phases: list[float] = []  # entries' phases, for bisect
        self.cycle = 0
        self.index = 0
        self.handle: asyncio.TimerHandle | None = None

    def insert(self, entry: _Entry) -> None:
        pos = bisect.bisect_right(self.phases, entry.phase)
        self.phases.insert(pos, entry.phase)
        self.entries.insert(pos, entry)
        if pos < self.index:
            self.index += 1  # its slot of this cycle is behind the cursor: next cycle

    def delete(self, entry: _Entry) -> None:
        pos = bisect.bisect_left(self.phases, entry.phase)
        while self.entries[pos] is not entry:
            pos += 1
        del self.phases[pos]
        del self.entries[pos]
        if pos < self.index:
            self.index -= 1
        if self.index >= len(self.entries):
            self.index = 0
            self.cycle += 1

    def advance(self) -> None:
        self.index += 1
        if self.index >= len(self.entries):
            self.index = 0
            self.cycle += 1


def check_interval(interval_s: float) -> float:
    if not (math.isfinite(interval_s) and interval_s >= MIN_INTERVAL_S):
        raise ValueError(f"probe interval {interval_s!r} s: must be at least "
                         f"{MIN_INTERVAL_S} s")
    return float(interval_s)


#: Slots run per timer callback before letting I/O (the replies) in.
_BATCH = 256


class ProbeScheduler:
    """Runs each target's probe function on its schedule; reports every outcome.

    Create it inside the event loop; ``add``/``update``/``remove`` from that loop
    only. ``on_outcome`` is called synchronously for every result; an exception
    it raises is logged and counted, and probing goes on.
    """

    def __init__(self, on_outcome: Callable[[ProbeOutcome], object]) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_outcome = on_outcome
        self._epoch = self._loop.time()
        self._entries: dict[str, _Entry] = {}
        self._groups: dict[float, _Group] = {}
        self._unplaced: dict[str, tuple[_Entry, float]] = {}
        self._placing: asyncio.Handle | None = None
        self._closed = False
        #: Slots skipped because the loop woke up a whole interval late for them.
        self.missed = 0
        #: Probe functions that raised instead of returning a result (counted as failures).
        self.probe_errors = 0
        #: on_outcome calls that raised.
        self.callback_errors = 0
        #: When the loop was not looking (see stall_during).
        self.stalls = LoopStalls()
        self._watch_due = self._loop.time() + WATCH_PERIOD_S
        self._watch = self._loop.call_at(self._watch_due, self._sample)

    # -- targets --

    def add(self, name: str, interval_s: float, probe: ProbeFn) -> None:
        """Start probing ``name`` every ``interval_s`` seconds with ``probe()``.
        Its first probe is within one interval."""
        if self._closed:
            raise RuntimeError("scheduler is closed")
        if name in self._entries:
            raise ValueError(f"probe target {name!r} already exists")
        interval = check_interval(interval_s)
        entry = _Entry(name, probe)
        entry.done_cb = lambda fut, e=entry: self._done(e, fut)
        self._entries[name] = entry
        self._defer_placement(entry, interval)

    def update(self, name: str, interval_s: float, probe: ProbeFn) -> None:
        """Change a target's probe and/or interval. Same interval: the schedule
        stays, the new probe runs from the next slot. New interval: a new phase."""
        entry = self._entries[name]
        interval = check_interval(interval_s)
        entry.probe = probe
        current = entry.group.interval if entry.group is not None \
            else self._unplaced[name][1]
        if interval != current:
            self._unschedule(entry)
            self._defer_placement(entry, interval)

    def remove(self, name: str) -> None:
        """Stop probing ``name``; its probe in flight is cancelled, not reported."""
        entry = self._entries.pop(name)
        self._unschedule(entry)
        self._cancel_inflight(entry)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def phase(self, name: str) -> float | None:
        """The target's phase (seconds into its interval), None until placed."""
        entry = self._entries[name]
        return entry.phase if entry.group is not None else None

    def close(self) -> None:
        self._closed = True
        self._watch.cancel()
        if self._placing is not None:
            self._placing.cancel()
        for group in self._groups.values():
            if group.handle is not None:
                group.handle.cancel()
        for entry in self._entries.values():
            self._cancel_inflight(entry)
        self._groups.clear()
        self._entries.clear()
        self._unplaced.clear()

    def _unschedule(self, entry: _Entry) -> None:
        self._unplaced.pop(entry.name, None)
        group, entry.group = entry.group, None
        if group is None:
            return
        group.delete(entry)
        if not group.entries:
            if group.handle is not None:
                group.handle.cancel()
            del self._groups[group.interval]

    def _cancel_inflight(self, entry: _Entry) -> None:
        fut, entry.inflight = entry.inflight, None
        if fut is not None and entry.done_cb is not None:
            fut.remove_done_callback(entry.done_cb)
            fut.cancel()

    # -- placement --

    def _defer_placement(self, entry: _Entry, interval: float) -> None:
        # Deferred to the next loop turn so that a batch of adds is placed as one
        # and spread evenly, instead of each add seeing only the ones before it.
        self._unplaced[entry.name] = (entry, interval)
        if self._placing is None:
            self._placing = self._loop.call_soon(self._place)

    def _place(self) -> None:
        self._placing = None
        by_interval: dict[float, list[_Entry]] = {}
        for entry, interval in self._unplaced.values():
            by_interval.setdefault(interval, []).append(entry)
        self._unplaced.clear()
        now = self._loop.time()
        for interval, new in by_interval.items():
            group = self._groups.get(interval)
            fresh = group is None
            if group is None:
                group = self._groups[interval] = _Group(interval)
            for entry, phase in zip(new, place_phases(group.phases, interval, len(new)),
                                    strict=True):
                entry.phase = phase
                entry.group = group
                group.insert(entry)
            if fresh:
                # Start the round at the first slot at or after now.
                offset = (now - self._epoch) % interval
                group.cycle = math.floor((now - self._epoch) / interval)
                group.index = bisect.bisect_left(group.phases, offset)
                if group.index >= len(group.entries):
                    group.index = 0
                    group.cycle += 1
            self._arm(group)

    def _arm(self, group: _Group) -> None:
        if group.handle is not None:
            group.handle.cancel()
        entry = group.entries[group.index]
        due = self._epoch + entry.phase + group.cycle * group.interval
        group.handle = self._loop.call_at(due, self._tick, group)

    # -- running --

    def _sample(self) -> None:
        # A timer that ran late by L shows that the loop ran nothing, so read no
        # socket, for at least the L before now.
        now = self._loop.time()
        self.stalls.record(self._watch_due, now)
        # The next sample one period from the due time, or from now when more than
        # a period late: never a burst of samples to catch up.
        self._watch_due = max(self._watch_due + WATCH_PERIOD_S, now)
        self._watch = self._loop.call_at(self._watch_due, self._sample)

    def _tick(self, group: _Group) -> None:
        group.handle = None
        now = self._loop.time()
        interval = group.interval
        base = self._epoch + group.cycle * interval
        for _ in range(_BATCH):
            if not group.entries:  # an outcome handler removed them all
                break
            entry = group.entries[group.index]
            due = base + entry.phase
            if due > now:
                break
            # Move the cursor first: _fire may report an outcome whose handler
            # adds or removes targets, and the group keeps the cursor right.
            group.advance()
            base = self._epoch + group.cycle * interval
            if now - due >= interval:
                # A whole interval late: this target's next slot is due as well;
                # skip this one rather than probe twice in a row.
                self.missed += 1
            else:
                self._fire(entry, due, now)
        if self._groups.get(interval) is group and group.handle is None and group.entries:
            self._arm(group)

    def _fire(self, entry: _Entry, due: float, now: float) -> None:
        old = entry.inflight
        if old is not None:
            # The previous probe's outcome must be reported before the next probe
            # starts, so that results stay in order. Done but not yet reported (its
            # callback is queued behind this timer): report it now. Still
            # unanswered when due again: a timeout (its timeout is at most the
            # interval, so it had its chance).
            assert entry.done_cb is not None
            old.remove_done_callback(entry.done_cb)
            if old.done():
                self._done(entry, old)
            else:
                old.cancel()
                entry.inflight = None
                self._report(entry, TIMEOUT, now)
            if entry.group is None:  # the report's handler removed or moved it
                return
        entry.scheduled = due
        entry.started = now
        try:
            fut = asyncio.ensure_future(entry.probe())
        except Exception as exc:  # a bug in a probe must not stop the others
            self.probe_errors += 1
            log.exception("probe of %s failed to start", entry.name)
            # Our code broke, not the target: unknown.
            self._report(entry, ProbeResult.local_error(f"probe error: {exc!r}",
                                                        "probe_error"), now)
            return
        entry.inflight = fut
        assert entry.done_cb is not None
        fut.add_done_callback(entry.done_cb)

    def _done(self, entry: _Entry, fut: asyncio.Future[ProbeResult]) -> None:
        if entry.inflight is not fut:
            return
        entry.inflight = None
        if fut.cancelled():
            # Cancelled by someone else (loop shutdown): nothing learnt about the target.
            result = ProbeResult.local_error("probe cancelled", "closed")
        elif (exc := fut.exception()) is not None:
            self.probe_errors += 1
            log.error("probe of %s raised %r", entry.name, exc)
            result = ProbeResult.local_error(f"probe error: {exc!r}", "probe_error")
        else:
            result = fut.result()
        self._report(entry, result, self._loop.time())

    def _report(self, entry: _Entry, result: ProbeResult, now: float) -> None:
        try:
            self._on_outcome(ProbeOutcome(entry.name, result, entry.scheduled,
                                          entry.started, now))
        except Exception:
            self.callback_errors += 1
            log.exception("probe outcome handler failed for %s", entry.name)
