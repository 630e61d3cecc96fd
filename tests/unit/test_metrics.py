"""The Prometheus exporter: a status snapshot, served over real HTTP, scraped
and parsed as Prometheus would."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
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
    # no "ids" in this (older) snapshot: the per-id counters carry no name
    assert got[("hpclb_backend_bytes_total",
                (("backend", ""), ("backend_id", "1"), ("pool", "")))] == 1800
    assert got[("hpclb_vip_packets_total", (("vip", ""), ("vip_id", "0")))] == 90
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


# A snapshot with every key of the status contract (docs/ARCHITECTURE.md; the
# issue-12 keys included): two pools, one static and one dynamic, two VIPs, a
# backend pinned, one draining, one down, drops of several reasons, NAT's table.
FULL_STATUS: dict[str, Any] = {
    "time": 1_900_000_000.0,
    "revision": "0123456789abcdef",
    "dataplane": "xdp",
    "pushes_pending": False,
    "alarms": [],
    "health": {"web1": {"up": True, "probe_up": True, "beats_missed": False,
                        "beats_unknown": False, "unknown": False},
               "web2": {"up": True, "probe_up": True, "beats_missed": False,
                        "beats_unknown": False, "unknown": False},
               "gpu1": {"up": True, "probe_up": True, "beats_missed": False,
                        "beats_unknown": False, "unknown": False},
               "gpu2": {"up": False, "probe_up": False, "beats_missed": True,
                        "beats_unknown": False, "unknown": False,
                        "damping": {"suppressed": True, "penalty": 3000.0,
                                    "release_at": 1_900_000_060.0}}},
    "weights": {"web": {"web1": 1.0, "web2": 0.0}, "gpu": {"gpu1": 2.5, "gpu2": 0.0}},
    "samples_accepted": {"gpu": 120},
    "samples_rejected": {"gpu": {"stale": 2}},
    "telemetry": {"accepted": 122, "rejected_keys": {}, "malformed": {}, "rate_limited": {},
                  "connections": {"pending": 0, "authenticated": 2, "handshake_timeouts": 0,
                                  "accept_failures": 0, "listener_pauses": 0}},
    "probes": {"sent": 400, "failed": 3},
    "dataplane_stats": {
        "counters": {"rx": 10_000, "fwd_tx": 9_900, "pass_not_vip": 40, "drop_malformed": 7,
                     "drop_no_backend": 50, "drop_conn_full": 3, "conn_new": 300},
        "vips": [[0, 6_000, 3_600_000], [1, 3_900, 2_340_000]],
        "backends": [[0, 4_000, 2_400_000], [1, 2_000, 1_200_000], [2, 3_900, 2_340_000],
                     [3, 0, 0]],
        "ports": [],
        "conns": {"capacity": 4096, "entries": 600, "by_state": {"established": 290},
                  "snat_ports_in_use": 300, "expired": 12},
    },
    "ids": {"vips": {"www": 0, "infer": 1},
            "backends": {"web1": 0, "web2": 1, "gpu1": 2, "gpu2": 3}},
    "pools": {"web1": "web", "web2": "web", "gpu1": "gpu", "gpu2": "gpu"},
    "configured_weights": {"web1": 1.0, "web2": 1.0, "gpu1": 2.0, "gpu2": 2.0},
    "states": {"web1": "up", "web2": "draining", "gpu1": "up", "gpu2": "down"},
    "pins": {"gpu1": {"weight": 2.5, "until": 1_900_000_300.0}},
    "inputs": {"gpu1": {"cpu_load": 0.25, "mem_used": 8 << 30, "mem_total": 32 << 30,
                        "rtt_ms": 1.5, "gpu_mem_used": 60 << 30, "gpu_mem_total": 80 << 30,
                        "score": 0.4, "time": 1_899_999_999.0, "received": 1_899_999_999.5,
                        "age_s": 0.5},
               "gpu2": {"cpu_load": 0.9, "mem_used": 30 << 30, "mem_total": 32 << 30,
                        "rtt_ms": None, "gpu_mem_used": None, "gpu_mem_total": None,
                        "score": 0.95, "time": 1_899_999_990.0, "received": 1_899_999_990.2,
                        "age_s": 9.8}},
    "rtt_ms": {"web1": 0.8, "web2": 0.9, "gpu1": 1.4, "gpu2": None},
    "push": {"count": 17, "failures": 1, "last_duration_s": 0.0042, "last_at": 1_899_999_950.0},
    "memory": {"control_rss_bytes": 80 << 20, "dataplane_rss_bytes": 2 << 30},
    "transitions": [{"backend": "gpu2", "up": False, "reason": "heartbeats missed",
                     "time": 1_899_999_940.0}],
    "dataplane_info": {"kind": "xdp", "reason": "configured", "attach_mode": "native",
                       "pid": 4242, "capabilities": ["nat"],
                       "interfaces": {"ingress": "eth0", "egress": ["eth1"]}, "netns": None},
}


def exposition(status: dict[str, Any] | None) -> str:
    """What a scrape of the exporter answers for this snapshot (the text format)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.StatusCollector(lambda: status))
    return generate_latest(registry).decode()


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_counters_and_weights_are_served_by_name() -> None:
    """The data plane counts per id; the snapshot's ids and pools name them, so
    a dashboard asks for a VIP, a backend or a pool by name."""
    got = samples_of(exposition(FULL_STATUS))
    assert got[("hpclb_vip_packets_total", (("vip", "infer"), ("vip_id", "1")))] == 3_900
    assert got[("hpclb_vip_bytes_total", (("vip", "www"), ("vip_id", "0")))] == 3_600_000
    assert got[("hpclb_backend_packets_total",
                (("backend", "gpu1"), ("backend_id", "2"), ("pool", "gpu")))] == 3_900
    assert got[("hpclb_backend_bytes_total",
                (("backend", "web2"), ("backend_id", "1"), ("pool", "web")))] == 1_200_000
    # drops by reason: every drop_* counter, and only those
    drops = {dict(k[1])["reason"]: v for k, v in got.items()
             if k[0] == "hpclb_dataplane_drops_total"}
    assert drops == {"malformed": 7, "no_backend": 50, "conn_full": 3}
    gpu1 = (("backend", "gpu1"), ("pool", "gpu"))
    assert got[("hpclb_backend_configured_weight", gpu1)] == 2.0
    assert got[("hpclb_backend_weight", gpu1)] == 2.5
    assert got[("hpclb_backend_pinned_weight", gpu1)] == 2.5
    assert got[("hpclb_backend_pin_expiry_timestamp_seconds", gpu1)] == 1_900_000_300.0
    assert not [k for k in got if k[0] == "hpclb_backend_pinned_weight" and k[1] != gpu1]


