"""The controller's handle on BGP: decide (decision.py), write the speaker's
files, reconfigure it, read its sessions back, for the status.

Nothing here blocks for long: a command on BIRD's local socket takes
milliseconds, and one that fails (BIRD not running yet, restarting) is
retried every RETRY_S from the loop while the files already say what to
announce (a BIRD started later reads them itself).

Across a control-plane restart the speaker keeps announcing what it
announced: the data plane forwards meanwhile (it outlives `hpclb run`), and
the next start adopts the announcements from vips.conf before its first
decision, so a restart withdraws nothing that can still be served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpclb.announce import bird
from hpclb.announce.decision import Announcements, Inputs
from hpclb.config.bgp import BgpConfig

log = logging.getLogger(__name__)

RETRY_S = 2.0  # a failed reconfiguration is tried again this often
SESSIONS_S = 1.0  # the sessions are read back this often (the status's rhythm)
# The longest the loop waits for BIRD (a BIRD that accepts and never answers
# must not stall the loop for long); it answers these in milliseconds.
CONFIGURE_TIMEOUT_S = 3.0
SHOW_TIMEOUT_S = 1.0
# A fault raised as an alarm once it lasts this long (a BIRD starting after
# hpclb, a session being established, are not faults).
ALARM_AFTER_S = 10.0


class Speaker:
    def __init__(self, config: BgpConfig) -> None:
        self.config = config
        # The liveness interface the VIPs' routes go through: the configured
        # one until the controller says which the running data plane holds
        # (``set_device``); None: blackhole routes.
        self.device = config.alive_interface
        # BFD session states by peer address (`show bfd sessions`), when enabled.
        self.bfd: dict[str, str] = {}
        self.announcements = Announcements(config.damping)
        self.sessions: list[bird.Session] = []
        self.error: str | None = None  # the speaker's last fault, None when it answers
        # The files changed since BIRD last took them (at first: BIRD is told
        # once what this start decided, whatever it held)
        self.pending = True
        self._last_try = float("-inf")
        self._last_sessions = float("-inf")
        self._error_since: float | None = None  # monotonic, while ``error`` holds
        # Monotonic, while VIPs are announced and an established session
        # exports none of them (e.g. the liveness interface is missing).
        self._unexported_since: float | None = None
        self.configures = 0

    @property
    def bird_conf(self) -> Path:
        return self.config.config_dir / "bird.conf"

    @property
    def vips_conf(self) -> Path:
        return self.config.config_dir / "vips.conf"

    def _write(self) -> bool:
        """Write both files as they should be now; True when either changed.
        OSError when they cannot be written."""
        folder = self.config.config_dir
        if not folder.is_dir():
            # Shared with the speaker's group (hpclb-bird.service: Group=hpclb):
            # BIRD reads the files and creates its control socket here.
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o770)
        changed = bird.write_if_changed(self.vips_conf, bird.render_vips(
            self.config, self.announcements.announced(), self.device))
        changed |= bird.write_if_changed(self.bird_conf,
                                         bird.render_bird(self.config, self.vips_conf))
        return changed

    def prepare(self) -> None:
        """Adopt what vips.conf announces (a speaker kept announcing across a
        control-plane restart), then write both files. OSError when they
        cannot be written (the loop tries again)."""
        now, wall = time.monotonic(), time.time()
        try:
            kept = bird.parse_vips(self.vips_conf.read_text())
        except (OSError, ValueError):
            kept = set()
        self.announcements.adopt(kept, now, wall)
        if kept:
            log.info("bgp: the speaker announces %s from before this start: kept until "
                     "the first decision", ", ".join(sorted(kept)))
        self._write()

    def set_device(self, device: str | None) -> None:
        """The liveness interface the running data plane holds (from its
        command line), None when it holds none. A data plane started before
        the section was added or changed, or by an older hpclb, holds none or
        another: routes through an absent interface would announce nothing,
        so the routes follow the data plane."""
        if device == self.device:
            return
        log.info("bgp: the VIPs' routes go %s", f"through {device}" if device
                 else "nowhere (blackhole): the data plane holds no liveness interface")
        self.device = device
        self.pending, self._last_try = True, float("-inf")

    def reconfigure(self, config: BgpConfig) -> None:
        """A reload: new peers, attributes or damping; sessions whose settings
        did not change stay up (BIRD restarts only changed protocols)."""
        self.config = config
        self.announcements.reconfigure(config.damping)
        try:
            self.pending |= self._write()
        except OSError as err:
            self.error, self.pending = f"cannot write {config.config_dir}: {err}", True

    def update(self, inputs: Inputs, now: float, wall: float) -> None:
        """One decision (every loop turn); the speaker is told at once when the
        announced set changed, and retried while it did not take it."""
        before = {a: i.state for a, i in self.announcements.items.items()}
        if self.announcements.update(inputs, now, wall):
            self.pending = True
            self._last_try = float("-inf")  # now, whatever the retry rhythm
        for address, item in self.announcements.items.items():
            if before.get(address) is not item.state:
                log.info("bgp: %s %s: %s", address, item.state.value, item.reason)
        if self.pending and now - self._last_try >= RETRY_S:
            self._apply(now)
        if now - self._last_sessions >= SESSIONS_S:
            self._read_sessions(now)

    def _apply(self, now: float) -> None:
        """The files, then `configure`; a failure is kept and retried."""
        self._last_try = now
        try:
            self._write()
            bird.configure(self.config.control_socket, CONFIGURE_TIMEOUT_S)
        except (bird.BirdError, OSError) as err:
            text = str(err) if isinstance(err, bird.BirdError) else \
                f"cannot write {self.config.config_dir}: {err}"
            if self.error != text:
                log.error("bgp: the speaker did not take the new announcements (retrying "
                          "every %g s): %s", RETRY_S, text)
            self.error = text
            return
        self.pending = False
        self.error = None
        self.configures += 1

    def _read_sessions(self, now: float) -> None:
        self._last_sessions = now
        try:
            sessions = bird.show_protocols(self.config.control_socket, SHOW_TIMEOUT_S)
        except bird.BirdError as err:
            if not (self.pending and self.error):  # the failed apply says more
                self.error = str(err)
            self.sessions = []
            return
        self._read_bfd()
        old = {s.name: s.bgp_state for s in self.sessions}
        for s in sessions:
            if old.get(s.name) != s.bgp_state and (s.name in old or s.bgp_state):
                log.info("bgp: session %s (%s AS %s): %s", s.name, s.neighbor,
                         s.neighbor_as, s.bgp_state or s.state)
        self.sessions = sessions
        if not self.pending:
            self.error = None

    def _read_bfd(self) -> None:
        """The BFD sessions' states, when BFD is on (one more command on the
        local socket, each SESSIONS_S)."""
        if not self.config.bfd.enabled:
            self.bfd = {}
            return
        try:
            self.bfd = bird.show_bfd(self.config.control_socket, SHOW_TIMEOUT_S)
        except bird.BirdError as err:
            log.debug("bgp: show bfd sessions: %s", err)
            self.bfd = {}

    def withdraw_all(self, inputs: Inputs, wait: bool = True) -> None:
        """Before the data plane stops: withdraw every VIP, then give the
        UPDATEs ``withdraw_wait_s`` to reach the routers (``wait``)."""
        had = bool(self.announcements.announced())
        stop = Inputs(inputs.dataplane_fault, inputs.pools_of, inputs.in_service,
                      inputs.never, stopping=True)
        now = time.monotonic()
        self.update(stop, now, time.time())
        if self.pending:
            self._apply(now)
        if had and not self.pending and wait:
            log.info("bgp: every VIP withdrawn; waiting %g s before the data plane stops",
                     self.config.withdraw_wait_s)
            time.sleep(self.config.withdraw_wait_s)
        elif had:
            log.error("bgp: could not withdraw the VIPs before stopping (%s): the routers "
                      "keep them until the sessions' hold time runs out", self.error)

    def alarms(self, now: float, wall: float) -> list[dict[str, Any]]:
        """Faults that lasted ALARM_AFTER_S: the speaker unreachable or refusing
        its configuration, a session not established, VIPs announced but not
        exported."""
        if self.error is None:
            self._error_since = None
        elif self._error_since is None:
            self._error_since = now
        out = []
        if self._error_since is not None and now - self._error_since >= ALARM_AFTER_S:
            out.append({"source": "bgp", "message": f"BGP speaker: {self.error}"})
        for s in self.sessions:
            if s.bgp_state != "Established" and s.since is not None \
                    and wall - s.since >= ALARM_AFTER_S:
                out.append({"source": "bgp",
                            "message": f"BGP session {s.name} ({s.neighbor}) "
                                       f"{s.bgp_state or s.state} for {wall - s.since:.0f}s"})
        # Announced, told to BIRD, yet not exported: BIRD holds no valid
        # route, e.g. the data plane could not create its liveness interface
        # (its log says why) or BIRD runs in another namespace.
        silent = [s.name for s in self.sessions
                  if s.bgp_state == "Established" and s.routes_exported == 0]
        if silent and self.announcements.announced() and not self.pending:
            if self._unexported_since is None:
                self._unexported_since = now
        else:
            self._unexported_since = None
        if self._unexported_since is not None and now - self._unexported_since >= ALARM_AFTER_S:
            why = (f": is the liveness interface {self.device} missing in BIRD's namespace? "
                   "(the data plane's log says whether it created it)" if self.device else "")
            out.append({"source": "bgp",
                        "message": f"BGP: VIPs announced but BIRD exports none to "
                                   f"{', '.join(silent)}{why}"})
        return out

    def _session_report(self, session: bird.Session, wall: float) -> dict[str, Any]:
        out = session.report(wall)
        if self.config.bfd.enabled:
            # BFD's state for the peer (Up, Down, Init, AdminDown), None
            # while BIRD has no BFD session to it.
            out["bfd"] = self.bfd.get(session.neighbor or "")
        return out

    def report(self, now: float, wall: float) -> dict[str, Any]:
        return {
            "speaker": self.config.speaker, "socket": str(self.config.control_socket),
            "local_asn": self.config.local_asn, "router_id": str(self.config.router_id),
            "reachable": self.error is None, "error": self.error, "pending": self.pending,
            "configures": self.configures,
            "alive_interface": self.device,
            "bfd": self.config.bfd.enabled,
            "sessions": [self._session_report(s, wall) for s in self.sessions],
            "announcements": self.announcements.report(now),
        }


def inputs_for(vip_pools: Mapping[str, tuple[str, ...]], in_service: Mapping[str, int],
               dataplane_fault: str | None, config: BgpConfig) -> Inputs:
    """The decision's inputs from the controller's view."""
    never = frozenset(a for a in vip_pools if not config.announced(a))
    return Inputs(dataplane_fault, dict(vip_pools), dict(in_service), never)
