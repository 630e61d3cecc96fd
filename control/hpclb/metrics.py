"""Prometheus metrics of a running appliance (``appliance.metrics``).

The exporter's HTTP thread never talks to the data plane or touches the
controller's state: it turns the controller's latest status snapshot (the one
behind ``hpclb status``, rewritten every second, data-plane counters included)
into metric families at each scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
        yield from _telemetry(status.get("telemetry"))
        yield from _dataplane(status.get("dataplane_stats"))


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


def serve(address: str, snapshot: Callable[[], Status | None]) -> tuple[object, object]:
    """Starts the exporter on ``address`` ("host:port"); returns (server, thread)."""
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot))
    return start_http_server(int(port), addr=host or "0.0.0.0", registry=registry)
