"""`hpclb diagnose`: one report over the cases operators meet.

`diagnose(inputs)` is pure: it reads a `DiagnoseInputs` (the controller's status
snapshot, an earlier one for rates, NIC counters, hugepages, a memory history,
a few configuration facts) and returns `Finding`s, each saying what it likely
means and what to check next. Every area reports at least one finding, an "ok"
one when nothing is wrong, so the report shows what was checked.

`gather(...)` builds the inputs from the live pieces (a status callable, a
`NicStatsSource`, the hugepage reader, a memory history); host access stays in
`hpclb.host`.

Rates versus totals: counters are absolute (since the interface, the driver or
the data plane started). A total alone says a fault happened some time; a rise
between two samples says it is happening now. `gather` therefore reads twice,
`interval_s` apart, and the analysis grades a counter that rose now above one
that only has a total.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hpclb.config import HpclbConfig
from hpclb.contract import tables
from hpclb.host import procinfo
from hpclb.host.nicstats import ETHTOOL_PREFIX, NicCounters, NicStatsSource
from hpclb.host.procinfo import Hugepages

Severity = Literal["ok", "info", "warning", "critical"]
SEVERITIES: tuple[Severity, ...] = ("ok", "info", "warning", "critical")

AREAS = ("nic", "drops", "xdp", "tables", "hugepages", "memory", "probes", "backends",
         "control")

Status = Mapping[str, Any]
MemorySample = tuple[float, int, int | None]  # (unix time, control RSS, data-plane RSS)


@dataclass
class Finding:
    severity: Severity
    area: str
    title: str
    meaning: str
    next: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ConfigFacts:
    """What the analysis needs of the configuration in force."""

    dataplane: str = "auto"  # appliance.dataplane: auto | xdp | dpdk
    xdp_mode: str = "auto"  # appliance.xdp.mode: auto | native | generic
    hugepages_mb: int | None = None  # appliance.dpdk.hugepages_mb
    conn_table_size: int | None = None  # nat.conn_table_size (entries, per family)

    @classmethod
    def from_config(cls, cfg: HpclbConfig) -> ConfigFacts:
        app = cfg.appliance
        return cls(dataplane=app.dataplane.value, xdp_mode=app.xdp.mode.value,
                   hugepages_mb=app.dpdk.hugepages_mb,
                   conn_table_size=cfg.nat.conn_table_size)


@dataclass
class DiagnoseInputs:
    status: Status  # the controller's status snapshot (the API spec's keys)
    # An earlier snapshot (a few seconds before): rates of drop_* and DPDK port counters.
    previous_status: Status | None = None
    # Kernel interfaces' counters now and `nic_interval_s` before (absolute values;
    # the difference is what is happening now). None: not read.
    nic: NicCounters | None = None
    nic_previous: NicCounters | None = None
    nic_interval_s: float | None = None
    hugepages: Hugepages | None = None
    dataplane_hugetlb_bytes: int | None = None  # what the data plane maps (DPDK)
    memory_history: Sequence[MemorySample] = ()  # oldest first
    config: ConfigFacts = field(default_factory=ConfigFacts)


def diagnose(inputs: DiagnoseInputs) -> list[Finding]:
    """Every area's findings, the worst first within the report's area order."""
    out: list[Finding] = []
    for check in (_nic, _drops, _xdp, _tables, _hugepages, _memory, _probes, _backends,
                  _control):
        out.extend(check(inputs))
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    area = {a: i for i, a in enumerate(AREAS)}
    return sorted(out, key=lambda f: (-rank[f.severity], area.get(f.area, len(AREAS))))


def _ok(area: str, title: str, evidence: dict[str, Any] | None = None) -> Finding:
    return Finding("ok", area, title, "", "", evidence or {})


def _interfaces(status: Status) -> list[str]:
    info = status.get("dataplane_info") or {}
    ifs = info.get("interfaces") or {}
    names = [ifs.get("ingress"), *(ifs.get("egress") or [])]
    return [n for n in names if n]


# ---- NIC error counters --------------------------------------------------------

# Kernel link counters (IFLA_STATS64) and the DPDK port counters of the stats
# reply, by what they point at. Each: (meaning, what to check next).
_RING = ("the NIC had no free receive descriptor and dropped frames: the data plane's CPU "
         "does not keep up, or the ring is too small",
         "CPU load of the cores serving the queues (`mpstat -P ALL`), IRQ affinity and RSS "
         "spreading (`ethtool -x IFACE`), ring size (`ethtool -g IFACE`, raise with -G), "
         "for DPDK the worker lcores")
_LINK = ("frames arrived damaged: cabling, optics/transceiver, a dirty connector, or a speed/"
         "duplex mismatch with the switch",
         "`ethtool IFACE` (speed, duplex), `ethtool -m IFACE` (optical levels), the switch "
         "port's error counters; swap the cable or transceiver")
_GENERIC_RX = ("the driver reports receive errors (a sum of the specific error counters, or "
               "a driver-specific fault)",
               "`ethtool -S IFACE` for the driver's breakdown, `dmesg` for driver messages")
_TX = ("frames could not be sent: carrier lost, the TX ring full or a driver fault",
       "link state and flaps (`ip -s link show IFACE`, `dmesg`), `ethtool -S IFACE`")
_STACK_DROP = ("the kernel dropped frames above the driver: no handler for the protocol, a "
               "full backlog, or a qdisc refusing them; often harmless (multicast, LLDP)",
               "`ip -s -s link show IFACE`, `nstat -az | grep -i drop`, "
               "`net.core.netdev_max_backlog`")
_NOMBUF = ("DPDK had no free mbuf for a received frame: the mbuf pool is too small or mbufs "
           "leak (held by a full TX queue or an exception path that does not drain)",
           "the forwarder's telemetry (`/hpclb/stats`), TX errors on the egress port, the "
           "TAP exception path's backlog; more hugepages for a larger pool")
_DRIVER = ("the driver's own error or drop counter rose",
           "`ethtool -S IFACE` and the driver's documentation for this counter")

NIC_COUNTERS: dict[str, tuple[tuple[str, str], Severity]] = {
    "rx_missed_errors": (_RING, "warning"),
    "rx_fifo_errors": (_RING, "warning"),
    "rx_over_errors": (_RING, "warning"),
    "rx_crc_errors": (_LINK, "warning"),
    "rx_frame_errors": (_LINK, "warning"),
    "rx_length_errors": (_LINK, "warning"),
    "rx_errors": (_GENERIC_RX, "warning"),
    "tx_errors": (_TX, "warning"),
    "tx_carrier_errors": (_TX, "warning"),
    "tx_aborted_errors": (_TX, "warning"),
    "tx_fifo_errors": (_TX, "warning"),
    "rx_dropped": (_STACK_DROP, "info"),
    "tx_dropped": (_TX, "info"),
    # DPDK's names (the stats reply's "ports")
    "rx_missed": (_RING, "warning"),
    "rx_nombuf": (_NOMBUF, "warning"),
}
# Of a driver's ethtool statistics, the names that count a fault. "xdp_drop"
# counters count the program's XDP_DROP verdicts: the drop_* counters explain those.
_DRIVER_FAULT_WORDS = ("err", "drop", "miss", "fifo", "crc", "discard", "nombuf",
                       "no_buf", "out_of_buffer", "timeout", "fail")
_DRIVER_NOT_FAULTS = ("xdp_drop",)

# A counter rising at this share of the interface's packets in the interval is critical:
# one frame in a hundred lost is felt by every TCP flow.
CRITICAL_SHARE = 0.01


def _is_driver_fault(name: str) -> bool:
    low = name.lower()
    return (any(w in low for w in _DRIVER_FAULT_WORDS)
            and not any(w in low for w in _DRIVER_NOT_FAULTS))


def _nic_findings(port: str, now: Mapping[str, int], before: Mapping[str, int] | None,
                  interval_s: float | None, source: str) -> list[Finding]:
    out: list[Finding] = []
    packets_delta = None
    if before is not None:
        packets_delta = sum(max(0, int(now.get(k, 0)) - int(before.get(k, 0)))
                            for k in ("rx_packets", "tx_packets"))
    for name, value in sorted(now.items()):
        if name in NIC_COUNTERS:
            (meaning, next_step), severity = NIC_COUNTERS[name]
        elif name.startswith(ETHTOOL_PREFIX) and _is_driver_fault(name[len(ETHTOOL_PREFIX):]):
            (meaning, next_step), severity = _DRIVER, "warning"
        else:
            continue
        value = int(value)
        if value <= 0:
            continue
        evidence: dict[str, Any] = {"interface": port, "counter": name, "total": value,
                                    "source": source}
        delta = None if before is None else value - int(before.get(name, 0))
        if delta is not None and delta < 0:
            delta = None  # reset (driver reloaded, data plane restarted): no rate
        if delta is not None and delta > 0:
            evidence["delta"] = delta
            if interval_s:
                evidence["per_s"] = round(delta / interval_s, 2)
            if packets_delta:
                evidence["share_of_packets"] = round(delta / packets_delta, 5)
            if severity == "warning" and packets_delta and delta / packets_delta >= CRITICAL_SHARE:
                severity = "critical"
            out.append(Finding(severity, "nic", f"{port}: {name} rising", meaning,
                               next_step.replace("IFACE", port), evidence))
        else:
            # Only a total: it happened since the counter started, not in the interval.
            past = "" if delta is None else " (not rising now)"
            out.append(Finding("info", "nic", f"{port}: {name} = {value}{past}",
                               f"In the past: {meaning}.", next_step.replace("IFACE", port),
                               evidence))
    return out


def _nic(inp: DiagnoseInputs) -> list[Finding]:
    out: list[Finding] = []
    names = _interfaces(inp.status)
    checked: list[str] = []
    if inp.nic is not None:
        # The data plane's interfaces first, then any other the caller read.
        for name in [n for n in names if n in inp.nic] + sorted(set(inp.nic) - set(names)):
            checked.append(name)
            before = None if inp.nic_previous is None else inp.nic_previous.get(name)
            out += _nic_findings(name, inp.nic[name], before, inp.nic_interval_s, "kernel")
    # DPDK ports: the stats reply's per-port counters, index 0 = ingress, 1.. = egress.
    ports = (inp.status.get("dataplane_stats") or {}).get("ports") or []
    prev_ports = ((inp.previous_status or {}).get("dataplane_stats") or {}).get("ports")
    interval = _status_interval(inp)
    for i, counters in enumerate(ports):
        if not counters:
            continue
        label = f"port {i} ({names[i]})" if i < len(names) else f"port {i}"
        checked.append(label)
        before = prev_ports[i] if prev_ports and i < len(prev_ports) else None
        out += _nic_findings(label, counters, before, interval, "dpdk")
    if not checked:
        return [Finding("info", "nic", "no NIC counters read",
                        "Neither the kernel nor the data plane gave counters for the "
                        "appliance's interfaces.",
                        "Whether the interfaces exist in the appliance's namespace "
                        "(`ip -n NETNS link`); for DPDK on a PCI NIC the data plane's "
                        "stats reply.", {"interfaces": names})]
    if not out:
        out.append(_ok("nic", "no NIC errors", {"interfaces": checked}))
    return out


# ---- drops by reason -------------------------------------------------------------

# Each drop_* counter of lb_tables.h (LB_STAT_NAMES): what it means, what to check,
# and the severity when it is rising now.
DROPS: dict[str, tuple[str, str, Severity]] = {
    "drop_no_backend": (
        "Packets to a VIP found no up backend: the pool is empty, every backend is down or "
        "draining, or none within the ring's probe slots; the VIP's traffic is black-holed.",
        "`hpclb backend list` (states, health), the pool's backends and their probes; "
        "a backend whose MAC is unresolved is down too.", "critical"),
    "drop_malformed": (
        "Frames with a truncated or inconsistent Ethernet/IP/L4 header were dropped: a "
        "broken sender, a scan, or an MTU/offload problem cutting frames.",
        "Capture a few on the ingress interface (`tcpdump -c 20 -i IFACE`); GRO/LRO "
        "settings (`ethtool -k`).", "info"),
    "drop_tx_error": (
        "Frames could not be sent out: a bad egress port, a failed XDP redirect (the "
        "target interface needs XDP support and must be up), or a full DPDK TX queue.",
        "The egress interfaces' state and TX counters, `interfaces.egress` in the "
        "configuration, the NIC findings above.", "warning"),
    "drop_conn_full": (
        "NAT: new connections were refused because the connection table is full and "
        "nothing embryonic could be evicted.",
        "The connection table's fill (tables area); raise `nat.conn_table_size` (takes "
        "effect at the data plane's next start) or shorten `nat.timeouts`.", "critical"),
    "drop_snat_exhausted": (
        "NAT: new connections were refused: no free SNAT source port among the probes.",
        "Add `nat.snat.addresses`, widen `nat.snat.ports`, or shorten the idle timeouts "
        "(time_wait, udp).", "critical"),
    "drop_backend_down": (
        "NAT: packets of connections whose backend went down were dropped "
        "(`nat.on_backend_down: drop`).",
        "Which backend went down (backends area); `reschedule` moves such connections "
        "instead.", "warning"),
    "drop_conn_invalid": (
        "A TCP RST matched no connection and opens none: usually stray RSTs after a "
        "connection expired, sometimes a scan.",
        "Only if it is large: idle timeouts shorter than the applications' "
        "(`nat.timeouts.established`).", "info"),
    "drop_encap": (
        "Tunnel mode could not encapsulate: IPv6 inside IPv4, a backend of another family "
        "than the tunnel source, or no room for the outer headers.",
        "The tunnel VIPs' `tunnel.source` family against their backends' addresses.",
        "warning"),
}
_DROP_UNKNOWN = ("A drop counter this version of diagnose does not know.",
                 "dataplane/common/lb_tables.h (enum lb_stat) for its meaning.", "warning")


def _status_interval(inp: DiagnoseInputs) -> float | None:
    if inp.previous_status is None:
        return None
    dt = float(inp.status.get("time", 0)) - float(inp.previous_status.get("time", 0))
    return dt if dt > 0 else None


def _drops(inp: DiagnoseInputs) -> list[Finding]:
    stats = inp.status.get("dataplane_stats")
    if not stats or "counters" not in stats:
        return [Finding("info", "drops", "no data-plane counters",
                        "The status snapshot holds no stats reply from the data plane.",
                        "Whether the data plane answers (`hpclb stats`), the alarms.", {})]
    counters: Mapping[str, int] = stats["counters"]
    interval = _status_interval(inp)
    before = ((inp.previous_status or {}).get("dataplane_stats") or {}).get("counters") \
        if interval else None
    rx_delta = (counters.get("rx", 0) - before.get("rx", 0)) if before else None
    out: list[Finding] = []
    for name, value in sorted(counters.items()):
        if not name.startswith("drop_") or int(value) <= 0:
            continue
        meaning, next_step, severity = DROPS.get(name, _DROP_UNKNOWN)
        ingress = (_interfaces(inp.status) or ["IFACE"])[0]
        next_step = next_step.replace("IFACE", ingress)
        evidence: dict[str, Any] = {"counter": name, "total": int(value)}
        delta = None if before is None else int(value) - int(before.get(name, 0))
        if delta is not None and delta > 0 and interval:
            evidence.update(delta=delta, per_s=round(delta / interval, 2))
            if rx_delta:
                evidence["share_of_rx"] = round(delta / rx_delta, 5)
            out.append(Finding(severity, "drops", f"{name} rising ({delta / interval:.1f}/s)",
                               meaning, next_step, evidence))
        else:
            if delta == 0:
                evidence["delta"] = 0
            out.append(Finding("info", "drops", f"{name} = {value}"
                               + (" (not rising now)" if delta == 0 else ""),
                               f"Since the data plane started: {meaning}", next_step, evidence))
    if not out:
        out.append(_ok("drops", "no drops", {"rx": counters.get("rx", 0)}))
    return out


# ---- XDP attach mode -------------------------------------------------------------

def _xdp(inp: DiagnoseInputs) -> list[Finding]:
    return [_name_ports(f, _interfaces(inp.status)) for f in _xdp_findings(inp)]


def _name_ports(f: Finding, ports: list[str]) -> Finding:
    """The commands in a finding's next step, written for the appliance's ports."""
    if len(ports) == 1:
        f.next = f.next.replace("IFACE", ports[0])
    elif ports and "IFACE" in f.next:
        f.next += f" (IFACE: each of {', '.join(ports)})"
    return f


def _xdp_findings(inp: DiagnoseInputs) -> list[Finding]:
    info = inp.status.get("dataplane_info") or {}
    kind = info.get("kind") or inp.status.get("dataplane")
    mode = info.get("attach_mode")
    evidence = {"kind": kind, "attach_mode": mode, "configured": inp.config.xdp_mode,
                "interfaces": _interfaces(inp.status), "reason": info.get("reason")}
    if kind != "xdp":
        return [_ok("xdp", f"not applicable ({kind or 'unknown'} data plane)", evidence)]
    if mode == "native":
        return [_ok("xdp", "attached in native (driver) mode", evidence)]
    if mode == "generic":
        if inp.config.xdp_mode == "generic":
            return [Finding(
                "info", "xdp", "attached in generic (skb) mode, as configured",
                "`appliance.xdp.mode: generic` asks for the kernel's generic XDP: every "
                "frame takes an sk_buff first, several times slower than native mode.",
                "Set `appliance.xdp.mode: auto` (or native) unless the driver lacks "
                "native XDP; a restart of the data plane applies it.", evidence)]
        return [Finding(
            "warning", "xdp", "attached in generic (skb) mode: the slow path",
            "Native attach failed on at least one port and hpclb-xdp fell back to generic "
            "XDP, where every frame is first built into an sk_buff (several times slower). "
            "Usual causes: a driver without native XDP, an MTU above what the driver's XDP "
            "supports (often ~3.5 kB without multi-buffer), too few TX queues for XDP_TX, "
            "or another XDP program already attached.",
            "The data plane's log line `native XDP attach to IFACE failed: <reason>`; "
            "`ethtool -i IFACE` (driver), `ip link show IFACE` (MTU, other xdp programs); "
            "set `appliance.xdp.mode: native` to make the fallback an error.", evidence)]
    if mode == "none":
        return [Finding("warning", "xdp", "the program is not attached",
                        "The XDP data plane runs with --no-attach (a test set-up): no "
                        "frame passes through it.",
                        "How the data plane was started; a normal start attaches.", evidence)]
    return [Finding("info", "xdp", f"attach mode unknown ({mode})",
                    "The status does not say how the program is attached.",
                    "`ip link show IFACE` shows `xdp` (native) or `xdpgeneric`.", evidence)]


# ---- tables ---------------------------------------------------------------------

TABLE_WARN = 0.75  # fill at which a table is worth a look before it refuses entries
TABLE_CRITICAL = 0.90


def _fill(area_title: str, used: int, capacity: int, meaning: str, next_step: str,
          evidence: dict[str, Any]) -> Finding:
    share = used / capacity if capacity else 0.0
    evidence = {**evidence, "used": used, "capacity": capacity, "fill": round(share, 4)}
    if share >= TABLE_CRITICAL:
        sev: Severity = "critical"
    elif share >= TABLE_WARN:
        sev = "warning"
    else:
        return _ok("tables", f"{area_title}: {share:.0%} full", evidence)
    return Finding(sev, "tables", f"{area_title}: {share:.0%} full", meaning, next_step,
                   evidence)


def _tables(inp: DiagnoseInputs) -> list[Finding]:
    out: list[Finding] = []
    stats = inp.status.get("dataplane_stats") or {}
    conns = stats.get("conns") or {}
    if conns.get("capacity"):
        out.append(_fill(
            "NAT connection table", int(conns.get("entries", 0)), int(conns["capacity"]),
            "NAT's connection table is filling (two entries per connection); when full, "
            "embryonic connections are evicted and then new ones refused (drop_conn_full).",
            "Connections by state (`hpclb stats`): many in time_wait or syn_sent point at "
            "timeouts or a SYN flood; raise `nat.conn_table_size` (next data-plane start).",
            {"by_state": conns.get("by_state", {}),
             "configured": inp.config.conn_table_size}))
    counters = stats.get("counters") or {}
    before = ((inp.previous_status or {}).get("dataplane_stats") or {}).get("counters") or {}
    for name, meaning, next_step in (
            ("flow_evict",
             "DPDK's flow-affinity table was full and evicted live flows: those flows may "
             "move to another backend at the next ring change.",
             "Raise `appliance.dpdk.flow_table_size` (per worker) or lower "
             "`appliance.dpdk.flow_timeout_s`."),
            ("conn_evict",
             "NAT evicted embryonic connections to make room: the table is under pressure, "
             "possibly a SYN flood.",
             "The connection table's fill and its syn_sent count.")):
        delta = int(counters.get(name, 0)) - int(before.get(name, 0)) if before else 0
        if delta > 0:
            out.append(Finding("warning", "tables", f"{name} rising", meaning, next_step,
                               {"counter": name, "delta": delta,
                                "total": int(counters.get(name, 0))}))
    ids = inp.status.get("ids") or {}
    for what, limit in (("vips", tables.MAX_VIPS), ("backends", tables.MAX_BACKENDS)):
        used = len(ids.get(what) or {})
        if used and used / limit >= TABLE_WARN:
            out.append(_fill(
                f"{what} table", used, limit,
                f"The data plane holds at most {limit} {what}; the configuration is close.",
                "Split the appliance, or remove unused entries.", {}))
    if not any(f.severity != "ok" for f in out):
        out.append(_ok("tables", "tables have room",
                       {"vips": len(ids.get("vips") or {}),
                        "backends": len(ids.get("backends") or {})}))
    return out


# ---- hugepages ------------------------------------------------------------------

def _hugepages(inp: DiagnoseInputs) -> list[Finding]:
    info = inp.status.get("dataplane_info") or {}
    kind = info.get("kind") or inp.status.get("dataplane")
    hp = inp.hugepages
    want = (inp.config.hugepages_mb or 0) * 1024 * 1024
    evidence: dict[str, Any] = {"kind": kind, "configured_bytes": want,
                                "hugepages": hp.as_dict() if hp else None}
    if kind != "dpdk":
        if inp.config.dataplane == "auto" and hp is not None and hp.free_bytes < want:
            return [Finding(
                "info", "hugepages", "XDP chosen: too few free hugepages for DPDK",
                "`dataplane: auto` takes DPDK only with the configured hugepages free; "
                f"{hp.free_bytes >> 20} MB are free, {want >> 20} MB configured.",
                "If DPDK was meant: reserve hugepages at boot (hpclb-prepare.service "
                "reserves `dpdk.hugepages_mb`: `systemctl status hpclb-prepare`; or "
                "`hugepages=` on the kernel command line); where hpclb runs as root, "
                "`appliance.dpdk.reserve_hugepages: true` also does.", evidence)]
        return [_ok("hugepages", f"not used ({kind or 'unknown'} data plane)", evidence)]
    if hp is None or hp.total_bytes == 0:
        return [Finding("critical", "hugepages", "no hugepages reserved",
                        "The DPDK data plane needs hugepages for its memory; with none "
                        "reserved it cannot restart.",
                        "`grep Huge /proc/meminfo`; reserve them at boot "
                        "(`systemctl restart hpclb-prepare` reserves `dpdk.hugepages_mb`) "
                        "or, where hpclb runs as root, set "
                        "`appliance.dpdk.reserve_hugepages: true`.", evidence)]
    # A restarted data plane gets back the pages the running one maps, plus the free ones.
    held = inp.dataplane_hugetlb_bytes
    available = hp.free_bytes + (held or 0)
    evidence.update(dataplane_hugetlb_bytes=held, available_for_restart_bytes=available)
    if held is not None and available < want:
        return [Finding(
            "warning", "hugepages", "too few hugepages for a restart",
            f"A restart of the data plane asks for {want >> 20} MB; it would find "
            f"{available >> 20} MB (its own {held >> 20} MB plus {hp.free_bytes >> 20} MB "
            "free): another process holds the rest.",
            "`grep -l huge /proc/*/maps` for other hugepage users; reserve more pages.",
            evidence)]
    if hp.free_bytes == 0:
        return [Finding("info", "hugepages", "every hugepage is in use",
                        "The DPDK data plane maps them all; nothing else can take one.",
                        "Nothing, unless another DPDK process must run here.", evidence)]
    return [_ok("hugepages", f"{hp.free_bytes >> 20} MB of {hp.total_bytes >> 20} MB free",
                evidence)]


# ---- memory growth ----------------------------------------------------------------

# A leak shows as RSS growing steadily, for hours. Thresholds, and why:
# - windows of 1, 6 and 24 hours (the history is one sample a minute over a
#   day): a leak that started lately is steep in a short window; a slow one
#   only shows over a long one. A window holds what the history has of it
#   and needs 30 samples over at least 50 minutes, so a short history is
#   never judged on a few points;
# - the first WARMUP_S of the history (imports, caches, allocator arenas
#   filling; the ring lives in the control-plane process, so its start is the
#   process's) are left out. A data-plane restart is not cut out: RSS guesses
#   of a restart misread noise, and a fall breaks the line's fit anyway;
# - slope >= 4 MiB/hour: the control plane's working set is tens of MiB and
#   the XDP daemon's a few; 4 MiB/hour is ~100 MiB a day, which matters;
# - total growth in the window >= 16 MiB: a steep slope over a small absolute
#   change is allocator noise;
# - R^2 >= 0.9 of the least-squares line: a noisy or saw-tooth series (a GC,
#   periodic caches) fits a line badly; 0.9 also refuses a single step, whose
#   best line reaches R^2 = 0.75 at most;
# - both halves of the window grow at >= a quarter of the threshold: growth
#   is sustained, not one jump.
WINDOWS_S = (3600.0, 6 * 3600.0, 24 * 3600.0)
WARMUP_S = 600.0
MIN_SAMPLES = 30
MIN_SPAN_S = 3000.0
SLOPE_MIB_PER_HOUR = 4.0
MIN_GROWTH_MIB = 16.0
MIN_R2 = 0.9


@dataclass(frozen=True)
class Trend:
    slope_mib_per_hour: float
    r2: float
    growth_mib: float
    samples: int
    window_s: float  # the span the samples cover
    halves_mib_per_hour: tuple[float, float]

    @property
    def steady_growth(self) -> bool:
        return (self.slope_mib_per_hour >= SLOPE_MIB_PER_HOUR
                and self.growth_mib >= MIN_GROWTH_MIB and self.r2 >= MIN_R2
                and min(self.halves_mib_per_hour) >= SLOPE_MIB_PER_HOUR / 4)


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope (per second) and R^2 of y over t."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    stt = sum((t - mt) ** 2 for t, _ in points)
    syy = sum((y - my) ** 2 for _, y in points)
    sty = sum((t - mt) * (y - my) for t, y in points)
    if stt == 0:
        return 0.0, 0.0
    slope = sty / stt
    r2 = (sty * sty) / (stt * syy) if syy > 0 else 0.0
    return slope, r2


def memory_trend(series: Sequence[tuple[float, float]], window_s: float) -> Trend | None:
    """The trend of (unix time, bytes) over the last `window_s`, after the
    warm-up; None when too few samples cover the window."""
    points = [(t, float(v)) for t, v in series if v is not None]
    if not points:
        return None
    points = [p for p in points if p[0] >= points[0][0] + WARMUP_S]
    if not points:
        return None
    end = points[-1][0]
    points = [p for p in points if p[0] >= end - window_s]
    if len(points) < MIN_SAMPLES or (end - points[0][0]) < MIN_SPAN_S:
        return None
    mib_h = 3600.0 / (1 << 20)
    slope, r2 = _fit(points)
    half = len(points) // 2
    halves = (_fit(points[:half])[0] * mib_h, _fit(points[half:])[0] * mib_h)
    span = end - points[0][0]
    return Trend(slope_mib_per_hour=slope * mib_h, r2=r2, growth_mib=slope * span / (1 << 20),
                 samples=len(points), window_s=span, halves_mib_per_hour=halves)


def _memory(inp: DiagnoseInputs) -> list[Finding]:
    out: list[Finding] = []
    hist = list(inp.memory_history)
    mem = inp.status.get("memory") or {}
    judged: dict[str, Any] = {}
    for label, idx, who, next_step in (
            ("control plane", 1, "hpclb run (Python)",
             "`py-spy dump --pid PID` / tracemalloc, what changed around when the growth "
             "started (config size, number of backends, API clients); restart it at a "
             "quiet moment (the data plane keeps forwarding)."),
            ("data plane", 2, "the data-plane daemon",
             "Its `stats` and connection table (does the growth follow entries?), "
             "`pmap -x PID`; restart it at a quiet moment if it goes on.")):
        series = [(s[0], float(v)) for s in hist if (v := s[idx]) is not None]
        best: Trend | None = None
        spans: set[float] = set()
        for window in WINDOWS_S:
            trend = memory_trend(series, window)
            if trend is None or trend.window_s in spans:
                continue  # too short, or a shorter history than the window: judged already
            spans.add(trend.window_s)
            judged.setdefault(label, []).append(
                {"window_h": round(trend.window_s / 3600, 2),
                 "mib_per_hour": round(trend.slope_mib_per_hour, 2), "r2": round(trend.r2, 3)})
            if trend.steady_growth and (best is None
                                        or trend.growth_mib > best.growth_mib):
                best = trend
        if best is not None:
            out.append(Finding(
                "warning", "memory",
                f"{label} memory growing {best.slope_mib_per_hour:.1f} MiB/hour",
                f"The resident memory of {who} grew steadily over the last "
                f"{best.window_s / 3600:.1f} h ({best.growth_mib:.0f} MiB, R^2 "
                f"{best.r2:.2f}): possibly a leak.", next_step,
                {"process": label, "mib_per_hour": round(best.slope_mib_per_hour, 2),
                 "r2": round(best.r2, 3), "growth_mib": round(best.growth_mib, 1),
                 "window_h": round(best.window_s / 3600, 2), "samples": best.samples,
                 "rss_bytes": series[-1][1] if series else None}))
    if not out:
        evidence = {"samples": len(hist), "judged": judged, **mem}
        if not judged:
            return [Finding("info", "memory", "too little memory history to judge",
                            f"A trend needs at least {MIN_SAMPLES} samples over an hour "
                            "after the first ten minutes of the process.",
                            "Ask again later.", evidence)]
        out.append(_ok("memory", "no steady memory growth", evidence))
    return out


# ---- probe RTT outliers -------------------------------------------------------------

RTT_FACTOR = 3.0  # far above the pool's median ...
RTT_MIN_MS = 5.0  # ... and slow in absolute terms (a 0.3 ms LAN median x 3 is noise)
RTT_MIN_POOL = 3  # a median of fewer backends says nothing about an outlier


def _probes(inp: DiagnoseInputs) -> list[Finding]:
    rtts: Mapping[str, float | None] = inp.status.get("rtt_ms") or {}
    pools: Mapping[str, str] = inp.status.get("pools") or {}
    by_pool: dict[str, dict[str, float]] = {}
    for backend, rtt in rtts.items():
        if rtt is not None and math.isfinite(rtt):
            by_pool.setdefault(pools.get(backend, "?"), {})[backend] = float(rtt)
    out: list[Finding] = []
    for pool, members in sorted(by_pool.items()):
        if len(members) < RTT_MIN_POOL:
            continue
        median = statistics.median(members.values())
        for backend, rtt in sorted(members.items()):
            if rtt > RTT_FACTOR * median and rtt > RTT_MIN_MS:
                out.append(Finding(
                    "warning", "probes", f"{backend}: probe RTT {rtt:.1f} ms "
                    f"({rtt / median if median else math.inf:.0f}x the pool's median)",
                    "Its health probe answers far slower than its pool's peers: the node is "
                    "overloaded (CPU, softirq), its link is congested or erroring, or it sits "
                    "on a longer path.",
                    f"The node's load and NIC counters, `ping` it from the appliance; its "
                    f"telemetry (`hpclb backend show {backend}`).",
                    {"backend": backend, "pool": pool, "rtt_ms": rtt,
                     "pool_median_ms": round(median, 3), "pool_size": len(members)}))
    if not out:
        out.append(_ok("probes", "no probe RTT outliers",
                       {"pools": {p: len(m) for p, m in sorted(by_pool.items())}}))
    return out


# ---- flapping backends ---------------------------------------------------------------

FLAP_WINDOW_S = 600.0
FLAP_TRANSITIONS = 3


def _backends(inp: DiagnoseInputs) -> list[Finding]:
    now = float(inp.status.get("time") or time.time())
    recent: dict[str, list[Mapping[str, Any]]] = {}
    for t in inp.status.get("transitions") or []:
        if now - float(t.get("time", 0)) <= FLAP_WINDOW_S:
            recent.setdefault(str(t.get("backend")), []).append(t)
    health: Mapping[str, Mapping[str, Any]] = inp.status.get("health") or {}
    out: list[Finding] = []
    for backend, changes in sorted(recent.items()):
        if len(changes) < FLAP_TRANSITIONS:
            continue
        reasons = sorted({str(c.get("reason", "")) for c in changes if c.get("reason")})
        damping = (health.get(backend) or {}).get("damping")
        out.append(Finding(
            "warning", "backends",
            f"{backend} flapping: {len(changes)} up/down changes in "
            f"{FLAP_WINDOW_S / 60:.0f} min",
            "Its health verdict keeps changing: the node or its service restarts in a loop, "
            "probes time out near their limit, or the link drops now and then. Each change "
            "moves its flows (weight to 0 and back).",
            "The node's service logs and load; the probe's timeout against its RTT; flap "
            "damping (the pool's `probe.damping`) holds it down while it flaps.",
            {"backend": backend, "changes": len(changes), "reasons": reasons,
             "last": [dict(c) for c in changes[-FLAP_TRANSITIONS:]], "damping": damping}))
    # Unknown verdicts (a local fault, rule 2) are not a backend's failure: left out.
    down = sorted(b for b, h in health.items()
                  if not h.get("up") and not h.get("unknown") and b not in recent)
    if down:
        out.append(Finding("info", "backends", f"{len(down)} backend(s) down",
                           "Their health verdict is down (not flapping).",
                           "`hpclb backend show NAME` for each.", {"backends": down}))
    if not any(f.severity == "warning" for f in out):
        out.insert(0, _ok("backends", "no backend flapping",
                          {"transitions_10min": sum(len(c) for c in recent.values())}))
    return out


# ---- the control plane's own faults ---------------------------------------------------

def _control(inp: DiagnoseInputs) -> list[Finding]:
    out = [Finding("warning", "control", f"alarm: {a.get('source')}",
                   str(a.get("message", "")),
                   "The control plane's log; a local fault makes verdicts unknown, never "
                   "backends down.", dict(a))
           for a in inp.status.get("alarms") or []]
    push = inp.status.get("push") or {}
    if inp.status.get("pushes_pending"):
        out.append(Finding("warning", "control", "table push pending",
                           "The data plane does not hold the tables the control plane wants "
                           "(a push failed and is retried).",
                           "The control plane's log for the push error; `hpclb stats` "
                           "answers?", dict(push)))
    if not out:
        out.append(_ok("control", "no alarms, tables pushed", dict(push)))
    return out


# ---- gathering the inputs from the live system -------------------------------------

def gather(status: Callable[[], Status | None], nic_source: NicStatsSource | None,
           memory_history: Iterable[MemorySample] = (), config: ConfigFacts | None = None,
           interval_s: float = 2.0,
           hugepage_reader: Callable[[], Hugepages | None] = procinfo.hugepages,
           hugetlb_reader: Callable[[int], int | None] = procinfo.hugetlb_bytes,
           sleep: Callable[[float], None] = time.sleep) -> DiagnoseInputs:
    """Read the live pieces twice, `interval_s` apart (counters that rise in
    between are happening now), and return the inputs of `diagnose`.
    `status` is the controller's snapshot reader (refreshed every second, so
    `interval_s` >= 1 gives two different snapshots)."""
    first = status()
    if first is None:
        raise LookupError("no status snapshot yet: the controller has not run a turn")
    names = _interfaces(first)
    nic_before = nic_source(names) if nic_source and names else None
    t0 = time.monotonic()
    if interval_s > 0:
        sleep(interval_s)
    nic_now = nic_source(names) if nic_source and names else None
    elapsed = time.monotonic() - t0
    second = status() or first
    pid = (second.get("dataplane_info") or {}).get("pid")
    return DiagnoseInputs(
        status=second, previous_status=first if second is not first else None,
        # A test's sleep does not sleep: then the interval asked for stands.
        nic=nic_now, nic_previous=nic_before,
        nic_interval_s=max(elapsed, interval_s) if nic_now is not None else None,
        hugepages=hugepage_reader(), dataplane_hugetlb_bytes=hugetlb_reader(pid) if pid else None,
        memory_history=list(memory_history), config=config or ConfigFacts())
