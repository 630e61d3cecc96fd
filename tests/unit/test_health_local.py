"""A local failure is never a backend failure.

Probes spoiled on the appliance's own side (out of file descriptors, a stalled
event loop) end *unknown*: counted, alarmed, never a verdict. Flap damping that
holds a backend out says so. The probe thread's snapshot never waits for its loop.

Real sockets on loopback, as in test_health.py; the checker's clocks are driven
by hand where a test needs time to pass (the alarm's hold, damping decay).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import queue
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import pytest

from hpclb.config.probes import ProbeConfig
from hpclb.health import (
    ALARM_HOLD_S,
    TIMEOUT,
    HealthChecker,
    LoopStalls,
    ProbeOutcome,
    ProbeResult,
    Transition,
    stall_during,
)
from hpclb.health import thread as health_thread
from hpclb.health.checker import judge
from hpclb.health.thread import ProbeThread

from .probe_sockets import syn_dropping_port

WAIT = 10.0
NO_DAMPING = {"enabled": False}
CHECKER_LOG = "hpclb.health.checker"


async def wait_for(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not predicate():
            await asyncio.sleep(0.02)


def wait_sync(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


class Clock:
    """A monotonic clock and its wall clock, moved by hand."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.wall0 = 1_700_000_000.0

    def mono(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.wall0 + self.t


class FdHog:
    """Holds every free descriptor of this process (soft limit lowered to at most
    1024 to keep it quick), so that the next socket() fails with EMFILE."""

    def __init__(self) -> None:
        self.limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(self.limits[0], 1024), self.limits[1]))
        self.held = [os.open(os.devnull, os.O_RDONLY)]

    def fill(self) -> int:
        """Take every descriptor that is free now (probes in flight when the
        table filled up free theirs a moment later); how many it took."""
        taken = 0
        while True:
            try:
                self.held.append(os.dup(self.held[0]))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                return taken
            taken += 1

    def release(self) -> None:
        for fd in self.held:
            os.close(fd)
        self.held.clear()
        resource.setrlimit(resource.RLIMIT_NOFILE, self.limits)


SERVERS = """
import asyncio, sys

async def http(reader, writer):
    try:
        await reader.readuntil(b"\\r\\n\\r\\n")
        writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: 0\\r\\n\\r\\n")
        await writer.drain()
    except Exception:
        pass
    finally:
        writer.close()

async def main():
    tcp = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    web = await asyncio.start_server(http, "127.0.0.1", 0)
    print(tcp.sockets[0].getsockname()[1], web.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main())
"""


@contextmanager
def servers_elsewhere() -> Iterator[tuple[int, int]]:
    """A TCP and an HTTP server in another process: out of reach of this
    process's descriptor shortage, like real backends."""
    proc = subprocess.Popen([sys.executable, "-c", SERVERS], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        tcp, web = map(int, proc.stdout.readline().split())
        yield tcp, web
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == CHECKER_LOG and r.levelno == level and text in r.getMessage()]


# --- out of file descriptors ---------------------------------------------------------


