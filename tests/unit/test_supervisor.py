"""The supervisor's restart behaviour, on a stand-in data plane (a Python
process that answers hello on a ZeroMQ socket): the exit seen at once
(``on_exit``), the back-off rules (none after a stable run, doubling in a crash
loop), a request in flight when the process dies, a start that fails early,
the hook that overlaps the start-up."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hpclb.dataplane.client import DataplaneError, DataplaneTimeout
from hpclb.dataplane.supervisor import DataplaneProcess, ExitWatch

# Answers hello; any other request is never answered (a wedged or dying data
# plane). With a second argument, exits at once without binding (a failed start).
FAKE = r"""
import sys, time
import msgpack, zmq
if len(sys.argv) > 2:
    sys.exit(3)
sock = zmq.Context().socket(zmq.REP)
sock.bind(sys.argv[1])
while True:
    req = msgpack.unpackb(sock.recv(), raw=False)
    if req.get("op") != "hello":
        time.sleep(3600)
    sock.send(msgpack.packb({"v": 2, "ok": True, "seq": req.get("seq"), "dataplane": "fake"}))
"""


def fake_process(tmp_path: Path, *, fail: bool = False, **kw: object) -> DataplaneProcess:
    endpoint = f"ipc://{tmp_path}/dp.sock"
    argv = [sys.executable, "-c", FAKE, endpoint, *(["fail"] if fail else [])]
    return DataplaneProcess(argv=argv, endpoint=endpoint, pidfile=tmp_path / "dp.pid",
                            log_path=tmp_path / "dp.log", start_timeout_s=20.0,
                            **kw)  # type: ignore[arg-type]


@pytest.fixture
def processes() -> Iterator[list[DataplaneProcess]]:
    made: list[DataplaneProcess] = []
    yield made
    for dp in made:
        dp.stop()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def kill(dp: DataplaneProcess) -> float:
    assert dp.pid is not None
    t = time.monotonic()
    os.kill(dp.pid, signal.SIGKILL)
    return t


def test_exit_watch_calls_back_at_once_and_not_when_cancelled() -> None:
    fired = threading.Event()
    proc = subprocess.Popen(["sleep", "30"])
    watch = ExitWatch(proc.pid, fired.set)
    try:
        time.sleep(0.05)
        assert not fired.is_set() and not watch.fired
        proc.kill()
        # Nobody polls the process here: only the watcher can have noticed.
        assert fired.wait(2.0)
        assert watch.fired and watch.exited_at is not None
        assert proc.wait(timeout=5) == -signal.SIGKILL  # the watcher reaped nothing
    finally:
        watch.cancel()
    called = threading.Event()
    proc = subprocess.Popen(["sleep", "30"])
    watch = ExitWatch(proc.pid, called.set)
    watch.cancel()
    proc.kill()
    proc.wait()
    time.sleep(0.1)
    assert not called.is_set() and not watch.fired
    watch.cancel()  # idempotent


def test_exit_watch_of_a_process_already_gone_calls_back() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    fired = threading.Event()
    watch = ExitWatch(proc.pid, fired.set)
    assert fired.wait(2.0)
    watch.cancel()


def test_on_exit_fires_promptly_and_the_restart_after_a_stable_run_is_immediate(
        tmp_path: Path, processes: list[DataplaneProcess]) -> None:
    exits: list[float] = []
    woke = threading.Event()

    def on_exit() -> None:
        exits.append(time.monotonic())
        woke.set()

    dp = fake_process(tmp_path, on_exit=on_exit, stable_after_s=0.0)
    processes.append(dp)
    dp.start()
    first = dp.pid
    assert dp.client.hello()["dataplane"] == "fake"
    assert not dp.restart_if_dead() and not exits
    killed = kill(dp)
    # on_exit came from the watcher: nothing asked alive() or restart_if_dead().
    assert woke.wait(2.0), "on_exit not called"
    assert exits[0] >= killed
    assert not dp.alive()
    assert dp.restart_if_dead()
    assert dp.pid != first and dp.restarts == 1 and dp.alive()
    timing = dp.last_restart
    assert timing is not None and timing.backoff_s == 0.0
    assert timing.pid_before == first and timing.pid == dp.pid
    assert timing.exited <= timing.detected <= timing.spawned <= timing.ready <= timing.hooks_done
    assert dp.client.hello()["dataplane"] == "fake"  # the client reconnected
    # A stop is our own doing: no on_exit.
    woke.clear()
    dp.stop()
    time.sleep(0.2)
    assert not woke.is_set()


def test_a_crash_loop_backs_off_doubling_and_a_stable_run_resets_it(
        tmp_path: Path, processes: list[DataplaneProcess]) -> None:
    dp = fake_process(tmp_path, stable_after_s=30.0, backoff_first_s=0.05, backoff_max_s=0.2)
    processes.append(dp)
    dp.start()
    delays = []
    for _ in range(5):
        kill(dp)
        wait_for(lambda: not dp.alive())
        assert dp.restart_if_dead()
        assert dp.last_restart is not None
        delays.append(dp.last_restart.backoff_s)
    # The first restart is immediate; a process that dies before it is stable
    # waits longer each time, up to the maximum.
    assert delays == [0.0, 0.05, 0.1, 0.2, 0.2]
    now = time.monotonic()
    assert dp.next_backoff_s(now) == 0.2
    assert dp.next_backoff_s(now + 30.0) == 0.0  # once stable: at once again
    dp.stable_after_s = 0.0
    kill(dp)
    wait_for(lambda: not dp.alive())
    assert dp.restart_if_dead()
    assert dp.last_restart is not None and dp.last_restart.backoff_s == 0.0
    assert dp.next_backoff_s(time.monotonic()) == 0.0


def test_a_request_in_flight_when_the_data_plane_dies_ends_at_once(
        tmp_path: Path, processes: list[DataplaneProcess]) -> None:
    """A status read never answered (the process dies meanwhile) gives up as
    soon as the exit is seen, not after the client's 5 s timeout."""
    dp = fake_process(tmp_path)
    processes.append(dp)
    dp.start()
    threading.Timer(0.3, kill, args=(dp,)).start()
    # "exited", not the client's own timeout: the exit ended the wait.
    with pytest.raises(DataplaneTimeout, match="exited"):
        dp.client.stats()
    assert dp.restart_if_dead()
    assert dp.client.hello()["dataplane"] == "fake"


