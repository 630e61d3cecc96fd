"""`hpclb diagnose`'s analysis (faces/diagnose.py), pure: a clean appliance gives
only ok/info findings, one per area at least; each planted fault is named, in
its area, with its severity. NIC counters come from a fake NicStatsSource
through `gather`, as the live system's would."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from hpclb.config import parse_config
from hpclb.faces import diagnose_render
from hpclb.faces.diagnose import (
    AREAS,
    ConfigFacts,
    DiagnoseInputs,
    Finding,
    diagnose,
    gather,
    memory_trend,
)
from hpclb.host.nicstats import NicCounters
from hpclb.host.procinfo import HugepagePool, Hugepages

NOW = 1_900_000_000.0
MIB = 1 << 20


class FakeNicStats:
    """A NicStatsSource with canned answers, one per call (the last repeated)."""

    def __init__(self, *answers: NicCounters) -> None:
        self.answers = list(answers)
        self.asked: list[list[str]] = []

    def __call__(self, ifnames: Sequence[str]) -> NicCounters:
        answer = self.answers[min(len(self.asked), len(self.answers) - 1)]
        self.asked.append(list(ifnames))
        return {n: dict(answer[n]) for n in ifnames if n in answer}


def status(t: float = NOW, rx: int = 100_000, **drops: int) -> dict[str, Any]:
    """A healthy XDP appliance's snapshot (the API spec's keys)."""
    backends = ["b1", "b2", "b3", "b4"]
    counters = {"rx": rx, "fwd_tx": rx, "pass_not_vip": 10, "drop_malformed": 0,
                "drop_no_backend": 0, "drop_tx_error": 0, "flow_evict": 0, "conn_evict": 0,
                **drops}
    return {
        "time": t, "dataplane": "xdp", "pushes_pending": False, "alarms": [],
        "revision": "0123456789abcdef",
        "health": {b: {"up": True, "probe_up": True, "unknown": False} for b in backends},
        "pools": {b: "web" for b in backends},
        "ids": {"vips": {"web": 0}, "backends": {b: i for i, b in enumerate(backends)}},
        "rtt_ms": {"b1": 0.4, "b2": 0.5, "b3": 0.45, "b4": None},
        "transitions": [{"backend": "b2", "up": False, "reason": "timeout", "time": NOW - 5000},
                        {"backend": "b2", "up": True, "reason": "probe ok", "time": NOW - 4900},
                        {"backend": "b3", "up": False, "reason": "refused", "time": NOW - 60}],
        "push": {"count": 5, "failures": 0, "last_duration_s": 0.01, "last_at": NOW - 30},
        "memory": {"control_rss_bytes": 80 * MIB, "dataplane_rss_bytes": 12 * MIB},
        "dataplane_info": {"kind": "xdp", "reason": "configured", "attach_mode": "native",
                           "pid": 4242, "capabilities": ["dsr"], "netns": None,
                           "interfaces": {"ingress": "eth1", "egress": ["eth2"]}},
        "dataplane_stats": {"counters": counters, "vips": [[0, rx, rx * 100]],
                            "backends": [[i, rx // 4, rx * 25] for i in range(4)]},
    }


NIC_CLEAN = {"rx_packets": 1000, "tx_packets": 1000, "rx_errors": 0, "rx_crc_errors": 0,
             "rx_missed_errors": 0, "rx_dropped": 0, "ethtool:rx_queue_0_drops": 0,
             "ethtool:rx_queue_0_xdp_drops": 0, "ethtool:peer_ifindex": 7}


def nic(**changes: int) -> NicCounters:
    return {"eth1": {**NIC_CLEAN, **changes}, "eth2": dict(NIC_CLEAN)}


def flat_history(hours: float = 3.0, control: float = 80 * MIB,
                 dataplane: float | None = 12 * MIB) -> list[tuple[float, int, int | None]]:
    n = int(hours * 60)
    return [(NOW - (n - i) * 60.0, int(control), None if dataplane is None else int(dataplane))
            for i in range(n)]


def inputs(**kw: Any) -> DiagnoseInputs:
    """A clean appliance; keywords replace parts of it."""
    base: dict[str, Any] = dict(
        status=status(), previous_status=status(NOW - 2, rx=99_000),
        nic=nic(rx_packets=2000, tx_packets=2000), nic_previous=nic(), nic_interval_s=2.0,
        hugepages=None, memory_history=flat_history(), config=ConfigFacts(dataplane="xdp"))
    base.update(kw)
    return DiagnoseInputs(**base)


def found(findings: list[Finding], area: str, severity: str, words: str) -> Finding:
    hits = [f for f in findings if f.area == area and f.severity == severity and words in f.title]
    assert hits, [(f.severity, f.area, f.title) for f in findings]
    return hits[0]


def not_ok(findings: list[Finding]) -> list[tuple[str, str, str]]:
    return [(f.severity, f.area, f.title) for f in findings if f.severity in ("warning",
                                                                             "critical")]


# ---- the clean appliance ---------------------------------------------------------

def test_clean_appliance_gives_only_ok_and_info_with_every_area_checked() -> None:
    findings = diagnose(inputs())
    assert not_ok(findings) == []
    assert {f.area for f in findings} == set(AREAS)
    for area in AREAS:  # what was checked shows, an ok line per area
        assert any(f.area == area and f.severity == "ok" for f in findings), area
    # b3 went down once a minute ago: down, not flapping
    down = found(findings, "backends", "ok", "no backend flapping")
    assert down.evidence["transitions_10min"] == 1
    json.dumps([f.to_dict() for f in findings])  # the API's body is plain JSON


# ---- flapping backends -------------------------------------------------------------

def transitions(backend: str, times: list[float]) -> list[dict[str, Any]]:
    return [{"backend": backend, "up": i % 2 == 1, "reason": "timeout" if i % 2 == 0 else "ok",
             "time": t} for i, t in enumerate(times)]


def test_flapping_backend_is_named() -> None:
    st = status()
    st["transitions"] += transitions("b4", [NOW - 500, NOW - 300, NOW - 200, NOW - 20])
    st["health"]["b4"]["damping"] = {"suppressed": True, "penalty": 2500.0, "release_at": NOW}
    f = found(diagnose(inputs(status=st)), "backends", "warning", "b4 flapping")
    assert f.evidence["changes"] == 4
    assert f.evidence["damping"]["suppressed"] is True
    assert f.meaning and f.next


@pytest.mark.parametrize("times", [
    [NOW - 300, NOW - 20],  # two changes: down and back up once is no flap
    [NOW - 2000, NOW - 1500, NOW - 1000, NOW - 700],  # four, but older than 10 minutes
])
def test_no_flap_below_three_changes_in_ten_minutes(times: list[float]) -> None:
    st = status()
    st["transitions"] += transitions("b4", times)
    assert not_ok(diagnose(inputs(status=st))) == []


# ---- probe RTT outliers ------------------------------------------------------------

def test_rtt_outlier_is_named() -> None:
    st = status()
    st["rtt_ms"]["b4"] = 20.0
    f = found(diagnose(inputs(status=st)), "probes", "warning", "b4")
    assert f.evidence["pool_median_ms"] == pytest.approx(0.475)


@pytest.mark.parametrize("rtts", [
    {"b1": 0.4, "b2": 0.5, "b3": 0.45, "b4": 3.0},  # 6x the median but only 3 ms
    {"b1": 10.0, "b2": 11.0, "b3": 12.0, "b4": 14.0},  # a slow pool, nobody far above it
    {"b1": 0.4, "b2": 30.0, "b3": None, "b4": None},  # two RTTs: no median to judge by
])
def test_no_rtt_outlier(rtts: dict[str, float | None]) -> None:
    st = status()
    st["rtt_ms"] = rtts
    assert not_ok(diagnose(inputs(status=st))) == []


# ---- NIC counters, from a fake source through gather ------------------------------------

def gathered(st0: dict[str, Any], st1: dict[str, Any], source: FakeNicStats,
             **kw: Any) -> DiagnoseInputs:
    snapshots = iter([st0, st1])
    slept: list[float] = []
    out = gather(lambda: next(snapshots), source, flat_history(),
                 ConfigFacts(dataplane="xdp"), interval_s=2.0, hugepage_reader=lambda: None,
                 hugetlb_reader=lambda pid: None, sleep=slept.append, **kw)
    assert slept == [2.0]
    return out


def test_nic_errors_rising_from_a_fake_source() -> None:
    source = FakeNicStats(nic(rx_crc_errors=5, **{"ethtool:rx_queue_0_xdp_drops": 50}),
                          nic(rx_packets=101_000, rx_crc_errors=25, rx_missed_errors=1500,
                              **{"ethtool:rx_queue_0_drops": 3,
                                 "ethtool:rx_queue_0_xdp_drops": 900}))
    inp = gathered(status(NOW - 2), status(), source)
    assert source.asked == [["eth1", "eth2"], ["eth1", "eth2"]]
    assert inp.nic_interval_s == pytest.approx(2.0, abs=0.5)
    findings = diagnose(inp)
    crc = found(findings, "nic", "warning", "eth1: rx_crc_errors rising")
    assert crc.evidence["delta"] == 20 and crc.evidence["per_s"] == pytest.approx(10, rel=0.3)
    assert "cabling" in crc.meaning and "ethtool -m eth1" in crc.next
    # 1500 missed against 100,000 packets: over 1 % lost now is critical
    missed = found(findings, "nic", "critical", "eth1: rx_missed_errors rising")
    assert "keep up" in missed.meaning
    found(findings, "nic", "warning", "ethtool:rx_queue_0_drops rising")
    # the program's own XDP_DROP verdicts are not a NIC fault; eth2 is clean
    assert not any("xdp_drops" in f.title or "eth2" in f.title for f in findings)


def test_nic_error_total_not_rising_is_info() -> None:
    source = FakeNicStats(nic(rx_crc_errors=7))
    findings = diagnose(gathered(status(NOW - 2), status(), source))
    f = found(findings, "nic", "info", "eth1: rx_crc_errors = 7 (not rising now)")
    assert f.evidence["total"] == 7
    assert not_ok(findings) == []


def test_dpdk_port_counters_rising() -> None:
    def dpdk(t: float, missed: int, nombuf: int) -> dict[str, Any]:
        st = status(t)
        st["dataplane_info"].update(kind="dpdk", attach_mode="poll")
        st["dataplane_stats"]["ports"] = [
            {"rx_packets": 10**6, "tx_packets": 10**6, "rx_missed": missed, "rx_errors": 0,
             "tx_errors": 0, "rx_nombuf": nombuf, "rx_crc_errors": 0}, {}]
        return st
    findings = diagnose(inputs(status=dpdk(NOW, 40, 3), previous_status=dpdk(NOW - 2, 0, 3),
                               nic=None, nic_previous=None,
                               hugepages=pool(total=256, free=0), dataplane_hugetlb_bytes=512 * MIB,
                               config=ConfigFacts(dataplane="dpdk", hugepages_mb=512)))
    f = found(findings, "nic", "warning", "port 0 (eth1): rx_missed rising")
    assert f.evidence["source"] == "dpdk" and f.evidence["delta"] == 40
    found(findings, "nic", "info", "port 0 (eth1): rx_nombuf = 3 (not rising now)")


def test_no_counters_at_all_says_so() -> None:
    findings = diagnose(inputs(nic=None, nic_previous=None))
    found(findings, "nic", "info", "no NIC counters read")


# ---- drops by reason ---------------------------------------------------------------

def test_drops_rising_by_reason() -> None:
    now = status(rx=102_000, drop_no_backend=700, drop_malformed=9, drop_conn_full=50,
                 drop_future_reason=4)
    before = status(NOW - 2, rx=100_000, drop_no_backend=100, drop_malformed=9,
                    drop_conn_full=10, drop_future_reason=1)
    findings = diagnose(inputs(status=now, previous_status=before))
    nb = found(findings, "drops", "critical", "drop_no_backend rising")
    assert nb.evidence["per_s"] == 300 and nb.evidence["share_of_rx"] == 0.3
    assert "no up backend" in nb.meaning
    found(findings, "drops", "critical", "drop_conn_full rising")
    found(findings, "drops", "warning", "drop_future_reason rising")
    found(findings, "drops", "info", "drop_malformed = 9 (not rising now)")


def test_drop_totals_without_an_earlier_snapshot_are_info() -> None:
    findings = diagnose(inputs(status=status(drop_no_backend=5), previous_status=None))
    found(findings, "drops", "info", "drop_no_backend = 5")
    assert not_ok(findings) == []


# ---- XDP attach mode -------------------------------------------------------------------

def with_attach(mode: str) -> dict[str, Any]:
    st = status()
    st["dataplane_info"]["attach_mode"] = mode
    return st


def test_generic_xdp_fallback_is_a_warning_with_the_causes() -> None:
    f = found(diagnose(inputs(status=with_attach("generic"),
                              config=ConfigFacts(dataplane="xdp", xdp_mode="auto"))),
              "xdp", "warning", "generic")
    assert "MTU" in f.meaning and "xdp.mode" in f.next


def test_generic_xdp_as_configured_is_info() -> None:
    findings = diagnose(inputs(status=with_attach("generic"),
                               config=ConfigFacts(dataplane="xdp", xdp_mode="generic")))
    found(findings, "xdp", "info", "as configured")
    assert not_ok(findings) == []


# ---- table fill -------------------------------------------------------------------------

@pytest.mark.parametrize(("entries", "severity"), [(950, "critical"), (800, "warning"),
                                                   (100, "ok")])
def test_nat_connection_table_fill(entries: int, severity: str) -> None:
    st = status()
    st["dataplane_stats"]["conns"] = {"capacity": 1000, "entries": entries,
                                      "by_state": {"established": entries // 2},
                                      "snat_ports_in_use": 0, "expired": 0}
    f = found(diagnose(inputs(status=st)), "tables", severity, "NAT connection table")
    assert f.evidence["fill"] == entries / 1000


def test_flow_evictions_rising() -> None:
    findings = diagnose(inputs(status=status(flow_evict=90),
                               previous_status=status(NOW - 2, flow_evict=10)))
    assert found(findings, "tables", "warning", "flow_evict").evidence["delta"] == 80


# ---- hugepages ---------------------------------------------------------------------------

def pool(total: int, free: int) -> Hugepages:
    return Hugepages(default_size_kb=2048, total=total, free=free, reserved=0, surplus=0,
                     pools={2048: HugepagePool(size_kb=2048, total=total, free=free)})


def dpdk_status() -> dict[str, Any]:
    st = status()
    st["dataplane_info"].update(kind="dpdk", attach_mode="poll")
    return st


@pytest.mark.parametrize(("pages", "held_mb", "severity", "words"), [
    (pool(0, 0), None, "critical", "no hugepages reserved"),
    (None, None, "critical", "no hugepages reserved"),
    (pool(256, 0), 256, "warning", "too few hugepages for a restart"),  # 512 held by others
    (pool(256, 0), 512, "info", "every hugepage is in use"),
    (pool(512, 256), 512, "ok", "free"),
])
def test_hugepages_for_dpdk(pages: Hugepages | None, held_mb: int | None, severity: str,
                            words: str) -> None:
    found(diagnose(inputs(status=dpdk_status(), hugepages=pages,
                          dataplane_hugetlb_bytes=None if held_mb is None else held_mb * MIB,
                          config=ConfigFacts(dataplane="dpdk", hugepages_mb=512))),
          "hugepages", severity, words)


def test_hugepages_why_auto_chose_xdp() -> None:
    found(diagnose(inputs(hugepages=pool(16, 16),
                          config=ConfigFacts(dataplane="auto", hugepages_mb=512))),
          "hugepages", "info", "too few free hugepages for DPDK")


# ---- memory growth ----------------------------------------------------------------------

def series(hours: float, f: Any) -> list[tuple[float, float]]:
    n = int(hours * 60)
    return [(NOW - (n - i) * 60.0, f(i / 60.0)) for i in range(n)]


def test_memory_trend_measures_the_slope() -> None:
    rng = random.Random(1)
    trend = memory_trend(series(3, lambda h: 60 * MIB + 10 * MIB * h + rng.gauss(0, MIB)),
                         3600.0 * 2)
    assert trend is not None
    assert trend.slope_mib_per_hour == pytest.approx(10, rel=0.1)
    assert trend.r2 > 0.9 and trend.steady_growth


def history(control: list[tuple[float, float]]) -> list[tuple[float, int, int | None]]:
    return [(t, int(v), None) for t, v in control]


def test_growing_memory_is_flagged() -> None:
    rng = random.Random(2)
    grow = series(4, lambda h: 60 * MIB + 8 * MIB * h + rng.gauss(0, 0.5 * MIB))
    f = found(diagnose(inputs(memory_history=history(grow))), "memory", "warning",
              "control plane memory growing")
    assert f.evidence["mib_per_hour"] == pytest.approx(8, rel=0.15)
    assert f.evidence["r2"] >= 0.9 and "leak" in f.meaning


def test_growing_data_plane_memory_is_flagged_apart() -> None:
    hist = [(t, 80 * MIB, int(20 * MIB + 6 * MIB * (i / 60)))
            for i, (t, _, _) in enumerate(flat_history(hours=5))]
    findings = diagnose(inputs(memory_history=hist))
    found(findings, "memory", "warning", "data plane memory growing")
    assert not any("control plane" in f.title for f in findings)


@pytest.mark.parametrize("shape", ["flat", "noisy", "step", "sawtooth", "restart"])
def test_memory_not_flagged(shape: str) -> None:
    rng = random.Random(3)
    shapes = {
        "flat": lambda h: 80 * MIB + rng.gauss(0, 0.2 * MIB),
        # big swings, no trend (an allocator returning memory, caches)
        "noisy": lambda h: 80 * MIB + rng.uniform(-30, 30) * MIB,
        # one jump of 40 MiB (a reload with a larger configuration), then flat
        "step": lambda h: 80 * MIB + (40 * MIB if h > 2 else 0) + rng.gauss(0, 0.2 * MIB),
        # caches filling and being dropped every 20 minutes
        "sawtooth": lambda h: 80 * MIB + 30 * MIB * ((h * 3) % 1),
        # grew before the process restarted (RSS fell), flat since
        "restart": lambda h: (200 * MIB + 30 * MIB * h) if h < 2 else 80 * MIB,
    }
    findings = diagnose(inputs(memory_history=history(series(4, shapes[shape]))))
    assert not [f for f in findings if f.area == "memory" and f.severity != "ok"], shape


def test_short_memory_history_is_not_judged() -> None:
    grow = series(0.5, lambda h: 60 * MIB + 100 * MIB * h)
    found(diagnose(inputs(memory_history=history(grow))), "memory", "info", "too little")


# ---- the control plane's alarms -------------------------------------------------------------

def test_alarm_and_pending_push() -> None:
    st = status()
    st["alarms"] = [{"source": "probes", "message": "descriptors exhausted"}]
    st["pushes_pending"] = True
    findings = diagnose(inputs(status=st))
    assert found(findings, "control", "warning", "alarm: probes").meaning == \
        "descriptors exhausted"
    found(findings, "control", "warning", "table push pending")


# ---- several faults at once: ordering ------------------------------------------------------

def test_worst_first() -> None:
    st = copy.deepcopy(status(drop_no_backend=50))
    st["transitions"] += transitions("b4", [NOW - 100, NOW - 80, NOW - 60])
    findings = diagnose(inputs(status=st, previous_status=status(NOW - 2, drop_no_backend=0)))
    ranks = ["critical", "warning", "info", "ok"]
    order = [ranks.index(f.severity) for f in findings]
    assert order == sorted(order)
    assert findings[0].title.startswith("drop_no_backend")


# ---- configuration facts and rendering ------------------------------------------------------

def test_config_facts_from_a_configuration() -> None:
    text = (Path(__file__).resolve().parents[2] / "appliance" / "examples" / "nat.yaml").read_text()
    cfg = parse_config(text, "nat.yaml")
    facts = ConfigFacts.from_config(cfg)
    assert facts.conn_table_size == cfg.nat.conn_table_size
    assert facts.xdp_mode == cfg.appliance.xdp.mode.value
    assert facts.hugepages_mb == cfg.appliance.dpdk.hugepages_mb


def test_render_terminal_and_json_round_trip() -> None:
    st = status()
    st["transitions"] += transitions("b4", [NOW - 100, NOW - 80, NOW - 60])
    findings = diagnose(inputs(status=st))
    console = Console(record=True, width=140, color_system=None)
    diagnose_render.render(findings, console, verbose=True)
    text = console.export_text()
    assert "b4 flapping" in text and "next:" in text and "warning" in text
    assert "no NIC errors" in text
    body = json.loads(diagnose_render.dumps(findings, NOW))
    assert body["time"] == NOW
    assert diagnose_render.from_json(body) == findings
    with pytest.raises(ValueError, match="not a finding"):
        diagnose_render.from_json({"findings": [{"severity": "fatal"}]})


def test_gather_without_a_status_refuses() -> None:
    with pytest.raises(LookupError, match="no status"):
        gather(lambda: None, None, sleep=lambda s: None)


def test_gather_reads_the_data_plane_hugetlb_pages() -> None:
    pids: list[int] = []

    def hugetlb(pid: int) -> int:
        pids.append(pid)
        return 512 * MIB

    snapshots = iter([dpdk_status(), dpdk_status()])
    inp = gather(lambda: next(snapshots), None, (), ConfigFacts(dataplane="dpdk",
                                                                hugepages_mb=512),
                 hugepage_reader=lambda: pool(256, 0), hugetlb_reader=hugetlb,
                 sleep=lambda s: None)
    assert pids == [4242] and inp.dataplane_hugetlb_bytes == 512 * MIB
    assert inp.nic is None and inp.memory_history == []


def test_next_steps_name_the_ports() -> None:
    st = with_attach("generic")
    st["dataplane_info"]["interfaces"] = {"ingress": "ens1f0", "egress": []}
    f = found(diagnose(inputs(status=st)), "xdp", "warning", "generic")
    assert "ethtool -i ens1f0" in f.next and "IFACE" not in f.next
