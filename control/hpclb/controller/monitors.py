"""The control plane's eyes on the backends: health probes and the node
agents' telemetry, each in its own thread, both delivering onto one queue
that the controller drains (and a wake-up event, so it reacts at once). Both
threads enter the appliance's network namespace (``appliance.netns``) first:
probes leave from there and the telemetry receiver binds there, where the
agents on the backends' network reach the appliance (in the lab, its address
198.18.0.3 exists only inside the appliance namespace).

Events (hpclb.controller.events): ``ProbeVerdict`` and ``TelemetryArrived``, the latter
stamped when the receiver took the message. The node id of a telemetry
message has already been checked against the CURVE key that sent it
(hpclb.telemetry.receiver).

Configuration changes are transactions (:meth:`Monitors.prepare`, then
:meth:`Monitors.commit` or :meth:`Monitors.abort`): everything a new
configuration needs (a receiver bound, key files read, a probe thread with
its sockets) is acquired in ``prepare``, which changes nothing in force and
raises if anything is missing; ``commit`` cannot fail on those grounds.

The controller reads the threads' state without waiting on them (snapshots
they refresh themselves): a stalled probe loop or a receiver under a flood
must not stall the status or the decisions.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hpclb.config import HpclbConfig, TelemetryConfig
from hpclb.controller.events import Event, TelemetryArrived
from hpclb.health.thread import ProbeThread, Targets
from hpclb.telemetry.message import TelemetryMessage
from hpclb.telemetry.receiver import (
    AgentIdentity,
    ReceiverThread,
    TelemetryReceiver,
    load_allow_list,
)

log = logging.getLogger(__name__)

MAX_DRAIN = 100_000  # events handled per loop turn at most
# A receiver snapshot older than this means its loop is not turning: the
# appliance cannot hear its agents now.
SNAPSHOT_STALE_S = 1.5


def probe_targets(config: HpclbConfig) -> Targets:
    return {b.name: (str(b.address), pool.probe)
            for pool in config.pools.values() if pool.probe is not None
            for b in pool.backends}


def _receiver_settings(t: TelemetryConfig, config: HpclbConfig) -> tuple[Any, ...]:
    """What a running receiver cannot change without being rebuilt."""
    return (t.endpoint(config.appliance.management_address), t.server_key,
            t.handshake_timeout_s, t.max_unauthenticated, t.max_rate_per_agent)


class MonitorError(Exception):
    """A configuration's monitors cannot be set up (the message says why)."""


@dataclass
class MonitorPlan:
    """What :meth:`Monitors.prepare` acquired or checked for a configuration."""

    new_probes: ProbeThread | None = None
    new_receiver: ReceiverThread | None = None
    receiver_settings: tuple[Any, ...] | None = None
    reload_allow_list: bool = False
    stop_receiver: bool = False
    stop_probes: bool = False
    restart_needed: list[str] = field(default_factory=list)


