"""The Prometheus exporter: a status snapshot, served over real HTTP, scraped
and parsed as Prometheus would."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hpclb.faces import metrics

STATUS: dict[str, Any] = {
    "health": {"b1": {"up": True},
               "b2": {"up": False, "unknown": True,
                      "damping": {"suppressed": True, "penalty": 2600.0,
                                  "release_at": 1_900_000_000.5}}},
    "alarms": [{"source": "telemetry", "message": "listener paused", "since": 1.0}],
    "weights": {"web": {"b1": 0.75, "b2": 0.0}},
    "samples_rejected": {"web": {"non_finite": 2, "negative": 0}},
    "telemetry": {"accepted": 41, "rejected_keys": {"Ab3xY9qz": 3}, "malformed": {"msgpack": 1},
                  "rate_limited": {"b1": 7},
                  "connections": {"pending": 5, "authenticated": 2, "listener_pauses": 1}},
    "dataplane_stats": {
        "counters": {"rx": 100, "fwd_tx": 90, "pass_not_vip": 10, "conn_evict": 3},
        "vips": [[0, 90, 5400]],
        "backends": [[0, 60, 3600], [1, 30, 1800]],
        "ports": [{"rx_packets": 100, "rx_missed": 0}],
        "conns": {"capacity": 1024, "entries": 256,
                  "by_state": {"syn_sent": 3, "established": 120, "udp_replied": 5},
                  "snat_ports_in_use": 12, "expired": 4567},
    },
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_exporter_serves_the_status_snapshot() -> None:
    port = free_port()
    snapshot: dict[str, Any] | None = None
    exporter = metrics.Exporter("127.0.0.1", port, lambda: snapshot)
    try:
        assert not [k for k in scrape(port) if k[0].startswith("hpclb_")]  # nothing yet
        snapshot = STATUS
        got = scrape(port)
    finally:
        exporter.close()
    assert got[("hpclb_backend_up", (("backend", "b1"),))] == 1.0
    assert got[("hpclb_backend_up", (("backend", "b2"),))] == 0.0
    assert got[("hpclb_backend_weight", (("backend", "b1"), ("pool", "web")))] == 0.75
    assert got[("hpclb_samples_rejected_total", (("pool", "web"), ("reason", "non_finite")))] == 2
    assert got[("hpclb_telemetry_accepted_total", ())] == 41
    assert got[("hpclb_telemetry_rejected_keys_total", (("key_id", "Ab3xY9qz"),))] == 3
    assert got[("hpclb_dataplane_packets_total", (("counter", "fwd_tx"),))] == 90
    assert got[("hpclb_backend_bytes_total", (("backend_id", "1"),))] == 1800
    assert got[("hpclb_vip_packets_total", (("vip_id", "0"),))] == 90
    assert got[("hpclb_port_packets_total", (("counter", "rx_packets"), ("port", "0")))] == 100
    assert got[("hpclb_alarm", (("source", "telemetry"),))] == 1.0
    assert got[("hpclb_alarm", (("source", "probes"),))] == 0.0
    assert got[("hpclb_backend_damped", (("backend", "b2"),))] == 1.0
    assert got[("hpclb_backend_damped", (("backend", "b1"),))] == 0.0
    assert got[("hpclb_backend_damping_release_timestamp_seconds", (("backend", "b2"),))] \
        == 1_900_000_000.5
    assert got[("hpclb_backend_verdict_unknown", (("backend", "b2"),))] == 1.0
    assert got[("hpclb_telemetry_rate_limited_total", (("node", "b1"),))] == 7
    assert got[("hpclb_telemetry_connections", (("state", "pending"),))] == 5
    assert got[("hpclb_telemetry_listener_pauses_total", ())] == 1
    # NAT mode's connection table; its events are packet counters like the others
    assert got[("hpclb_conn_table_capacity", ())] == 1024
    assert got[("hpclb_conn_table_entries", ())] == 256
    assert got[("hpclb_conn_table_connections", (("state", "established"),))] == 120
    assert got[("hpclb_conn_table_connections", (("state", "syn_sent"),))] == 3
    assert got[("hpclb_snat_ports_in_use", ())] == 12
    assert got[("hpclb_conn_table_expired_total", ())] == 4567
    assert got[("hpclb_dataplane_packets_total", (("counter", "conn_evict"),))] == 3


def test_no_connection_table_metrics_without_one() -> None:
    """A data plane that reports no `conns` (DSR only, or an older build)
    gets no connection-table metric at all, rather than zeros."""
    status = {**STATUS, "dataplane_stats": {
        k: v for k, v in STATUS["dataplane_stats"].items() if k != "conns"}}
    names = {m.name for m in metrics.StatusCollector(lambda: status).collect()}
    assert "hpclb_dataplane_packets" in names
    assert not {n for n in names if n.startswith(("hpclb_conn_", "hpclb_snat_"))}


def test_exporter_refuses_a_taken_port_and_frees_its_own() -> None:
    """Bound at construction: a taken address is an OSError before anything else
    starts; close() releases the port for the next exporter."""
    port = free_port()
    first = metrics.Exporter("127.0.0.1", port, lambda: None)
    try:
        try:
            metrics.Exporter("127.0.0.1", port, lambda: None)
        except OSError:
            pass
        else:
            raise AssertionError("a second exporter bound a taken port")
    finally:
        first.close()
    metrics.Exporter("127.0.0.1", port, lambda: None).close()
