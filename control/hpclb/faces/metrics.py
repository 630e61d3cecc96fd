"""Prometheus metrics of a running appliance (``appliance.metrics``).

The exporter's HTTP thread never talks to the data plane or touches the
controller's state: it turns the controller's latest status snapshot (the one
behind ``hpclb status``, rewritten every second, data-plane counters included)
into metric families at each scrape. Families are labelled by the names the
configuration gives VIPs, pools and backends (the snapshot's "ids" and "pools"
join the data plane's per-id counters to them), so a dashboard can ask by name
(appliance/grafana/). A snapshot from an older controller, without some keys,
serves those families empty or not at all: a scrape never fails on it.
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
        names = _Names(status)
        up = GaugeMetricFamily("hpclb_backend_up", "1 when the backend's health verdict is up",
                               labels=["backend"])
        for name, h in sorted(_map(status, "health").items()):
            up.add_metric([name], 1.0 if h.get("up") else 0.0)
        yield up
        weight = GaugeMetricFamily("hpclb_backend_weight", "Weight the ring is built with",
                                   labels=["pool", "backend"])
        for pool, members in sorted(_map(status, "weights").items()):
            for name, w in sorted(members.items()):
                weight.add_metric([pool, name], float(w))
        yield weight
        yield from _weights(status, names)
        yield from _inputs(status, names)
        rejected = CounterMetricFamily("hpclb_samples_rejected",
                                       "Telemetry samples rejected, by reason",
                                       labels=["pool", "reason"])
        for pool, reasons in sorted(_map(status, "samples_rejected").items()):
            for reason, n in sorted(reasons.items()):
                rejected.add_metric([pool, reason], float(n))
        yield rejected
        accepted = CounterMetricFamily("hpclb_samples_accepted",
                                       "Telemetry samples the weight tracker took",
                                       labels=["pool"])
        for pool, n in sorted(_map(status, "samples_accepted").items()):
            accepted.add_metric([pool], float(n))
        yield accepted
        yield from _local_faults(status)
        yield from _control_plane(status)
        yield from _telemetry(status.get("telemetry"))
        yield from _dataplane(status.get("dataplane_stats"), names)
        yield from _bgp(status.get("bgp"))


def _map(status: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """A mapping of the snapshot; {} where an older controller left it out
    (or null), so its families are served empty rather than failing a scrape."""
    value = status.get(key)
    return value if isinstance(value, Mapping) else {}


def _number(value: Any) -> float | None:
    """A figure of the snapshot, or None for one not known (null, absent)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _ratio(used: Any, total: Any) -> float | None:
    u, t = _number(used), _number(total)
    return None if u is None or t is None or t <= 0 else u / t


class _Names:
    """The names behind the data plane's ids and each backend's pool: the
    data plane counts per id, operators (and dashboards) ask by name."""

    def __init__(self, status: Mapping[str, Any]) -> None:
        ids = _map(status, "ids")
        self.vips = _inverse(ids.get("vips"))
        self.backends = _inverse(ids.get("backends"))
        self.pools: Mapping[str, str] = _map(status, "pools")

    def pool(self, backend: str) -> str:
        return str(self.pools.get(backend, ""))


def _inverse(by_name: Any) -> dict[int, str]:
    if not isinstance(by_name, Mapping):
        return {}
    return {int(i): str(name) for name, i in by_name.items() if _number(i) is not None}


def _backend_gauge(name: str, documentation: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=["pool", "backend"])


def _weights(status: Status, names: _Names) -> Iterator[Metric]:
    """What the operator configured, what the data plane does instead (its
    decided state), and an operator's pin overriding both for a while."""
    configured = _backend_gauge("hpclb_backend_configured_weight",
                                "Weight the configuration gives the backend")
    for name, w in sorted(_map(status, "configured_weights").items()):
        if (v := _number(w)) is not None:
            configured.add_metric([names.pool(name), name], v)
    yield configured
    pinned = _backend_gauge("hpclb_backend_pinned_weight",
                            "Ring weight an operator pinned the backend to (while pinned)")
    until = _backend_gauge("hpclb_backend_pin_expiry_timestamp_seconds",
                           "When the backend's pinned weight expires (Unix time)")
    for name, pin in sorted(_map(status, "pins").items()):
        if not isinstance(pin, Mapping):
            continue
        if (w := _number(pin.get("weight"))) is not None:
            pinned.add_metric([names.pool(name), name], w)
        if (t := _number(pin.get("until"))) is not None:
            until.add_metric([names.pool(name), name], t)
    yield pinned
    yield until
    state = GaugeMetricFamily("hpclb_backend_state",
                              "1 for the data-plane state decided for the backend",
                              labels=["pool", "backend", "state"])
    for name, decided in sorted(_map(status, "states").items()):
        for s in ("up", "draining", "down"):
            state.add_metric([names.pool(name), name, s], 1.0 if decided == s else 0.0)
    yield state


