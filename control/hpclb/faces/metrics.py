"""Prometheus metrics of a running appliance (``appliance.metrics``).

The exporter's HTTP thread never talks to the data plane or touches the
controller's state: it turns the controller's latest status snapshot (the one
behind ``hpclb status``, rewritten every second, data-plane counters included)
into metric families at each scrape.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hpclb.config import HpclbConfig
from hpclb.controller import StartError
from hpclb.host.netns import inside

log = logging.getLogger(__name__)

Status = Mapping[str, Any]


class StatusCollector(Collector):
    def __init__(self, snapshot: Callable[[], Status | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        status = self.snapshot()
        if not status:
            return
        up = GaugeMetricFamily("hpclb_backend_up", "1 when the backend's health verdict is up",
                               labels=["backend"])
        for name, h in sorted(status.get("health", {}).items()):
            up.add_metric([name], 1.0 if h.get("up") else 0.0)
        yield up
        weight = GaugeMetricFamily("hpclb_backend_weight", "Weight the ring is built with",
                                   labels=["pool", "backend"])
        for pool, members in sorted(status.get("weights", {}).items()):
            for name, w in sorted(members.items()):
                weight.add_metric([pool, name], float(w))
        yield weight
        rejected = CounterMetricFamily("hpclb_samples_rejected",
                                       "Telemetry samples rejected, by reason",
                                       labels=["pool", "reason"])
        for pool, reasons in sorted(status.get("samples_rejected", {}).items()):
            for reason, n in sorted(reasons.items()):
                rejected.add_metric([pool, reason], float(n))
        yield rejected
        yield from _local_faults(status)
        yield from _telemetry(status.get("telemetry"))
        yield from _dataplane(status.get("dataplane_stats"))


def _local_faults(status: Status) -> Iterator[Metric]:
    """What the appliance's own side suffers (alarms), and what it decides
    without the backends' say (damping, unknown verdicts)."""
    alarm = GaugeMetricFamily("hpclb_alarm", "1 while a local fault holds the verdicts back "
                              "(probes, telemetry, control loop)", labels=["source"])
    active = {a.get("source") for a in status.get("alarms", [])}
    for source in ("probes", "telemetry", "loop"):
        alarm.add_metric([source], 1.0 if source in active else 0.0)
    yield alarm
    damped = GaugeMetricFamily("hpclb_backend_damped",
                               "1 while flap damping holds the backend out", labels=["backend"])
    release = GaugeMetricFamily("hpclb_backend_damping_release_timestamp_seconds",
                                "When damping is expected to release the backend (Unix time)",
                                labels=["backend"])
    unknown = GaugeMetricFamily("hpclb_backend_verdict_unknown",
                                "1 while the backend's last probe or heartbeat could not be "
                                "judged for a local reason", labels=["backend"])
    for name, h in sorted(status.get("health", {}).items()):
        d = h.get("damping") or {}
        damped.add_metric([name], 1.0 if d.get("suppressed") else 0.0)
        if d.get("release_at") is not None:
            release.add_metric([name], float(d["release_at"]))
        unknown.add_metric([name], 1.0 if h.get("unknown") else 0.0)
    yield damped
    yield release
    yield unknown


def _telemetry(t: Mapping[str, Any] | None) -> Iterator[Metric]:
    if not t:
        return
    yield CounterMetricFamily("hpclb_telemetry_accepted", "Telemetry messages accepted",
                              value=float(t.get("accepted", 0)))
    keys = CounterMetricFamily("hpclb_telemetry_rejected_keys",
                               "Agent connections refused: key not on the allow-list",
                               labels=["key_id"])
    for key_id, n in sorted(t.get("rejected_keys", {}).items()):
        keys.add_metric([key_id], float(n))
    yield keys
    malformed = CounterMetricFamily("hpclb_telemetry_malformed",
                                    "Telemetry messages dropped as malformed", labels=["reason"])
    for reason, n in sorted(t.get("malformed", {}).items()):
        malformed.add_metric([reason], float(n))
    yield malformed
    limited = CounterMetricFamily("hpclb_telemetry_rate_limited",
                                  "Messages dropped: the agent sent above its rate limit",
                                  labels=["node"])
    for node, n in sorted(t.get("rate_limited", {}).items()):
        limited.add_metric([node], float(n))
    yield limited
    conns = GaugeMetricFamily("hpclb_telemetry_connections",
                              "Open telemetry connections by state", labels=["state"])
    for state in ("pending", "authenticated"):
        if state in t.get("connections", {}):
            conns.add_metric([state], float(t["connections"][state]))
    yield conns
    for name in ("handshake_timeouts", "accept_failures", "listener_pauses"):
        if name in t.get("connections", {}):
            yield CounterMetricFamily(f"hpclb_telemetry_{name}", f"Telemetry receiver: {name}",
                                      value=float(t["connections"][name]))


