"""The probe scheduler: even phases, drift-free slots, skipped slots, runtime changes.

Runs on the real event loop with 0.1-0.2 s intervals. Due times are computed, so
they are asserted exactly (to float rounding); launch times depend on the machine,
so only their order (never before their slot) is asserted.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpclb.health import ProbeOutcome, ProbeResult, ProbeScheduler, place_phases

WAIT = 10.0
EPS = 1e-6


def ok_now() -> asyncio.Future[ProbeResult]:
    fut: asyncio.Future[ProbeResult] = asyncio.get_running_loop().create_future()
    fut.set_result(ProbeResult(True, 0.1, "ok"))
    return fut


class Log:
    def __init__(self) -> None:
        self.by_name: dict[str, list[ProbeOutcome]] = defaultdict(list)

    def __call__(self, o: ProbeOutcome) -> None:
        self.by_name[o.name].append(o)

    def count(self, name: str) -> int:
        return len(self.by_name[name])


def phase_of(s: ProbeScheduler, name: str) -> float:
    phase = s.phase(name)
    assert phase is not None, f"{name} not placed yet"
    return phase


async def until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not predicate():
            await asyncio.sleep(0.01)


def assert_on_grid(outcomes: list[ProbeOutcome], interval: float) -> None:
    """Every slot is the first one plus a whole number of intervals, in order, and
    no probe is launched before its slot."""
    first = outcomes[0].scheduled
    previous = -1
    for o in outcomes:
        k = (o.scheduled - first) / interval
        assert abs(k - round(k)) < EPS, f"slot off the grid: {k}"
        assert round(k) > previous
        previous = round(k)
        assert o.started >= o.scheduled - EPS and o.finished >= o.started


# --- phases ------------------------------------------------------------------------


def test_place_phases_even_on_empty_and_into_the_largest_gaps() -> None:
    assert place_phases([], 1.0, 4) == [0.0, 0.25, 0.5, 0.75]
    assert place_phases([], 5.0, 0) == []
    assert sorted(place_phases([0.0, 0.5], 1.0, 2)) == [0.25, 0.75]
    assert sorted(place_phases([0.0], 1.0, 3)) == [0.25, 0.5, 0.75]
    assert place_phases([0.0, 0.1], 1.0, 1) == [pytest.approx(0.55)]
    # The gap across the end of the interval counts too.
    assert place_phases([0.2, 0.4], 1.0, 1) == [pytest.approx(0.8)]


@given(existing=st.lists(st.floats(0, 0.999), max_size=30), count=st.integers(0, 40))
def test_place_phases_never_widens_the_largest_gap(existing: list[float], count: int) -> None:
    def max_gap(points: list[float]) -> float:
        p = sorted(points)
        return max([b - a for a, b in itertools.pairwise(p)] + [p[0] + 1 - p[-1]])

    new = place_phases(existing, 1.0, count)
    assert len(new) == count and all(0 <= x < 1 for x in new)
    if existing and count:
        assert max_gap(existing + new) <= max_gap(existing) + EPS


# --- running -----------------------------------------------------------------------


def test_targets_added_together_are_spread_evenly_and_drift_free() -> None:
    async def main() -> None:
        log = Log()
        s = ProbeScheduler(log)
        names = [f"t{i}" for i in range(10)]
        for n in names:
            s.add(n, 0.2, ok_now)
        await until(lambda: all(log.count(n) >= 6 for n in names))
        phases = {n: phase_of(s, n) for n in names}
        s.close()
        assert sorted(phases.values()) == pytest.approx([i * 0.02 for i in range(10)])
        for n in names:
            assert_on_grid(log.by_name[n], 0.2)
            # The slots really are the phases: first slots differ by the phase
            # difference, modulo the interval.
            k = (log.by_name[n][0].scheduled - log.by_name["t0"][0].scheduled
                 - phases[n] + phases["t0"]) / 0.2
            assert abs(k - round(k)) < EPS

    asyncio.run(main())


def test_a_stalled_loop_delays_one_probe_not_the_schedule() -> None:
    async def main() -> None:
        log = Log()
        s = ProbeScheduler(log)
        stalls: list[int] = []

        def slow() -> asyncio.Future[ProbeResult]:
            if len(stalls) < 1:
                stalls.append(1)
                time.sleep(0.05)  # blocks the loop: every other target is late
            return ok_now()

        s.add("slow", 0.1, slow)
        for i in range(4):
            s.add(f"t{i}", 0.1, ok_now)
        await until(lambda: all(log.count(f"t{i}") >= 8 for i in range(4)))
        s.close()
        for outcomes in log.by_name.values():
            assert_on_grid(outcomes, 0.1)

    asyncio.run(main())


def test_a_loop_stalled_for_intervals_skips_slots_instead_of_bursting() -> None:
    async def main() -> None:
        log = Log()
        s = ProbeScheduler(log)
        for i in range(5):
            s.add(f"t{i}", 0.1, ok_now)
        await until(lambda: all(log.count(f"t{i}") >= 2 for i in range(5)))
        time.sleep(0.45)  # more than four intervals without the loop
        marks = {n: len(v) for n, v in log.by_name.items()}
        await until(lambda: all(log.count(n) >= marks[n] + 3 for n in marks))
        s.close()
        assert s.missed >= 5 * 3  # at least three slots of each target skipped
        for outcomes in log.by_name.values():
            assert_on_grid(outcomes, 0.1)
            # After the stall, one catch-up probe, not one per missed slot: a burst
            # would launch several in the same wake-up, at the same loop time.
            starts = [o.started for o in outcomes]
            assert len(set(starts)) == len(starts)

    asyncio.run(main())


def test_runtime_add_remove_update_leave_the_others_alone() -> None:
    async def main() -> None:
        log = Log()
        s = ProbeScheduler(log)
        for i in range(4):
            s.add(f"t{i}", 0.2, ok_now)
        await until(lambda: all(log.count(f"t{i}") >= 2 for i in range(4)))
        phases = {f"t{i}": phase_of(s, f"t{i}") for i in range(4)}
        assert sorted(phases.values()) == pytest.approx([0.0, 0.05, 0.1, 0.15])
        s.remove("t1")
        s.add("new", 0.2, ok_now)
        assert s.phase("new") is None  # placed at the next loop turn, with its batch
        await asyncio.sleep(0)
        # Into the largest gap, the hole t1 left; the others untouched.
        assert s.phase("new") == pytest.approx(phases["t1"]) == pytest.approx(0.05)
        assert {n: s.phase(n) for n in ("t0", "t2", "t3")} == \
            {n: phases[n] for n in ("t0", "t2", "t3")}
        removed_at = log.count("t1")
        s.update("t2", 0.1, ok_now)
        mark = log.count("t2")
        await until(lambda: log.count("new") >= 3 and log.count("t2") >= mark + 4)
        assert log.count("t1") == removed_at
        assert "t1" not in s and len(s) == 4
        assert_on_grid(log.by_name["t0"], 0.2)
        assert_on_grid(log.by_name["t2"][mark + 1:], 0.1)
        with pytest.raises(ValueError, match="already exists"):
            s.add("t0", 0.2, ok_now)
        with pytest.raises(ValueError, match=r"at least 0\.1 s"):
            s.add("fast", 0.01, ok_now)
        with pytest.raises(KeyError):
            s.remove("nope")
        s.close()
        with pytest.raises(RuntimeError, match="closed"):
            s.add("after", 0.2, ok_now)

    asyncio.run(main())


def test_an_unanswered_probe_is_a_timeout_when_due_again() -> None:
    async def main() -> None:
        log = Log()
        s = ProbeScheduler(log)
        pending: list[asyncio.Future[ProbeResult]] = []

        def never() -> asyncio.Future[ProbeResult]:
            pending.append(asyncio.get_running_loop().create_future())
            return pending[-1]

        s.add("hung", 0.1, never)
        await until(lambda: log.count("hung") >= 3)
        s.close()
        outcomes = log.by_name["hung"]
        assert all(o.result.reason == "timeout" for o in outcomes)
        assert all(f.cancelled() for f in pending[:len(outcomes)])
        assert_on_grid(outcomes, 0.1)

    asyncio.run(main())


def test_broken_probes_and_handlers_are_counted_not_fatal() -> None:
    async def main() -> None:
        seen: list[ProbeOutcome] = []

        def handler(o: ProbeOutcome) -> None:
            seen.append(o)
            if o.name == "ok":
                raise RuntimeError("handler bug")

        def raises() -> asyncio.Future[ProbeResult]:
            raise RuntimeError("probe bug")

        async def fails_later() -> ProbeResult:
            raise OSError("probe bug, async")

        s = ProbeScheduler(handler)
        s.add("raises", 0.1, raises)
        s.add("async", 0.1, fails_later)
        s.add("ok", 0.1, ok_now)
        await until(lambda: sum(o.name == "ok" for o in seen) >= 3
                    and sum(o.name == "raises" for o in seen) >= 3
                    and sum(o.name == "async" for o in seen) >= 3)
        s.close()
        reasons = {o.name: o.result.reason for o in seen}
        assert reasons["raises"].startswith("probe error: RuntimeError")
        assert reasons["async"].startswith("probe error: OSError")
        assert s.probe_errors >= 6 and s.callback_errors >= 3
        # Our own code broke, not the target: unknown, not a failure.
        broken = [o.result for o in seen if o.name != "ok"]
        assert all(r.local and r.cause == "probe_error" for r in broken)
        assert not any(o.result.local for o in seen if o.name == "ok")

    asyncio.run(main())


# --- the loop watch ------------------------------------------------------------------


def test_the_scheduler_sees_its_own_loop_stall() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        s = ProbeScheduler(Log())
        await asyncio.sleep(0.1)
        t0 = loop.time()
        time.sleep(0.3)  # nothing runs, no socket is read
        t1 = loop.time()
        await asyncio.sleep(0.1)
        seen = s.stalls.longest(t0 - 0.05, t1 + 0.05)
        # Measured to within one watch period (0.02 s).
        assert 0.25 <= seen <= 0.3 + 0.05
        assert s.stalls.count >= 1
        # A window that ends before the stall does not see it.
        assert s.stalls.longest(t0 - 0.1, t0 - 0.05) < 0.05
        s.close()
        await asyncio.sleep(0.1)
        count = s.stalls.count
        time.sleep(0.1)
        await asyncio.sleep(0.05)
        assert s.stalls.count == count  # closed: the watch is off

    asyncio.run(main())