# The weight tracker's latest sample per backend (dynamic pools): metric name,
# help, and how to read it from the sample (fractions and seconds, as
# Prometheus conventions want; the snapshot keeps the agent's units).
_INPUTS: tuple[tuple[str, str, Callable[[Mapping[str, Any]], float | None]], ...] = (
    ("hpclb_backend_input_cpu_load_ratio", "Weight input: CPU time used of the quota allowed",
     lambda s: _number(s.get("cpu_load"))),
    ("hpclb_backend_input_memory_used_ratio", "Weight input: memory used of the total",
     lambda s: _ratio(s.get("mem_used"), s.get("mem_total"))),
    ("hpclb_backend_input_gpu_memory_used_ratio", "Weight input: GPU memory used of the total",
     lambda s: _ratio(s.get("gpu_mem_used"), s.get("gpu_mem_total"))),
    ("hpclb_backend_input_rtt_seconds", "Weight input: round trip to the backend",
     lambda s: _milliseconds(s.get("rtt_ms"))),
    ("hpclb_backend_input_score", "Weight input: the load score the weight is derived from",
     lambda s: _number(s.get("score"))),
    ("hpclb_backend_input_age_seconds", "Age of the sample the weight was derived from",
     lambda s: _number(s.get("age_s"))),
)


def _milliseconds(value: Any) -> float | None:
    ms = _number(value)
    return None if ms is None else ms / 1000.0


def _inputs(status: Status, names: _Names) -> Iterator[Metric]:
    samples = sorted((name, s) for name, s in _map(status, "inputs").items()
                     if isinstance(s, Mapping))
    for metric, documentation, read in _INPUTS:
        family = _backend_gauge(metric, documentation)
        for name, sample in samples:
            if (v := read(sample)) is not None:
                family.add_metric([names.pool(name), name], v)
        yield family
    rtt = _backend_gauge("hpclb_backend_probe_rtt_seconds",
                         "Round trip of the backend's last health probe")
    for name, ms in sorted(_map(status, "rtt_ms").items()):
        if (v := _milliseconds(ms)) is not None:
            rtt.add_metric([names.pool(name), name], v)
    yield rtt


def _control_plane(status: Status) -> Iterator[Metric]:
    """The controller's own work: table pushes, memory, the revision in force."""
    push = _map(status, "push")
    if push:
        yield CounterMetricFamily("hpclb_table_pushes", "Table pushes the data plane took",
                                  value=_number(push.get("count")) or 0.0)
        yield CounterMetricFamily("hpclb_table_push_failures",
                                  "Table pushes that failed (retried from the loop)",
                                  value=_number(push.get("failures")) or 0.0)
        if (d := _number(push.get("last_duration_s"))) is not None:
            yield GaugeMetricFamily("hpclb_table_push_last_duration_seconds",
                                    "How long the last table push took", value=d)
        if (t := _number(push.get("last_at"))) is not None:
            yield GaugeMetricFamily("hpclb_table_push_last_timestamp_seconds",
                                    "When the last table push ended (Unix time)", value=t)
    memory = _map(status, "memory")
    rss = GaugeMetricFamily("hpclb_resident_memory_bytes",
                            "Resident memory of the control plane and of the data plane",
                            labels=["plane"])
    for plane, key in (("control", "control_rss_bytes"), ("data", "dataplane_rss_bytes")):
        if (v := _number(memory.get(key))) is not None:
            rss.add_metric([plane], v)
    yield rss
    revision = status.get("revision")
    if isinstance(revision, str):
        config = GaugeMetricFamily("hpclb_config_info", "The configuration in force (its revision)",
                                   labels=["revision"])
        config.add_metric([revision], 1.0)
        yield config
    info = _map(status, "dataplane_info")
    kind = info.get("kind", status.get("dataplane"))
    if isinstance(kind, str):
        dataplane = GaugeMetricFamily("hpclb_dataplane_info", "The data plane in use",
                                      labels=["kind", "attach_mode"])
        dataplane.add_metric([kind, str(info.get("attach_mode") or "")], 1.0)
        yield dataplane


def _local_faults(status: Status) -> Iterator[Metric]:
    """What the appliance's own side suffers (alarms), and what it decides
    without the backends' say (damping, unknown verdicts)."""
    alarm = GaugeMetricFamily("hpclb_alarm", "1 while a local fault holds the verdicts back "
                              "(probes, telemetry, control loop)", labels=["source"])
    active = {a.get("source") for a in status.get("alarms") or [] if isinstance(a, Mapping)}
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
    for name, h in sorted(_map(status, "health").items()):
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


