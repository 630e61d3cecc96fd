"""Operations: faces' changes reach the controller's loop through a queue.

The loop side here is a stand-in with the controller's four members that
Operations uses (wake, apply_edit, pin, revision): what is tested is the
queue's contract (serialised, all-or-nothing answers, a change not taken in
time is withdrawn and never applied), not the controller's transaction, which
the REST API's lab suite drives through a real `hpclb run`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from hpclb.config import ConfigDocument, EditError
from hpclb.controller.operations import MAX_JOBS_PER_TURN, Operations, revision_of


class LoopStandIn:
    def __init__(self) -> None:
        self.wake = threading.Event()
        self.revision = revision_of("")
        self.applied: list[str] = []
        self.pins: list[tuple[str, float | None, float]] = []

    def apply_edit(self, edit: Any, if_match: str | None) -> str:
        doc = ConfigDocument.parse("pools: {}\n")
        edit(doc)
        self.applied.append(doc.text())
        self.revision = revision_of(doc.text())
        return self.revision

    def pin(self, backend: str, weight: float | None, duration_s: float) -> None:
        if backend != "b1":
            raise EditError("not_found", f"no backend {backend!r}")
        self.pins.append((backend, weight, duration_s))


def run_loop(ops: Operations, loop: LoopStandIn, stop: threading.Event) -> threading.Thread:
    def turn() -> None:
        while not stop.is_set():
            loop.wake.wait(0.05)
            loop.wake.clear()
            ops.run_pending()
    thread = threading.Thread(target=turn, daemon=True)
    thread.start()
    return thread


def test_changes_from_many_threads_are_applied_one_at_a_time_and_each_gets_its_revision() -> None:
    loop = LoopStandIn()
    ops = Operations(loop)  # type: ignore[arg-type]
    stop = threading.Event()
    thread = run_loop(ops, loop, stop)
    answers: dict[int, str] = {}

    def write(i: int) -> None:
        answers[i] = ops.change(lambda d: d.put_pool(f"p{i}", {"weights": "static"}))

    try:
        writers = [threading.Thread(target=write, args=(i,)) for i in range(20)]
        for w in writers:
            w.start()
        for w in writers:
            w.join(10)
    finally:
        stop.set()
        thread.join(5)
    assert len(loop.applied) == 20
    # Each answer is the revision of the document its own edit produced.
    assert sorted(answers.values()) == sorted(revision_of(t) for t in loop.applied)


def test_a_refused_edit_is_the_requesters_error_and_the_loop_goes_on() -> None:
    loop = LoopStandIn()
    ops = Operations(loop)  # type: ignore[arg-type]
    stop = threading.Event()
    thread = run_loop(ops, loop, stop)
    try:
        with pytest.raises(EditError) as refused:
            ops.change(lambda d: d.delete_vip("nope"))
        assert refused.value.kind == "not_found"
        with pytest.raises(EditError) as crashed:
            ops.change(lambda d: 1 / 0)  # type: ignore[func-returns-value]
        assert crashed.value.kind == "invalid" and "division" in crashed.value.message
        assert ops.change(lambda d: d.put_pool("ok", {})) == loop.revision
    finally:
        stop.set()
        thread.join(5)


def test_a_change_the_loop_did_not_take_in_time_is_withdrawn_and_never_applied() -> None:
    loop = LoopStandIn()
    ops = Operations(loop)  # type: ignore[arg-type]
    with pytest.raises(EditError) as late:
        ops.change(lambda d: d.put_pool("late", {}), timeout_s=0.2)
    assert late.value.kind == "unavailable" and "nothing was applied" in late.value.message
    ops.run_pending()  # the loop comes back: the withdrawn job is skipped
    assert loop.applied == []


def test_a_change_taken_by_the_loop_is_awaited_past_the_timeout() -> None:
    """Once taken, a change runs to its end and its answer is the requester's:
    an acknowledgement always means applied, a timeout never hides one."""
    loop = LoopStandIn()
    slow_apply = loop.apply_edit

    def slow(edit: Any, if_match: str | None) -> str:
        time.sleep(0.5)
        return slow_apply(edit, if_match)

    loop.apply_edit = slow  # type: ignore[method-assign]
    ops = Operations(loop)  # type: ignore[arg-type]
    stop = threading.Event()
    thread = run_loop(ops, loop, stop)
    try:
        revision = ops.change(lambda d: d.put_pool("p", {}), timeout_s=0.1)
    finally:
        stop.set()
        thread.join(5)
    assert revision == revision_of(loop.applied[0])


def test_pins_are_checked_before_they_reach_the_loop() -> None:
    loop = LoopStandIn()
    ops = Operations(loop)  # type: ignore[arg-type]
    for weight, duration in ((-1.0, 10.0), (float("nan"), 10.0), (1.0, 0.0), (1.0, 1e9)):
        with pytest.raises(EditError) as bad:
            ops.pin("b1", weight, duration)
        assert bad.value.kind == "invalid"
    assert loop.pins == []
    stop = threading.Event()
    thread = run_loop(ops, loop, stop)
    try:
        ops.pin("b1", 2.5, 60.0)
        ops.unpin("b1")
        with pytest.raises(EditError) as unknown:
            ops.pin("zz", 1.0, 60.0)
    finally:
        stop.set()
        thread.join(5)
    assert unknown.value.kind == "not_found"
    assert loop.pins == [("b1", 2.5, 60.0), ("b1", None, 0.0)]


def test_one_loop_turn_runs_a_bounded_number_of_jobs() -> None:
    loop = LoopStandIn()
    ops = Operations(loop)  # type: ignore[arg-type]
    waiters = [threading.Thread(target=ops.change, args=(lambda d: d.put_pool("p", {}),),
                                kwargs={"timeout_s": 5.0}, daemon=True)
               for _ in range(MAX_JOBS_PER_TURN + 5)]
    for w in waiters:
        w.start()
    deadline = time.monotonic() + 5
    while ops._jobs.qsize() < len(waiters) and time.monotonic() < deadline:
        time.sleep(0.01)
    ops.run_pending()
    assert len(loop.applied) == MAX_JOBS_PER_TURN
    ops.run_pending()
    assert len(loop.applied) == len(waiters)
    for w in waiters:
        w.join(5)
