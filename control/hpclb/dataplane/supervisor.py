"""Start, adopt, watch and restart the data-plane process.

The data plane runs in its own session (``start_new_session``) so that it
outlives the control plane: if ``hpclb run`` dies, packets keep flowing with
the last tables, and the next ``hpclb run`` adopts the running process (its
pid file names it and it answers hello on the socket) instead of starting a
new one. A data plane that exits is restarted and the controller pushes its
tables again.

Its exit is noticed at once: a watcher thread waits on a pidfd of the process
(started or adopted) and calls ``on_exit``, which the controller wires to its
wake event, so that the restart does not wait for the loop's next turn. The
first restart after a stable run (``stable_after_s``) starts at once; a data
plane that keeps dying sooner is restarted after a back-off that doubles from
``backoff_first_s`` up to ``backoff_max_s``, so that a crash loop does not
spin. Each restart logs where its time went (exit noticed, back-off, start,
hello, hooks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from hpclb.contract.tables import PROTOCOL_VERSION
from hpclb.dataplane.client import (
    DataplaneClient,
    DataplaneError,
    DataplaneTimeout,
    check_version,
)
from hpclb.host import install

log = logging.getLogger(__name__)


def find_xdp_daemon() -> str:
    """``hpclb-xdp``: $HPCLB_XDP_BIN, else the install manifest (hpclb.host.install)."""
    return str(install.find("hpclb-xdp"))


Hook = Callable[[], None]
# Called with a "still starting" probe (the process is alive and its start-up
# time is not over), to bound what the hook waits for.
StartingHook = Callable[[Callable[[], bool]], None]

# While waiting for a (re)started data plane's first hello: how often ZeroMQ
# retries the connection (its default, 100 ms, would be most of a restart),
# and how often the process is checked for an exit during start-up.
READY_RECONNECT_MS = 5
READY_POLL_MS = 10


class ExitWatch:
    """Calls ``callback`` from a thread as soon as process ``pid`` exits.

    It waits on a pidfd (Linux 5.3), which works for a child and for an adopted
    process alike and reaps nothing (``Popen.poll`` still collects the status);
    where pidfds are missing it polls every 20 ms. ``cancel`` stops it without a
    call (an exit we caused). ``exited_at`` is when the exit was seen (wall clock).
    """

    POLL_FALLBACK_S = 0.02

    def __init__(self, pid: int, callback: Callable[[], None]) -> None:
        self.pid = pid
        self.exited_at: float | None = None
        self._callback = callback
        self._cancel_r, self._cancel_w = os.pipe()
        self._pidfd: int | None = None
        self._gone = False
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True  # already reaped: report it from the thread
        except OSError:  # no pidfds here: poll
            self._pidfd = None
        self._thread = threading.Thread(target=self._run, name=f"dataplane-exit-{pid}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if not self._gone and not self._wait():
                return  # cancelled
            self.exited_at = time.time()
            self._callback()
        except Exception:  # never let the watcher die with a traceback on stderr
            log.exception("data-plane exit watcher for pid %d", self.pid)
        finally:
            if self._pidfd is not None:
                os.close(self._pidfd)
            os.close(self._cancel_r)

    def _wait(self) -> bool:
        """Blocks until the process exits (True) or the watch is cancelled (False)."""
        poller = select.poll()
        poller.register(self._cancel_r, select.POLLIN)
        if self._pidfd is not None:
            poller.register(self._pidfd, select.POLLIN)
        while True:
            events = poller.poll(None if self._pidfd is not None
                                 else self.POLL_FALLBACK_S * 1000)
            fds = {fd for fd, _ in events}
            if self._cancel_r in fds:
                return False
            if self._pidfd is not None and self._pidfd in fds:
                return True
            if self._pidfd is None and not _alive(self.pid):
                return True

    @property
    def fired(self) -> bool:
        return self.exited_at is not None

    def cancel(self) -> None:
        """Stop watching, without a call (idempotent)."""
        if self._cancel_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._cancel_w, b"x")
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=5)
            os.close(self._cancel_w)
            self._cancel_w = -1


class WatchedClient(DataplaneClient):
    """The supervisor's client: a request gives up as soon as the supervised
    process is known to be gone (``gone()``), instead of waiting out the whole
    timeout for a reply that will never come. A status read that happened to
    be in flight when the data plane died would otherwise hold the
    controller's loop, and the restart, for the full timeout."""

    POLL_MS = 20

    def __init__(self, endpoint: str, timeout_s: float, gone: Callable[[], bool]) -> None:
        super().__init__(endpoint, timeout_s)
        self._gone = gone

    def send_raw(self, payload: bytes) -> dict[str, Any]:
        sock = self._socket()
        deadline = time.monotonic() + self.timeout_ms / 1000
        try:
            sock.send(payload)
            while not sock.poll(self.POLL_MS, zmq.POLLIN):
                if self._gone():
                    raise DataplaneTimeout(f"no reply from {self.endpoint}: the data plane "
                                           "exited")
                if time.monotonic() > deadline:
                    raise DataplaneTimeout(f"no reply from {self.endpoint}")
            reply = sock.recv()
        except zmq.Again as exc:
            self.close()
            raise DataplaneTimeout(f"no reply from {self.endpoint}") from exc
        except DataplaneTimeout:
            self.close()  # a REQ socket that missed its reply cannot send again
            raise
        decoded = msgpack.unpackb(reply, raw=False)
        if not isinstance(decoded, dict):
            raise DataplaneError(f"malformed reply from {self.endpoint}: {decoded!r}")
        return decoded


