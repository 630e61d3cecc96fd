"""The control plane's eyes on the backends: health probes and the node
agents' telemetry, each in its own thread, both delivering onto one queue
that the controller drains (and a wake-up event, so it reacts at once). Both
threads enter the appliance's network namespace (``appliance.netns``) first:
probes leave from there and the telemetry receiver binds there, where the
agents on the backends' network reach the appliance (in the lab, its address
198.18.0.3 exists only inside the appliance namespace).

Events: ``("probe", Transition)`` and ``("telemetry", TelemetryMessage,
monotonic, wall)``. The node id of a telemetry message has already been
checked against the CURVE key that sent it (telemetry_receiver).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from hpclb.config import HpclbConfig
from hpclb.probe_thread import ProbeThread, Targets
from hpclb.telemetry import TelemetryMessage
from hpclb.telemetry_receiver import AgentIdentity, ReceiverThread, TelemetryReceiver

log = logging.getLogger("hpclb.monitoring")

MAX_DRAIN = 100_000  # events handled per loop turn at most


def probe_targets(config: HpclbConfig) -> Targets:
    return {b.name: (str(b.address), pool.probe)
            for pool in config.pools.values() if pool.probe is not None
            for b in pool.backends}


class Monitors:
    def __init__(self, wake: threading.Event) -> None:
        self.wake = wake
        self.events: queue.Queue[Any] = queue.Queue()
        self.probes: ProbeThread | None = None
        self.telemetry: ReceiverThread | None = None
        self._telemetry_bind: str | None = None

    def _on_message(self, msg: TelemetryMessage, identity: AgentIdentity) -> None:
        self.events.put(("telemetry", msg, time.monotonic(), time.time()))
        self.wake.set()

    def sync(self, config: HpclbConfig) -> None:
        """Start what the configuration asks for and follow its changes."""
        targets = probe_targets(config)
        if targets and self.probes is None:
            self.probes = ProbeThread(self.events, self.wake, config.appliance.netns)
            self.probes.start()
        if self.probes is not None:
            self.probes.sync(targets)
        t = config.telemetry
        if t is not None and self.telemetry is None:
            receiver = TelemetryReceiver(t.bind, t.server_key, t.allow_dir, self._on_message)
            self.telemetry = ReceiverThread(receiver, config.appliance.netns)
            self.telemetry.start()
            self._telemetry_bind = t.bind
            log.info("telemetry: listening on %s, %d agent keys allowed",
                     self.telemetry.endpoint, len(receiver.allowed_nodes()))
        elif t is not None and self.telemetry is not None:
            if t.bind != self._telemetry_bind:
                log.warning("telemetry.bind changed: restart hpclb to apply it")
            try:
                n = self.telemetry.reload_allow_list()
                log.info("telemetry: allow-list reloaded, %d agent keys", n)
            except Exception as err:  # the list in force stays
                log.error("telemetry: allow-list reload failed, keeping the old one: %s", err)

    def drain(self) -> list[Any]:
        out = []
        for _ in range(MAX_DRAIN):
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                break
        return out

    def rtt_ms(self, backend: str) -> float | None:
        return self.probes.rtts.get(backend) if self.probes else None

    def counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            if self.telemetry is not None:
                out["telemetry"] = self.telemetry.counters()
            if self.probes is not None:
                out["probes"] = self.probes.stats()
        except Exception as err:  # a report is not worth stopping the loop
            log.debug("monitor counters unavailable: %s", err)
        return out

    def stop(self) -> None:
        for thread in (self.probes, self.telemetry):
            if thread is not None:
                try:
                    thread.stop()
                except Exception as err:
                    log.warning("stopping %s: %s", type(thread).__name__, err)
        self.probes = self.telemetry = None