class Monitors:
    def __init__(self, wake: threading.Event, netns: str | None = None) -> None:
        self.wake = wake
        self.netns = netns
        self.events: queue.Queue[Event] = queue.Queue()
        self.probes: ProbeThread | None = None
        self.telemetry: ReceiverThread | None = None
        self._receiver_settings: tuple[Any, ...] | None = None

    def _on_message(self, msg: TelemetryMessage, identity: AgentIdentity) -> None:
        self.events.put(TelemetryArrived(msg, time.monotonic(), time.time()))
        self.wake.set()

    # --- configuration, as a transaction ------------------------------------

    def prepare(self, config: HpclbConfig) -> MonitorPlan:
        """Acquire what ``config`` needs and is not running yet; check what it
        changes. Nothing in force changes. MonitorError if something is missing
        (whatever was acquired is released first)."""
        plan = MonitorPlan()
        try:
            self._prepare(config, plan)
        except BaseException as err:
            self.abort(plan)
            if isinstance(err, Exception) and not isinstance(err, MonitorError):
                raise MonitorError(f"{type(err).__name__}: {err}") from err
            raise
        return plan

    def _prepare(self, config: HpclbConfig, plan: MonitorPlan) -> None:
        if probe_targets(config):
            if self.probes is None:
                plan.new_probes = ProbeThread(self.events, self.wake, self.netns)
                plan.new_probes.start()
        elif self.probes is not None:
            plan.stop_probes = True
        t = config.telemetry
        if t is None:
            plan.stop_receiver = self.telemetry is not None
            return
        settings = _receiver_settings(t, config)
        plan.receiver_settings = settings
        if self.telemetry is None:
            receiver = TelemetryReceiver(
                settings[0], t.server_key, t.allow_dir, self._on_message,
                handshake_timeout_s=t.handshake_timeout_s,
                max_unauthenticated=t.max_unauthenticated,
                max_rate_per_agent=t.max_rate_per_agent)
            thread = ReceiverThread(receiver, self.netns)
            try:
                thread.start()
            except Exception as err:
                raise MonitorError(f"telemetry: cannot listen on {settings[0]}: {err}") from err
            plan.new_receiver = thread
            return
        load_allow_list(t.allow_dir)  # AllowListError: the list in force stays
        plan.reload_allow_list = True
        if settings != self._receiver_settings:
            plan.restart_needed.append("telemetry bind, server_key or limits")

    def commit(self, plan: MonitorPlan, config: HpclbConfig) -> None:
        """Put ``plan`` in force: swap in what it acquired, follow the targets."""
        if plan.new_probes is not None:
            self.probes = plan.new_probes
        if plan.stop_probes and self.probes is not None:
            self._stop(self.probes)
            self.probes = None
        if self.probes is not None:
            self.probes.sync(probe_targets(config))
        if plan.new_receiver is not None:
            self.telemetry = plan.new_receiver
            self._receiver_settings = plan.receiver_settings
            log.info("telemetry: listening on %s, %d agent keys allowed",
                     self.telemetry.endpoint,
                     len(self.telemetry.receiver.allowed_nodes()))
        if plan.stop_receiver and self.telemetry is not None:
            self._stop(self.telemetry)
            self.telemetry = None
            self._receiver_settings = None
        if plan.reload_allow_list and self.telemetry is not None:
            try:
                n = self.telemetry.reload_allow_list()
                log.info("telemetry: allow-list reloaded, %d agent keys", n)
            except Exception as err:  # changed between prepare and now: the old list stays
                log.error("telemetry: allow-list reload failed, keeping the old one: %s", err)
        for what in plan.restart_needed:
            log.warning("%s changed: restart hpclb to apply it", what)

    def abort(self, plan: MonitorPlan) -> None:
        """Release what ``prepare`` acquired for a configuration not taken."""
        for thread in (plan.new_probes, plan.new_receiver):
            if thread is not None:
                self._stop(thread)
        plan.new_probes = plan.new_receiver = None

    # --- what the controller reads ------------------------------------------

    def drain(self) -> list[Event]:
        out: list[Event] = []
        for _ in range(MAX_DRAIN):
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                break
        return out

    def rtt_ms(self, backend: str) -> float | None:
        return self.probes.rtts.get(backend) if self.probes else None

    def _telemetry_snapshot(self) -> dict[str, Any] | None:
        return self.telemetry.snapshot() if self.telemetry is not None else None

    def _probe_snapshot(self) -> dict[str, Any] | None:
        return self.probes.snapshot() if self.probes is not None else None

    def heard_since(self, now: float) -> float | None:
        """Monotonic time since which the receiver could hear every agent (no
        trouble of its own); None while it cannot (its loop is not turning)."""
        snap = self._telemetry_snapshot()
        if snap is None:
            return -math.inf
        if now - float(snap.get("at", now)) > SNAPSHOT_STALE_S:
            return None
        trouble = snap.get("trouble")
        return float(trouble[0]) if trouble else -math.inf

    def alarms(self) -> list[dict[str, Any]]:
        """Local faults now: {"source", "message"} each."""
        out = []
        for source, snap in (("probes", self._probe_snapshot()),
                             ("telemetry", self._telemetry_snapshot())):
            if snap is not None and snap.get("alarm"):
                out.append({"source": source, "message": snap["alarm"]})
        return out

    def probe_verdicts(self) -> dict[str, dict[str, Any]]:
        """Per backend: the probes' view (unknown, damping) for the status."""
        snap = self._probe_snapshot()
        return dict(snap.get("backends", {})) if snap else {}

    def counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if (t := self._telemetry_snapshot()) is not None:
            out["telemetry"] = t.get("counters", {})
        if (p := self._probe_snapshot()) is not None:
            out["probes"] = p.get("stats", {})
        return out

    # --- stopping ---------------------------------------------------------------

    @staticmethod
    def _stop(thread: ProbeThread | ReceiverThread) -> None:
        try:
            thread.stop()
        except Exception as err:
            log.warning("stopping %s: %s", type(thread).__name__, err)

    def stop(self) -> None:
        for thread in (self.probes, self.telemetry):
            if thread is not None:
                self._stop(thread)
        self.probes = self.telemetry = None