def test_out_of_file_descriptors_is_unknown_never_down(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    caplog.set_level(logging.INFO, logger="hpclb.health")
    clock = Clock()

    async def main(tcp_port: int, web_port: int) -> None:
        transitions: list[Transition] = []
        checker = HealthChecker(transitions.append, clock=clock.mono, wall_clock=clock.wall)
        # fall 1 and damping on: one counted failure would show as a transition.
        strict: dict[str, Any] = {"interval_s": 0.1, "rise": 1, "fall": 1}
        checker.add("tcp", "127.0.0.1", ProbeConfig(kind="tcp", port=tcp_port, **strict))
        checker.add("web", "127.0.0.1", ProbeConfig(kind="http", port=web_port, **strict))
        names = ("tcp", "web")

        def status(n: str) -> Any:
            return checker.status(n)

        await wait_for(lambda: all(status(n).last_reason == "ok" for n in names))
        assert checker.alarm(clock.t) is None
        hog = FdHog()
        try:
            hog.fill()
            with pytest.raises(OSError, match="Too many open files"):
                socket.socket()
            await asyncio.sleep(0.3)
            hog.fill()  # what probes in flight gave back meanwhile
            marks = {n: status(n).unknown for n in names}
            await wait_for(lambda: all(status(n).unknown >= marks[n] + 3 for n in names))
            during = {n: status(n) for n in names}
            stats = checker.stats()
            alarm = checker.alarm(clock.t)
        finally:
            hog.release()
        for n in names:
            s = during[n]
            assert s.up and s.raw_up and s.last_unknown and s.failed == 0, s
            assert "Too many open files" in s.last_reason
            assert s.rtt_ms is not None  # the last judged RTT stays
        assert not transitions
        assert stats["failed"] == 0 and stats["unknown"] >= 6
        assert stats["unknown_emfile"] == stats["unknown"]
        assert stats["tcp_local"] >= 3 and stats["tcp_failed"] == 0
        assert alarm is not None and alarm.startswith("probes: ")
        assert "local errors in the last 10 s (last: " in alarm
        assert "Too many open files); verdicts held" in alarm
        # Descriptors back: probes succeed, and nothing ever changed.
        marks = {n: status(n).probes for n in names}
        await wait_for(lambda: all(status(n).probes >= marks[n] + 3
                                   and status(n).last_reason == "ok" for n in names))
        for n in names:
            s = status(n)
            assert s.up and not s.last_unknown and s.failed == 0 and s.penalty == 0
            assert s.unknown == during[n].unknown
        assert not transitions
        assert checker.alarm(clock.t) is not None  # held for ALARM_HOLD_S
        clock.t += ALARM_HOLD_S + 0.5
        assert checker.alarm(clock.t) is None
        checker.close()

    with servers_elsewhere() as (tcp_port, web_port):
        asyncio.run(main(tcp_port, web_port))
    # One line when the alarm starts and one when it ends, however many probes.
    assert len(records(caplog, logging.WARNING, "local error")) == 1
    assert len(records(caplog, logging.INFO, "no local error for 10 s")) == 1


# --- the stalled loop ----------------------------------------------------------------


def outcome(result: ProbeResult, scheduled: float, started: float, finished: float
            ) -> ProbeOutcome:
    return ProbeOutcome("b", result, scheduled, started, finished)


def test_stall_rule_on_a_driven_clock() -> None:
    stalls = LoopStalls()
    # Timeout 1 s, probe slot at 100: sent on time, result at its deadline.
    on_time = outcome(TIMEOUT, 100.0, 100.0, 101.0)
    assert stall_during(on_time, 1.0, stalls) == 0.0
    assert judge(on_time, 1.0, stalls) is TIMEOUT  # a responsive loop: a real timeout
    # Sent 0.6 s after its slot: the loop was blind that long.
    late_send = outcome(TIMEOUT, 100.0, 100.6, 101.6)
    assert stall_during(late_send, 1.0, stalls) == pytest.approx(0.6)
    r = judge(late_send, 1.0, stalls)
    assert r.local and r.cause == "loop_stall" and "stalled 600 ms" in r.reason
    # The result taken 0.7 s after the deadline.
    assert judge(outcome(TIMEOUT, 100.0, 100.0, 101.7), 1.0, stalls).local
    # Exactly half the timeout is still jitter; a hair more is not.
    assert not judge(outcome(TIMEOUT, 100.0, 100.5, 101.5), 1.0, stalls).local
    # A stall the loop watch saw inside the probe's window (partly).
    stalls.record(100.7, 101.4)
    assert stall_during(on_time, 1.0, stalls) == pytest.approx(0.3)
    assert not judge(on_time, 1.0, stalls).local
    stalls.record(101.9, 102.2)  # after this probe: not its business
    assert stall_during(on_time, 1.0, stalls) == pytest.approx(0.3)
    # Two stretches of 0.2 and 0.3 s in one window: the loop looked in between,
    # so the longest counts, not the sum.
    two = outcome(TIMEOUT, 101.2, 101.2, 102.2)
    assert stall_during(two, 1.0, stalls) == pytest.approx(0.3)
    assert not judge(two, 1.0, stalls).local
    stalls.record(102.3, 103.0)
    assert judge(outcome(TIMEOUT, 102.2, 102.2, 103.2), 1.0, stalls).local
    # Only timeouts are judged this way: a refusal or an answer is evidence anyway.
    refused = ProbeResult.failure("refused")
    assert judge(outcome(refused, 100.0, 100.9, 101.0), 1.0, stalls) is refused
    ok = ProbeResult.success(1000)
    assert judge(outcome(ok, 100.0, 100.9, 101.0), 1.0, stalls) is ok


def test_a_timeout_taken_while_the_loop_stalled_is_unknown() -> None:
    async def main() -> tuple[list[ProbeOutcome], float, float, int]:
        seen: list[ProbeOutcome] = []
        checker = HealthChecker(lambda t: None, on_result=seen.append)
        loop = asyncio.get_running_loop()
        with syn_dropping_port() as port:
            # Timeout = interval: a probe is always in flight, so the stall falls
            # into one probe's window.
            checker.add("b", "127.0.0.1", ProbeConfig(
                kind="tcp", port=port, interval_s=0.3, fall=1000, damping=NO_DAMPING))
            await wait_for(lambda: checker.status("b").failed >= 2)
            t0 = loop.time()
            time.sleep(1.0)  # the loop stalls; the target stays as silent as before
            t1 = loop.time()
            await wait_for(lambda: any(o.result.local for o in seen)
                           and sum(o.started > t1 for o in seen) >= 2)
        failed = checker.status("b").failed
        checker.close()
        return seen, t0, t1, failed

    seen, t0, t1, failed = asyncio.run(main())
    unknown = [o for o in seen if o.result.local]
    assert all(o.result.cause == "loop_stall" for o in unknown)
    # The probe in flight across the stall is unknown; so may be one sent late
    # because of it; none that the stall did not touch.
    assert any(o.scheduled <= t0 and o.finished >= t1 for o in unknown)
    assert all(o.scheduled < t1 and o.finished > t0 for o in unknown)
    genuine = [o for o in seen if not o.result.local]
    assert all(o.result.reason == "timeout" for o in genuine)
    assert sum(o.started > t1 for o in genuine) >= 1  # timeouts count again after it
    assert failed == len(genuine) >= 3


# --- damping made visible --------------------------------------------------------------


def test_damping_hold_is_logged_once_with_a_release_time(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    caplog.set_level(logging.INFO, logger="hpclb.health")
    clock = Clock()
    got: dict[str, Any] = {}

    def warnings() -> list[str]:
        return records(caplog, logging.WARNING, "flap damping")

    async def main() -> None:
        transitions: list[Transition] = []
        checker = HealthChecker(transitions.append, clock=clock.mono, wall_clock=clock.wall)
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        # rise 1, fall 1: every probe result that differs is a state change.
        # Default damping: 1000 per change, suppressed at 2500, reuse below 800,
        # half-life 60 s. The clock stands still until said otherwise.
        checker.add("b", "127.0.0.1", ProbeConfig(kind="tcp", port=port, interval_s=0.1,
                                                  rise=1, fall=1))

        async def toggle(listening: bool) -> None:
            nonlocal server
            if listening:
                server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
            else:
                server.close()
                await server.wait_closed()

        for n, listening in enumerate((False, True, False), start=1):  # 3 changes: 3000
            await toggle(listening)
            await wait_for(lambda n=n: len(transitions) == n)
        s = checker.status("b")
        assert s.suppressed and not s.up and not s.raw_up and s.penalty == pytest.approx(3000)
        assert s.release_at == pytest.approx(clock.wall() + 60 * math.log2(3000 / 800))
        assert not warnings()  # down anyway: the transition's reason says it is damped
        # It answers again: a 4th change (4000), held out, no transition: the warning.
        await toggle(True)
        await wait_for(lambda: checker.status("b").raw_up)
        release = clock.wall() + 60 * math.log2(4000 / 800)
        got["release"] = release
        s = checker.status("b")
        assert s.release_at == pytest.approx(release) and s.penalty == pytest.approx(4000)
        # The release time is a time, not a countdown: it stays put as time passes.
        clock.t += 30
        s = checker.status("b")
        assert not s.up and s.suppressed and len(transitions) == 3
        assert s.penalty == pytest.approx(4000 * 2 ** -0.5)
        assert s.release_at == pytest.approx(release)
        view = checker.views()["b"]  # what the probe thread's snapshot shows
        assert (view["suppressed"], view["raw_up"], view["up"]) == (True, True, False)
        assert view["penalty"] == pytest.approx(s.penalty)
        assert view["release_at"] == pytest.approx(release)
        got["warnings_while_held"] = len(warnings())
        # Past the release time: the next probe releases it.
        clock.t = release - clock.wall0 + 0.5  # wall() = wall0 + t
        await wait_for(lambda: len(transitions) == 4)
        assert transitions[3].up and transitions[3].reason.startswith("damping released")
        s = checker.status("b")
        assert s.up and not s.suppressed and s.release_at is None
        checker.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert got["warnings_while_held"] == 1 and len(warnings()) == 1
    when = datetime.fromtimestamp(got["release"]).isoformat(sep=" ", timespec="seconds")
    line = warnings()[0]
    assert line.startswith("backend b: answers again but flap damping holds it out: "
                           "penalty 4000 ")
    assert f"release expected at {when} (in 139 s)" in line
    released = records(caplog, logging.INFO, "flap damping released")
    assert len(released) == 1 and released[0].endswith("; back in service")


# --- the probe thread's snapshot ---------------------------------------------------------


SNAPSHOT_KEYS = {"stats", "backends", "alarm", "at"}
BACKEND_KEYS = {"up", "raw_up", "unknown", "suppressed", "penalty", "release_at",
                "last_reason", "rtt_ms", "failures", "successes"}


def test_probe_thread_snapshot_is_fresh_after_changes_and_never_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # No periodic refresh during the test: what the snapshot shows came from the
    # refresh after a change.
    monkeypatch.setattr(health_thread, "SNAPSHOT_PERIOD_S", 3600.0)
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(128)  # the kernel completes handshakes; nothing needs to accept
    port = lst.getsockname()[1]
    events: queue.Queue[Any] = queue.Queue()
    thread = ProbeThread(events, threading.Event())
    thread.start()
    try:
        thread.sync({"b": ("127.0.0.1", ProbeConfig(kind="tcp", port=port, interval_s=0.1,
                                                    rise=1, fall=1, initial="down",
                                                    damping=NO_DAMPING))})
        up = events.get(timeout=WAIT).transition
        assert up.up
        wait_sync(lambda: thread.snapshot()["backends"]["b"]["up"])
        snap = thread.snapshot()
        assert set(snap) == SNAPSHOT_KEYS and set(snap["backends"]["b"]) == BACKEND_KEYS
        b = snap["backends"]["b"]
        assert b["raw_up"] and not b["unknown"] and b["last_reason"] == "ok"
        assert b["release_at"] is None and not b["suppressed"] and b["successes"] >= 1
        assert snap["alarm"] is None and snap["stats"]["probes"] >= 1
        assert thread.stats() is snap["stats"]
        # Block the probe loop until we let it go: snapshot() and stats() return
        # while it is still blocked, so they cannot have waited on it.
        loop = thread._thread.loop
        assert loop is not None
        blocked, release, after = threading.Event(), threading.Event(), threading.Event()

        def block() -> None:
            blocked.set()
            release.wait(WAIT)

        loop.call_soon_threadsafe(block)
        loop.call_soon_threadsafe(after.set)
        assert blocked.wait(WAIT)
        t0 = time.monotonic()
        try:
            stalled = thread.snapshot()
            stats = thread.stats()
            assert not after.is_set(), "the loop ran while it was blocked"
        finally:
            release.set()
        assert stalled["backends"]["b"]["up"] and stats["probes"] >= 1
        assert stalled["at"] < t0
        # A transition after the stall is in the snapshot at once.
        lst.close()
        down = events.get(timeout=WAIT).transition
        assert not down.up
        wait_sync(lambda: not thread.snapshot()["backends"]["b"]["up"])
        assert thread.snapshot()["backends"]["b"]["last_reason"] == "refused"
    finally:
        thread.stop()
        lst.close()
