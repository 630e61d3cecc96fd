"""The Prometheus exporter: a status snapshot, served over real HTTP, scraped
and parsed as Prometheus would."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hpclb import metrics

STATUS: dict[str, Any] = {
    "health": {"b1": {"up": True}, "b2": {"up": False}},
    "weights": {"web": {"b1": 0.75, "b2": 0.0}},
    "samples_rejected": {"web": {"non_finite": 2, "negative": 0}},
    "telemetry": {"accepted": 41, "rejected_keys": {"Ab3xY9qz": 3}, "malformed": {"msgpack": 1}},
    "dataplane_stats": {
        "counters": {"rx": 100, "fwd_tx": 90, "pass_not_vip": 10},
        "vips": [[0, 90, 5400]],
        "backends": [[0, 60, 3600], [1, 30, 1800]],
        "ports": [{"rx_packets": 100, "rx_missed": 0}],
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
    server, _ = metrics.serve(f"127.0.0.1:{port}", lambda: snapshot)
    try:
        assert not [k for k in scrape(port) if k[0].startswith("hpclb_")]  # nothing yet
        snapshot = STATUS
        got = scrape(port)
    finally:
        server.shutdown()  # type: ignore[attr-defined]
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
