"""What the faces (the REST API) may ask of the controller, from their threads.

The controller's state belongs to its loop thread. A face reads only objects the
loop replaces whole (the configuration in force, its text and revision, the
status snapshot), and *changes* go through a queue the loop drains between two
turns: so API writes are serialised with each other, with SIGHUP reloads, probe
verdicts and pushes, and each is applied by the loop as one transaction
(``Controller.apply_edit``: validate, prepare, write the file, commit) or not at
all.

A change that the loop has not taken within its timeout is withdrawn (it will
never be applied) and reported as unavailable; once taken it runs to its end
and its answer is awaited, so an acknowledgement always means "in the file and
in force".
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpclb.config import ConfigDocument, EditError, HpclbConfig

if TYPE_CHECKING:
    from hpclb.controller.core import Controller

log = logging.getLogger(__name__)

__all__ = ["ConfigDocument", "EditError", "Operations", "revision_of"]

#: Jobs handled per loop turn at most, and the time a turn spends on them at
#: most (a write prepares and pushes whole tables: tens of ms at 1,000
#: backends), so a burst of writes never stalls probes, telemetry and pushes.
MAX_JOBS_PER_TURN = 16
MAX_JOB_TIME_PER_TURN_S = 0.5
#: The longest a pin may last (a day): a forgotten pin must end by itself.
MAX_PIN_S = 86400.0

Edit = Callable[[ConfigDocument], None]


def revision_of(text: str) -> str:
    """The revision of a configuration text: what an ETag carries."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass
class _Job:
    """One request for the loop. ``state`` goes pending -> taken -> done, or
    pending -> withdrawn (the requester gave up; the loop skips it)."""

    run: Callable[[], Any]
    state: str = "pending"
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Operations:
    """The controller's operations for faces; every method is thread-safe."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller
        self._jobs: queue.Queue[_Job] = queue.Queue()

    # --- reads (objects the loop replaces whole) -------------------------------

    def revision(self) -> str:
        return self._controller.revision

    def config(self) -> HpclbConfig:
        return self._controller.config

    def config_text(self) -> str:
        return self._controller.config_text

    def status(self) -> dict[str, Any] | None:
        return self._controller.status

    # --- changes -----------------------------------------------------------------

    def _call(self, run: Callable[[], Any], timeout_s: float) -> Any:
        job = _Job(run)
        self._jobs.put(job)
        self._controller.wake.set()
        if not job.done.wait(timeout_s):
            with job.lock:
                if job.state == "pending":
                    job.state = "withdrawn"
                    raise EditError("unavailable", f"the control loop did not take the change "
                                    f"within {timeout_s:g} s; nothing was applied")
            job.done.wait()  # taken: it runs to its end, whatever it takes
        if job.error is not None:
            raise job.error
        return job.result

    def change(self, edit: Edit, if_match: str | None = None, timeout_s: float = 30.0) -> str:
        """Apply ``edit`` to the configuration document as one transaction in the
        loop; returns the new revision. EditError when refused (nothing changed)."""
        return str(self._call(lambda: self._controller.apply_edit(edit, if_match), timeout_s))

    def pin(self, backend: str, weight: float, duration_s: float) -> None:
        """Hold ``backend``'s ring weight at ``weight`` for ``duration_s``."""
        if not (math.isfinite(weight) and weight >= 0):
            raise EditError("invalid", "weight must be a finite number >= 0")
        if not (math.isfinite(duration_s) and 0 < duration_s <= MAX_PIN_S):
            raise EditError("invalid", f"duration_s must be in (0, {MAX_PIN_S:g}]")
        self._call(lambda: self._controller.pin(backend, weight, duration_s), 30.0)

    def unpin(self, backend: str) -> None:
        self._call(lambda: self._controller.pin(backend, None, 0.0), 30.0)

    # --- the loop's side -----------------------------------------------------------

    def run_pending(self) -> None:
        """Run queued jobs (the loop thread only); a job's failure is its answer."""
        deadline = time.monotonic() + MAX_JOB_TIME_PER_TURN_S
        for _ in range(MAX_JOBS_PER_TURN):
            if time.monotonic() > deadline:
                self._controller.wake.set()  # the rest next turn, after the loop's own work
                return
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            with job.lock:
                if job.state != "pending":
                    continue  # withdrawn by a requester that stopped waiting
                job.state = "taken"
            try:
                job.result = job.run()
            except EditError as err:
                job.error = err
            except Exception as err:  # never the loop's death: the requester's error
                log.exception("operation failed")
                job.error = EditError("invalid", f"refused: {err}")
            finally:
                job.state = "done"
                job.done.set()