@dataclass
class RestartTiming:
    """Where one restart's time went (wall-clock seconds, time.time())."""

    pid_before: int | None
    pid: int
    exited: float  # the exit was seen (exit watcher), else when the loop noticed it
    detected: float  # restart_if_dead found the process dead
    backoff_s: float
    spawned: float  # the new process was forked and exec'd
    starting_done: float  # while_starting returned (it overlaps the process's start-up)
    ready: float  # it answered hello
    hooks_done: float  # after_ready returned (the controller pushes the tables next)

    def summary(self) -> str:
        def ms(t: float) -> float:
            return (t - self.exited) * 1000

        return (f"data plane pid {self.pid} replaces pid {self.pid_before}: "
                f"{ms(self.hooks_done):.0f} ms from exit to hooks done (noticed "
                f"+{ms(self.detected):.0f}, back-off {self.backoff_s * 1000:.0f}, spawned "
                f"+{ms(self.spawned):.0f}, hooks while starting +{ms(self.starting_done):.0f}, "
                f"hello +{ms(self.ready):.0f}, hooks +{ms(self.hooks_done):.0f}) "
                f"[exited={self.exited:.3f} detected={self.detected:.3f} "
                f"spawned={self.spawned:.3f} starting_done={self.starting_done:.3f} "
                f"ready={self.ready:.3f} hooks_done={self.hooks_done:.3f}]")