def _dataplane(d: Mapping[str, Any] | None, names: _Names) -> Iterator[Metric]:
    if not d:
        return
    counters: Mapping[str, Any] = d.get("counters") or {}
    events = CounterMetricFamily("hpclb_dataplane_packets",
                                 "Data-plane packets by outcome (LB_STAT_NAMES)",
                                 labels=["counter"])
    drops = CounterMetricFamily("hpclb_dataplane_drops",
                                "Packets the data plane dropped, by reason (its drop_* counters)",
                                labels=["reason"])
    for name, n in counters.items():
        events.add_metric([name], float(n))
        if name.startswith("drop_"):
            drops.add_metric([name.removeprefix("drop_")], float(n))
    yield events
    yield drops
    yield from _forwarded("vip", d.get("vips") or [], names.vips, None)
    yield from _forwarded("backend", d.get("backends") or [], names.backends, names.pool)
    ports = CounterMetricFamily("hpclb_port_packets", "NIC counters of the DPDK ports",
                                labels=["port", "counter"])
    for index, port in enumerate(d.get("ports") or []):
        for name, n in port.items():
            ports.add_metric([str(index), name], float(n))
    yield ports
    yield from _conns(d.get("conns"))


def _forwarded(kind: str, rows: list[list[int]], by_id: Mapping[int, str],
               pool: Callable[[str], str] | None) -> Iterator[Metric]:
    """Packets and bytes per VIP or backend: the data plane's id, and the name
    the configuration gives it ("" for an id the snapshot does not name: an
    older controller, or one just removed), and a backend's pool."""
    labels = [f"{kind}_id", kind, *(["pool"] if pool else [])]
    packets = CounterMetricFamily(f"hpclb_{kind}_packets", f"Packets forwarded per {kind}",
                                  labels=labels)
    octets = CounterMetricFamily(f"hpclb_{kind}_bytes", f"Bytes forwarded per {kind}",
                                 labels=labels)
    for row in rows:
        name = by_id.get(int(row[0]), "")
        values = [str(row[0]), name, *([pool(name)] if pool else [])]
        packets.add_metric(values, float(row[1]))
        octets.add_metric(values, float(row[2]))
    yield packets
    yield octets


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


def _bgp(bgp: Mapping[str, Any] | None) -> Iterator[Metric]:
    """BGP (the `bgp:` section): each session's state and uptime, each VIP
    address's announcement (one series per state, 1 for the one it is in) and
    its damping penalty."""
    if not bgp:
        return
    yield GaugeMetricFamily("hpclb_bgp_speaker_up", "1 while the BGP speaker answers on "
                            "its control socket", value=1.0 if bgp.get("reachable") else 0.0)
    up = GaugeMetricFamily("hpclb_bgp_session_up", "1 while the BGP session is Established",
                           labels=["peer", "address", "state"])
    uptime = GaugeMetricFamily("hpclb_bgp_session_uptime_seconds",
                               "Seconds since the BGP session was established",
                               labels=["peer", "address"])
    # Only with bgp.bfd enabled: the speaker then reports each session's BFD state.
    bfd = GaugeMetricFamily("hpclb_bgp_bfd_up", "1 while the BFD session to the peer is Up "
                            "(bgp.bfd enabled)", labels=["peer", "address", "state"])
    for s in bgp.get("sessions") or []:
        labels = [str(s.get("name")), str(s.get("peer") or "")]
        up.add_metric([*labels, str(s.get("state") or "")], 1.0 if s.get("established") else 0.0)
        if (t := _number(s.get("uptime_s"))) is not None:
            uptime.add_metric(labels, t)
        if "bfd" in s:
            bfd.add_metric([*labels, str(s.get("bfd") or "")], 1.0 if s.get("bfd") == "Up" else 0.0)
    yield up
    yield uptime
    if bgp.get("bfd"):
        yield bfd
    state = GaugeMetricFamily("hpclb_bgp_announcement", "1 for the state the VIP address's "
                              "announcement is in (announced, withdrawn, suppressed), with its "
                              "cause (serving, no_backend, dataplane, damped, stopping, "
                              "disabled, adopted)",
                              labels=["address", "state", "cause"])
    penalty = GaugeMetricFamily("hpclb_bgp_damping_penalty",
                                "Flap-damping penalty of the VIP address's announcement",
                                labels=["address"])
    for a in bgp.get("announcements") or []:
        address = str(a.get("address"))
        for name in ("announced", "withdrawn", "suppressed"):
            current = a.get("state") == name
            state.add_metric([address, name, str(a.get("cause", "")) if current else ""],
                             1.0 if current else 0.0)
        penalty.add_metric([address], float(a.get("penalty") or 0.0))
    yield state
    yield penalty


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