def _dataplane(d: Mapping[str, Any] | None) -> Iterator[Metric]:
    if not d:
        return
    events = CounterMetricFamily("hpclb_dataplane_packets",
                                 "Data-plane packets by outcome (LB_STAT_NAMES)",
                                 labels=["counter"])
    for name, n in d.get("counters", {}).items():
        events.add_metric([name], float(n))
    yield events
    for kind, rows in (("vip", d.get("vips", [])), ("backend", d.get("backends", []))):
        packets = CounterMetricFamily(f"hpclb_{kind}_packets", f"Packets forwarded per {kind} id",
                                      labels=[f"{kind}_id"])
        octets = CounterMetricFamily(f"hpclb_{kind}_bytes", f"Bytes forwarded per {kind} id",
                                     labels=[f"{kind}_id"])
        for row in rows:
            packets.add_metric([str(row[0])], float(row[1]))
            octets.add_metric([str(row[0])], float(row[2]))
        yield packets
        yield octets
    ports = CounterMetricFamily("hpclb_port_packets", "NIC counters of the DPDK ports",
                                labels=["port", "counter"])
    for index, counters in enumerate(d.get("ports", [])):
        for name, n in counters.items():
            ports.add_metric([str(index), name], float(n))
    yield ports
    yield from _conns(d.get("conns"))


def _conns(c: Mapping[str, Any] | None) -> Iterator[Metric]:
    """NAT mode's connection table, from a data plane that has one. Its events
    (conn_new, conn_evict, drop_conn_full...) are packet counters, exported
    with the others as hpclb_dataplane_packets{counter=...}."""
    if c is None:
        return
    yield GaugeMetricFamily("hpclb_conn_table_capacity",
                            "Connection-table entries (two per NAT connection)",
                            value=float(c.get("capacity", 0)))
    yield GaugeMetricFamily("hpclb_conn_table_entries", "Connection-table entries in use",
                            value=float(c.get("entries", 0)))
    states = GaugeMetricFamily("hpclb_conn_table_connections", "NAT connections by state",
                               labels=["state"])
    for state, n in c.get("by_state", {}).items():
        states.add_metric([state], float(n))
    yield states
    yield GaugeMetricFamily("hpclb_snat_ports_in_use", "NAT connections holding a SNAT port",
                            value=float(c.get("snat_ports_in_use", 0)))
    yield CounterMetricFamily("hpclb_conn_table_expired",
                              "NAT connections removed by their idle timeout",
                              value=float(c.get("expired", 0)))


class Exporter:
    """The exporter's HTTP server, bound at construction (OSError when the
    address is taken or not the appliance's): the control plane binds it
    before it touches a data plane, and closes it when it stops or replaces it."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], Status | None],
                 netns: str | None = None) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatusCollector(snapshot))
        # The listening socket belongs to the namespace it is created in: the
        # appliance's, where its management address lives (the serving thread
        # may run anywhere).
        with inside(netns) if netns else contextlib.nullcontext():
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.address = f"{host}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class MetricsFace:
    """The exporter as a face of the controller (``appliance.metrics``): the
    new address is bound when a configuration is prepared, so a taken port
    refuses the start or the reload; the old exporter closes only when the new
    configuration is put in force."""

    def __init__(self) -> None:
        self.exporter: Exporter | None = None

    def prepare(self, config: HpclbConfig, status: Callable[[], Status | None]) -> _MetricsChange:
        endpoint = config.appliance.metrics_endpoint
        address = None if endpoint is None else f"{endpoint[0]}:{endpoint[1]}"
        current = self.exporter.address if self.exporter else None
        if endpoint is None or address == current:
            return _MetricsChange(self, None, replace=address != current)
        try:
            exporter = Exporter(endpoint[0], endpoint[1], status, config.appliance.netns)
        except OSError as err:
            raise StartError(f"appliance.metrics: cannot listen on {address}: "
                             f"{err.strerror or err}") from err
        return _MetricsChange(self, exporter, replace=True)

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None


class _MetricsChange:
    def __init__(self, face: MetricsFace, new: Exporter | None, replace: bool) -> None:
        self.face, self.new, self.replace = face, new, replace

    def commit(self) -> None:
        if self.replace:
            self.face.close()
            self.face.exporter = self.new
            if self.new is not None:
                log.info("metrics: Prometheus exporter on %s", self.new.address)

    def abort(self) -> None:
        if self.new is not None:
            self.new.close()