@dataclass
class DataplaneProcess:
    """One supervised data-plane process and the client that talks to it.

    The hooks let the host follow the process: ``before_start`` runs before
    every start (e.g. clear what a killed DPDK port left on its interface),
    ``while_starting`` right after the process was forked, while it starts
    (work that must not delay a restart: it overlaps the process's own
    start-up; it is given a "still starting" probe to bound its waits, and
    what it raises is logged, not fatal), ``after_ready`` once it answers,
    started or adopted (e.g. give its exception TAP the appliance's
    addresses, if ``while_starting`` could not), ``after_stop`` when it was
    stopped.
    ``on_exit`` is called from a watcher thread as soon as the process exits
    by itself or is killed (never for ``stop``): it must only signal (e.g.
    set the controller's wake event), the restart itself is
    ``restart_if_dead``'s, in the controller's thread.
    """

    argv: list[str]
    endpoint: str
    pidfile: Path
    log_path: Path | None = None
    start_timeout_s: float = 20.0
    before_start: Hook | None = None
    while_starting: StartingHook | None = None
    after_ready: Hook | None = None
    after_stop: Hook | None = None
    on_exit: Hook | None = None
    # A process that ran this long was stable: its death is restarted at once.
    stable_after_s: float = 10.0
    # Back-off of a crash loop: doubles from the first to the maximum.
    backoff_first_s: float = 0.5
    backoff_max_s: float = 10.0
    pid: int | None = None
    restarts: int = 0
    adopted: bool = False  # the running process was adopted, not started by us
    last_restart: RestartTiming | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _backoff_s: float = 0.0  # the next restart's delay (0: at once)
    _started_mono: float | None = None  # when the current process was started
    _watch: ExitWatch | None = field(default=None, repr=False)
    _missed: int = 0

    def __post_init__(self) -> None:
        self.client: DataplaneClient = WatchedClient(self.endpoint, 5.0, self._gone)

    def _gone(self) -> bool:
        """The process this object watches has exited (its watcher saw it)."""
        watch = self._watch
        return watch is not None and watch.fired

    # --- lifecycle -------------------------------------------------------

    def adopt_or_start(self) -> bool:
        """Adopt a running data plane if there is one; else start one.

        Returns True when an existing process was adopted (its tables are still
        in place), False when a fresh one was started.
        """
        pid = self._pid_from_file()
        if pid is not None and _alive(pid) and _comm(pid) != Path(self.argv[0]).name[:15]:
            log.warning("pid file %s names pid %d, which is not %s: ignoring it",
                        self.pidfile, pid, Path(self.argv[0]).name)
            pid = None
        if pid is not None and _alive(pid):
            try:
                self.client.hello()
            except DataplaneError:
                log.warning("pid %d in %s does not answer on %s; restarting it",
                            pid, self.pidfile, self.endpoint)
                terminate_pid(pid)
            else:
                self.pid = pid
                self.adopted = True
                self._started_mono = None  # its age is unknown: count it as stable
                self._watch_exit(pid)
                log.info("adopted running data plane pid %d on %s", pid, self.endpoint)
                if self.after_ready:
                    self.after_ready()
                return True
        self.start()
        return False

    def start(self) -> None:
        self._spawn()
        self._while_starting()
        self._wait_ready()
        if self.after_ready:
            self.after_ready()

    def _while_starting(self) -> None:
        if self.while_starting is None:
            return
        deadline = time.monotonic() + self.start_timeout_s

        def starting() -> bool:
            return time.monotonic() < deadline and self.alive()

        try:
            self.while_starting(starting)
        except Exception:  # after_ready is there to retry; the start goes on
            log.exception("while the data plane started (it goes on)")

    def _spawn(self) -> None:
        """before_start, then fork and exec the data plane (not waiting for it)."""
        self._unwatch()
        # An attempt that fails (here or during start-up) counts as a short run:
        # the next attempt backs off.
        self._started_mono = time.monotonic()
        if self.before_start:
            self.before_start()
        self.pidfile.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(
                self.argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            if self.log_path:
                out.close()  # type: ignore[union-attr]
        self.pid = self._proc.pid
        self.adopted = False
        self._watch_exit(self.pid)
        self.pidfile.write_text(f"{self.pid}\n")
        log.info("started %s (pid %d)", " ".join(self.argv), self.pid)

    def _watch_exit(self, pid: int) -> None:
        self._unwatch()
        self._watch = ExitWatch(pid, self._exited)

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _exited(self) -> None:
        """From the watcher thread: the process is gone."""
        if self.on_exit:
            self.on_exit()

    def _wait_ready(self) -> None:
        """Until the new process answers hello. A socket of its own retries the
        connection every few ms (the client's would wait 100 ms between tries),
        and the process is checked for an early exit meanwhile."""
        deadline = time.monotonic() + self.start_timeout_s
        request = msgpack.packb({"v": PROTOCOL_VERSION, "op": "hello", "seq": 0},
                                use_bin_type=True)
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, READY_RECONNECT_MS)
            sock.connect(self.endpoint)
            sock.send(request)
            while time.monotonic() < deadline:
                if sock.poll(READY_POLL_MS, zmq.POLLIN):
                    reply = msgpack.unpackb(sock.recv(), raw=False)
                    if isinstance(reply, dict):
                        check_version(reply)
                    if not isinstance(reply, dict) or not reply.get("ok"):
                        raise DataplaneError(f"hello refused by the new data plane: {reply!r}")
                    return
                if not self.alive():
                    raise DataplaneError("data plane exited during start-up (see "
                                         f"{self.log_path or 'its stderr'})")
        finally:
            sock.close(linger=0)
        raise DataplaneError(f"data plane did not answer on {self.endpoint} in time")

    @property
    def returncode(self) -> int | None:
        """Exit status of the data plane this object started, once it exited."""
        return self._proc.returncode if self._proc is not None else None

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self.pid is not None and _alive(self.pid)

    def next_backoff_s(self, now: float | None = None) -> float:
        """The delay before restarting the process that just died: none after a
        stable run (or an adopted process, whose age is unknown), else the
        crash loop's back-off."""
        now = time.monotonic() if now is None else now
        if self._started_mono is None or now - self._started_mono >= self.stable_after_s:
            return 0.0
        return self._backoff_s

    def restart_if_dead(self) -> bool:
        """Restart a data plane that exited. True when a restart happened."""
        if self.alive():
            return False
        detected = time.time()
        watch = self._watch
        exited = watch.exited_at if watch is not None and watch.exited_at is not None \
            else detected
        code = self._proc.returncode if self._proc else None
        delay = self.next_backoff_s()
        # A process that dies again before it is stable waits longer each time.
        self._backoff_s = min(max(delay * 2, self.backoff_first_s), self.backoff_max_s)
        log.error("data plane pid %s exited (status %s); restarting in %.1fs",
                  self.pid, code, delay)
        if delay:
            time.sleep(delay)
        pid_before = self.pid
        self.client.close()
        self._spawn()
        spawned = time.time()
        self._while_starting()
        starting_done = time.time()
        self._wait_ready()
        ready = time.time()
        if self.after_ready:
            self.after_ready()
        assert self.pid is not None
        self.last_restart = RestartTiming(pid_before, self.pid, exited, detected, delay,
                                          spawned, starting_done, ready, time.time())
        log.info("%s", self.last_restart.summary())
        self.restarts += 1
        return True

    def check_responsive(self, allowed_misses: int = 3) -> bool:
        """Ask the data plane for hello; one that misses ``allowed_misses`` in a
        row is wedged and gets SIGKILL, so that ``restart_if_dead`` restarts it
        (its pinned maps keep the attached program forwarding meanwhile)."""
        try:
            self.client.hello()
        except DataplaneError as err:
            self._missed += 1
            log.warning("data plane pid %s did not answer (%d/%d): %s",
                        self.pid, self._missed, allowed_misses, err)
            if self._missed >= allowed_misses and self.pid is not None:
                log.error("data plane pid %s is wedged: killing it", self.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self._missed = 0
            return False
        self._missed = 0
        return True

    def stop(self) -> None:
        """SIGTERM the data plane (it detaches and unpins) and wait for it."""
        self._unwatch()  # our own doing: no on_exit
        if self.pid is not None:
            if self._proc is not None:
                stop_child(self._proc)
            else:
                terminate_pid(self.pid)
        self.client.close()
        self.pidfile.unlink(missing_ok=True)
        self.pid = None
        if self.after_stop:
            self.after_stop()

    def _pid_from_file(self) -> int | None:
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still "exists"; treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def stop_child(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """SIGTERM a child, SIGKILL it if it has not exited after ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def terminate_pid(pid: int, timeout_s: float = 10.0) -> None:
    """The same for a process that is not our child (an adopted data plane)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _comm(pid: int) -> str:
    """The process's command name (15 characters at most), '' if unreadable."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