def test_a_start_that_fails_early_is_reported_early(
        tmp_path: Path, processes: list[DataplaneProcess]) -> None:
    dp = fake_process(tmp_path, fail=True)
    processes.append(dp)
    # The exit is reported as such, not as a start-up that ran out of time.
    with pytest.raises(DataplaneError, match="exited during start-up"):
        dp.start()


def test_while_starting_overlaps_the_start_up_and_cannot_break_it(
        tmp_path: Path, processes: list[DataplaneProcess],
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    def while_starting(starting: Callable[[], bool]) -> None:
        assert starting()  # forked, not yet answering
        calls.append("while_starting")
        raise RuntimeError("boom")

    dp = fake_process(tmp_path, before_start=lambda: calls.append("before_start"),
                      while_starting=while_starting,
                      after_ready=lambda: calls.append("after_ready"))
    processes.append(dp)
    with caplog.at_level(logging.ERROR, logger="hpclb.dataplane.supervisor"):
        dp.start()
    assert calls == ["before_start", "while_starting", "after_ready"]
    assert "while the data plane started" in caplog.text and dp.alive()


def test_a_restart_attempt_that_fails_counts_as_a_crash(
        tmp_path: Path, processes: list[DataplaneProcess]) -> None:
    """A restart whose preparation fails is retried with the crash loop's
    back-off, not at once again and again."""
    failures = {"left": 0}

    def before_start() -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("cannot prepare the port")

    dp = fake_process(tmp_path, before_start=before_start, stable_after_s=0.3,
                      backoff_first_s=0.05, backoff_max_s=0.2)
    processes.append(dp)
    dp.start()
    time.sleep(0.4)  # a stable run
    failures["left"] = 1
    kill(dp)
    wait_for(lambda: not dp.alive())
    with pytest.raises(RuntimeError, match="cannot prepare"):
        dp.restart_if_dead()  # at once (after a stable run), and it fails
    assert dp.restart_if_dead()
    assert dp.last_restart is not None and dp.last_restart.backoff_s == 0.05