def test_weight_inputs_are_ratios_and_seconds() -> None:
    """The tracker's sample in Prometheus units: fractions of the totals,
    seconds; a figure the sample lacks (no GPU, no RTT) is no sample at all."""
    got = samples_of(exposition(FULL_STATUS))
    gpu1, gpu2 = (("backend", "gpu1"), ("pool", "gpu")), (("backend", "gpu2"), ("pool", "gpu"))
    assert got[("hpclb_backend_input_cpu_load_ratio", gpu1)] == 0.25
    assert got[("hpclb_backend_input_memory_used_ratio", gpu1)] == 0.25
    assert got[("hpclb_backend_input_gpu_memory_used_ratio", gpu1)] == 0.75
    assert got[("hpclb_backend_input_rtt_seconds", gpu1)] == 0.0015
    assert got[("hpclb_backend_input_score", gpu2)] == 0.95
    assert got[("hpclb_backend_input_age_seconds", gpu2)] == 9.8
    assert ("hpclb_backend_input_gpu_memory_used_ratio", gpu2) not in got
    assert ("hpclb_backend_input_rtt_seconds", gpu2) not in got
    assert got[("hpclb_backend_probe_rtt_seconds", (("backend", "web1"), ("pool", "web")))] \
        == 0.0008
    assert ("hpclb_backend_probe_rtt_seconds", gpu2) not in got


def test_state_push_and_memory() -> None:
    got = samples_of(exposition(FULL_STATUS))
    state = {(dict(k[1])["backend"], dict(k[1])["state"]): v
             for k, v in got.items() if k[0] == "hpclb_backend_state"}
    assert {k for k, v in state.items() if v == 1.0} == {
        ("web1", "up"), ("web2", "draining"), ("gpu1", "up"), ("gpu2", "down")}
    assert len(state) == 12  # each backend: one series per state, the decided one at 1
    assert got[("hpclb_table_pushes_total", ())] == 17
    assert got[("hpclb_table_push_failures_total", ())] == 1
    assert got[("hpclb_table_push_last_duration_seconds", ())] == 0.0042
    assert got[("hpclb_table_push_last_timestamp_seconds", ())] == 1_899_999_950.0
    assert got[("hpclb_resident_memory_bytes", (("plane", "control"),))] == 80 << 20
    assert got[("hpclb_resident_memory_bytes", (("plane", "data"),))] == 2 << 30
    assert got[("hpclb_config_info", (("revision", "0123456789abcdef"),))] == 1.0
    assert got[("hpclb_dataplane_info", (("attach_mode", "native"), ("kind", "xdp")))] == 1.0
    assert got[("hpclb_samples_accepted_total", (("pool", "gpu"),))] == 120


def test_an_older_snapshot_still_exports() -> None:
    """A controller without the issue-12 keys (or with nulls where a figure is
    unknown): the new families are absent or empty, the old ones unchanged,
    and counters of ids the snapshot does not name carry an empty name."""
    got = samples_of(exposition(STATUS))
    assert got[("hpclb_backend_up", (("backend", "b1"),))] == 1.0
    assert got[("hpclb_vip_packets_total", (("vip", ""), ("vip_id", "0")))] == 90
    assert got[("hpclb_backend_packets_total",
                (("backend", ""), ("backend_id", "1"), ("pool", "")))] == 30
    new = ("hpclb_backend_configured_weight", "hpclb_backend_state", "hpclb_backend_input_",
           "hpclb_table_push", "hpclb_resident_memory", "hpclb_config_info",
           "hpclb_backend_pinned", "hpclb_backend_probe_rtt")
    assert not [k for k in got if k[0].startswith(new)]
    nulls = {**FULL_STATUS, "ids": None, "pools": None, "inputs": {"gpu1": None},
             "push": {"count": 3, "failures": 0, "last_duration_s": None, "last_at": None},
             "memory": {"control_rss_bytes": 1 << 20, "dataplane_rss_bytes": None},
             "pins": {"gpu1": None}, "states": None, "dataplane_stats": None}
    got = samples_of(exposition(nulls))
    assert got[("hpclb_table_pushes_total", ())] == 3
    assert ("hpclb_table_push_last_duration_seconds", ()) not in got
    assert [k for k in got if k[0] == "hpclb_resident_memory_bytes"] == [
        ("hpclb_resident_memory_bytes", (("plane", "control"),))]
    assert got[("hpclb_backend_configured_weight", (("backend", "gpu1"), ("pool", "")))] == 2.0
    assert exposition({"time": 1.0}).startswith("# HELP")  # next to nothing: still a scrape
    assert exposition(None) == ""
