"""Start, adopt, watch and restart the data-plane process.

The data plane runs in its own session (``start_new_session``) so that it
outlives the control plane: if ``hpclb run`` dies, packets keep flowing with
the last tables, and the next ``hpclb run`` adopts the running process (its
pid file names it and it answers hello on the socket) instead of starting a
new one. A data plane that exits is restarted with a growing back-off and the
controller pushes its tables again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpclb.dataplane.client import DataplaneClient, DataplaneError

log = logging.getLogger("hpclb.supervisor")

REPO_ROOT = Path(__file__).resolve().parents[3]


def find_binary(name: str, env_var: str, build_path: str) -> str:
    """A data-plane binary: $ENV_VAR, the source tree's build, or $PATH."""
    for path in (os.environ.get(env_var), str(REPO_ROOT / build_path)):
        if path and os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"{name} not found: run ./bootstrap (make -C dataplane)")


def find_xdp_daemon() -> str:
    return find_binary("hpclb-xdp", "HPCLB_XDP_BIN", "dataplane/build/hpclb-xdp")


Hook = Callable[[], None]


@dataclass
class DataplaneProcess:
    """One supervised data-plane process and the client that talks to it.

    The hooks let the host follow the process: ``before_start`` runs before
    every start (e.g. clear what a killed DPDK port left on its interface),
    ``after_ready`` once it answers, started or adopted (e.g. give its exception
    TAP the appliance's addresses), ``after_stop`` when it was stopped.
    """

    argv: list[str]
    endpoint: str
    pidfile: Path
    log_path: Path | None = None
    start_timeout_s: float = 20.0
    before_start: Hook | None = None
    after_ready: Hook | None = None
    after_stop: Hook | None = None
    pid: int | None = None
    restarts: int = 0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _backoff_s: float = 0.5
    _missed: int = 0

    def __post_init__(self) -> None:
        self.client = DataplaneClient(self.endpoint, timeout_s=5.0)

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
                log.info("adopted running data plane pid %d on %s", pid, self.endpoint)
                if self.after_ready:
                    self.after_ready()
                return True
        self.start()
        return False

    def start(self) -> None:
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
        self.pidfile.write_text(f"{self.pid}\n")
        log.info("started %s (pid %d)", " ".join(self.argv), self.pid)
        self._wait_ready()
        if self.after_ready:
            self.after_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise DataplaneError(
                    f"data plane exited during start-up (see {self.log_path or 'its stderr'})"
                )
            try:
                self.client.hello()
                return
            except DataplaneError:
                time.sleep(0.1)
        raise DataplaneError(f"data plane did not answer on {self.endpoint} in time")

    @property
    def returncode(self) -> int | None:
        """Exit status of the data plane this object started, once it exited."""
        return self._proc.returncode if self._proc is not None else None

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self.pid is not None and _alive(self.pid)

    def restart_if_dead(self) -> bool:
        """Restart a data plane that exited. True when a restart happened."""
        if self.alive():
            self._backoff_s = 0.5
            return False
        code = self._proc.returncode if self._proc else None
        log.error("data plane pid %s exited (status %s); restarting in %.1fs",
                  self.pid, code, self._backoff_s)
        time.sleep(self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, 10.0)
        self.client.close()
        self.start()
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
