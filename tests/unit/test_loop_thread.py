"""host.loop_thread: the one "asyncio loop in a thread in a namespace" the
probes and the telemetry receiver share."""

from __future__ import annotations

import threading

import pytest

from hpclb.host.loop_thread import LoopThread


async def _nothing() -> None:
    return None


def test_call_runs_in_the_loop_thread_and_stop_runs_teardown() -> None:
    torn_down = threading.Event()

    async def teardown() -> None:
        torn_down.set()

    lt = LoopThread("test-loop")
    lt.start(_nothing, teardown)
    assert lt.running
    assert lt.call(lambda: threading.current_thread().name) == "test-loop"
    assert lt.stop() and torn_down.is_set()
    assert lt.stop()  # idempotent
    with pytest.raises(RuntimeError, match="not running"):
        LoopThread("never-started").call(lambda: None)


def test_a_setup_error_is_raised_by_start() -> None:
    async def setup() -> None:
        raise OSError(98, "Address already in use")

    lt = LoopThread("test-bind")
    with pytest.raises(OSError, match="already in use"):
        lt.start(setup, _nothing)
    assert not lt.running
    assert lt.stop()


def test_a_namespace_that_does_not_exist_is_raised_by_start() -> None:
    lt = LoopThread("test-netns", netns="/nonexistent/hpclb-test-netns")
    with pytest.raises(OSError):
        lt.start(_nothing, _nothing)
    assert lt.stop()
