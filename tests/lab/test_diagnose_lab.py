"""Lab: `hpclb diagnose` names faults planted in a running appliance.

One appliance (XDP, a static pool of three backends with a fast TCP probe and
flap damping off, the REST API on its management address) for the module:

* clean, GET /api/v1/diagnose reports every area and nothing worse than info;
* b2's link toggled down and up four times (each change waited for in the
  API's health verdict): diagnose names b2 flapping, and no other backend;
* a VIP on a pool with no backend, added through the API, fed UDP while
  diagnose watches the counters: a drops finding for drop_no_backend, with its
  rate;
* b3's handshake answers held 40 ms (a delay line: this kernel has no
  netem): diagnose names b3's probe RTT;
* growing memory: the analysis wants an hour of one-a-minute history, which a
  test cannot wait for. The series is real but the clock compressed: a child
  process allocates and writes 1.5 MiB per step (in lock-step with the sampler,
  so that a loaded host cannot bend the line), its resident memory is read
  from /proc after each step (``procinfo.rss_bytes``), and the samples are
  given timestamps one minute apart; ``gather``/``diagnose`` over the live
  appliance's status with that history must warn of it;
* the CLI, `hpclb diagnose --api ... --token-file ...`, run inside the
  appliance's namespace (where the API is), exits 0 and prints the flapping
  finding.

NIC error counters cannot be injected into a veth; those are checked with a
fake netlink source in tests/unit/test_diagnose.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpclb.faces.diagnose import AREAS, ConfigFacts, MemorySample, diagnose, gather
from hpclb.host import procinfo
from hpclb.host.nicstats import NetlinkNicStats
from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LabAppliance
from hpclb.lab.topology import ETH, Lab, default_pass_obj

from . import polling

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="lab tests need root (network namespaces, veth, XDP, tc)")

WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 1.0}
# Fast, and every change of verdict a transition: damping off.
PROBE: dict[str, Any] = {"kind": "tcp", "port": LAB_PORT, "interval_s": 0.5, "timeout_s": 0.5,
                         "rise": 2, "fall": 2, "damping": {"enabled": False}}
# A verdict changes within fall (or rise) x interval + a timeout; slack for a loaded host.
VERDICT_WITHIN_S = 20.0
FLAPS = 4
DELAY_MS = 40
BLACKHOLE_PORT = 9090  # the VIP whose pool has no backend
DELAY_LINE = Path(__file__).with_name("delay_line.py")

Finding = dict[str, Any]


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(prefix=f"d{uuid.uuid4().hex[:6]}", backends=3,
             peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT)
        yield lab


@pytest.fixture(scope="module")
def appliance(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabAppliance]:
    with LabAppliance(lab, tmp_path_factory.mktemp("diagnose"), WEIGHTS, dataplane="xdp",
                      probe=PROBE, api=True) as app:
        app.wait_status(lambda s: all((s.get("health") or {}).get(b, {}).get("up")
                                      for b in WEIGHTS), what="every backend up")
        yield app


def get(app: LabAppliance, path: str) -> Any:
    r = app.api("GET", path, app.read_token)
    assert r.status_code == 200, (path, r.text)
    return r.json()


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = VERDICT_WITHIN_S) -> Any:
    return polling.wait_for(what, probe, timeout_s, interval_s=0.1)


def health(app: LabAppliance, backend: str) -> dict[str, Any]:
    return dict(get(app, f"/api/v1/backends/{backend}")["health"])


def findings(app: LabAppliance) -> list[Finding]:
    """GET /api/v1/diagnose (it watches the counters for 2 s)."""
    return list(get(app, "/api/v1/diagnose")["findings"])


def of_area(found: list[Finding], area: str) -> list[Finding]:
    return [f for f in found if f["area"] == area]


def summary(found: list[Finding]) -> str:
    return "\n".join(f"{f['severity']:8} {f['area']:9} {f['title']}" for f in found)


def flapping(found: list[Finding]) -> list[Finding]:
    return [f for f in of_area(found, "backends") if f["severity"] == "warning"
            and "flapping" in f["title"]]


def wait_verdict(app: LabAppliance, backend: str, up: bool) -> None:
    wait_for(f"{backend} {'up' if up else 'down'} in the API",
             lambda: health(app, backend)["up"] is up)


@pytest.fixture(scope="module")
def flapped(lab: Lab, appliance: LabAppliance) -> None:
    """b2's link down and up FLAPS times, each change seen in the API's verdict."""
    try:
        for _ in range(FLAPS):
            for up in (False, True):
                lab.set_backend_link(2, up=up)
                wait_verdict(appliance, "b2", up)
    finally:
        lab.set_backend_link(2, up=True)
    wait_for("b2 up with a probe RTT", lambda: (h := health(appliance, "b2"))["up"]
             and h["rtt_ms"] is not None)


def test_a_clean_appliance_reports_every_area_and_nothing_wrong(
        appliance: LabAppliance) -> None:
    found = findings(appliance)
    assert {f["area"] for f in found} == set(AREAS), summary(found)
    bad = [f for f in found if f["severity"] not in ("ok", "info")]
    assert bad == [], summary(found)
    xdp = of_area(found, "xdp")
    assert [f["severity"] for f in xdp] == ["ok"] and "native" in xdp[0]["title"], xdp
    assert [f["severity"] for f in of_area(found, "backends")] == ["ok"], summary(found)


def test_a_flapping_backend_is_named(appliance: LabAppliance, flapped: None) -> None:
    found = findings(appliance)
    flaps = flapping(found)
    assert [f["evidence"]["backend"] for f in flaps] == ["b2"], summary(found)
    (flap,) = flaps
    print(f"flapping: {flap['title']}")
    # Down and up FLAPS times; the start's first verdict may count as one more.
    assert flap["evidence"]["changes"] >= 2 * FLAPS, flap
    assert flap["title"].startswith("b2 flapping:")
    assert flap["meaning"] and flap["next"]
    assert not any(b in f["title"] for f in of_area(found, "backends")
                   for b in ("b1", "b3")), summary(found)


def test_drops_rising_now_are_named_with_their_rate(lab: Lab,
                                                    appliance: LabAppliance) -> None:
    """A VIP whose pool has no backend, fed 300 datagrams a second while
    diagnose watches the counters: drop_no_backend rising, critical."""
    r = appliance.api("PUT", "/api/v1/pools/empty", json={"weights": "static", "backends": []})
    assert r.status_code == 200, r.text
    stream: subprocess.Popen[str] | None = None
    try:
        r = appliance.api("PUT", "/api/v1/vips/blackhole",
                          json={"address": LAB_VIP, "port": BLACKHOLE_PORT, "protocol": "udp",
                                "pool": "empty"})
        assert r.status_code == 200, r.text
        # The status snapshot (refreshed every second) knows the VIP.
        wait_for("the VIP's id", lambda: get(appliance, "/api/v1/vips/blackhole")["id"]
                 is not None)
        stream = lab.popen("cli", [sys.executable, "-m", "hpclb.lab.node", "udpstream",
                                   "--vip", LAB_VIP, "--port", str(BLACKHOLE_PORT),
                                   "--sports", "27000-27099", "--pps", "300",
                                   "--duration", "8", "--linger", "0.1", "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for("the first drops", lambda: get(appliance, "/api/v1/counters")["drops"]
                 .get("drop_no_backend", 0) > 0)
        found = findings(appliance)
    finally:
        if stream is not None:  # it has done its part: no need to wait for its end
            stream.kill()
            stream.wait()
        appliance.api("DELETE", "/api/v1/vips/blackhole")
        appliance.api("DELETE", "/api/v1/pools/empty")
    drops = [f for f in of_area(found, "drops")
             if f["evidence"].get("counter") == "drop_no_backend"]
    assert len(drops) == 1, summary(found)
    (drop,) = drops
    print(f"drops: {drop['title']}, evidence {drop['evidence']}")
    assert drop["severity"] == "critical", drop
    assert re.fullmatch(r"drop_no_backend rising \(\d+(\.\d)?/s\)", drop["title"]), drop
    assert drop["evidence"]["per_s"] > 0 and drop["evidence"]["delta"] > 0, drop
    assert drop["meaning"] and drop["next"]


def test_a_probe_rtt_outlier_is_named(lab: Lab, appliance: LabAppliance,
                                      flapped: None) -> None:
    """b3's SYN-ACKs held 40 ms (``delay_line.py``: this kernel has no netem):
    b3's probe RTT is far above its pool's median, and only b3's."""
    # Every backend must have an RTT: the pool's median needs three.
    for b in WEIGHTS:
        wait_for(f"{b} up with a probe RTT", lambda b=b: (h := health(appliance, b))["up"]
                 and h["rtt_ms"] is not None)
    line: subprocess.Popen[str] | None = None
    try:
        line = lab.popen("b3", [sys.executable, str(DELAY_LINE), "run", ETH, str(LAB_PORT),
                                str(DELAY_MS)], stdout=subprocess.PIPE)
        assert line.stdout is not None and line.stdout.readline() == "ready\n", line.poll()
        wait_for("b3's probe RTT to show the delay",
                 lambda: (health(appliance, "b3")["rtt_ms"] or 0) >= DELAY_MS * 0.9)
        found = findings(appliance)
    finally:
        if line is not None:
            line.kill()
            line.wait()
        lab.exec("b3", [sys.executable, str(DELAY_LINE), "remove", ETH], check=False)
    outliers = [f for f in of_area(found, "probes") if f["severity"] == "warning"]
    assert [f["evidence"]["backend"] for f in outliers] == ["b3"], summary(found)
    (outlier,) = outliers
    print(f"probes: {outlier['title']}")
    assert outlier["title"].startswith("b3: probe RTT")
    assert outlier["evidence"]["rtt_ms"] >= DELAY_MS * 0.9
    assert outlier["evidence"]["pool_size"] == 3
    # Undone: the diverting filter is gone from b3's interface (no clsact qdisc
    # left), so later tests see b3 as it was; no round-trip bound is asserted.
    qdiscs = lab.exec("b3", ["tc", "qdisc", "show", "dev", ETH]).stdout
    assert "clsact" not in qdiscs, qdiscs
    wait_for("b3 still up after the delay line", lambda: health(appliance, "b3")["up"])


# Holds what it is told to allocate, each byte written (resident, not just mapped):
# one step per line on stdin, "ok" on stdout when done.
GROWER = """
import sys
held = []
step = int(sys.argv[1])
for _ in sys.stdin:
    held.append(b"\\x01" * step)
    sys.stdout.write("ok\\n")
    sys.stdout.flush()
"""
GROWTH_STEP = 3 << 19  # 1.5 MiB
GROWTH_SAMPLES = 80  # minutes on the compressed clock: 10 of warm-up, then > 50 judged


def grow_and_sample(rss_other: Callable[[], int | None]) -> list[MemorySample]:
    """The grower's RSS after each of its steps, as the control plane's, and
    ``rss_other()`` at the same moments as the data plane's; stamped one minute
    apart, the last now."""
    proc = subprocess.Popen([sys.executable, "-c", GROWER, str(GROWTH_STEP)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        readings: list[tuple[int, int | None]] = []
        for i in range(GROWTH_SAMPLES):
            if i:
                proc.stdin.write("\n")
                proc.stdin.flush()
                assert proc.stdout.readline() == "ok\n", f"the grower died: {proc.poll()}"
            rss = procinfo.rss_bytes(proc.pid)
            assert rss is not None
            readings.append((rss, rss_other()))
    finally:
        proc.kill()
        proc.wait()
    end = time.time()
    return [(end - 60.0 * (len(readings) - 1 - i), rss, other)
            for i, (rss, other) in enumerate(readings)]


def test_growing_memory_is_named(lab: Lab, appliance: LabAppliance) -> None:
    """A real growing process's RSS (the control plane's place in the history)
    beside the real, steady data plane's, on a clock compressed to a minute a
    step, through gather and diagnose with the live appliance's status."""
    dataplane_pid = appliance.dataplane_pid()
    history = grow_and_sample(lambda: procinfo.rss_bytes(dataplane_pid))
    grown = history[-1][1] - history[0][1]
    assert grown >= 100 << 20, f"the grower's RSS rose only {grown >> 20} MiB"
    assert all(s[2] for s in history), "no RSS of the data plane"
    inputs = gather(appliance.status, NetlinkNicStats(lab.lb_ns), memory_history=history,
                    config=ConfigFacts(dataplane="xdp"), interval_s=1.0)
    assert inputs.nic is not None and ETH in inputs.nic  # the appliance's port, read live
    found = [f.to_dict() for f in diagnose(inputs)]
    warnings = [f for f in of_area(found, "memory") if f["severity"] == "warning"]
    assert [f["evidence"]["process"] for f in warnings] == ["control plane"], summary(found)
    (warning,) = warnings
    print(f"memory: {warning['title']}, evidence {warning['evidence']}")
    assert warning["title"].startswith("control plane memory growing")
    assert warning["evidence"]["growth_mib"] >= 16 and warning["evidence"]["r2"] >= 0.9
    assert warning["evidence"]["samples"] >= 50
    # The live status came through: the appliance's own port and attach mode.
    assert [f["title"] for f in of_area(found, "xdp")] == ["attached in native (driver) mode"]


def test_the_cli_prints_the_findings(lab: Lab, appliance: LabAppliance,
                                     flapped: None) -> None:
    """`hpclb diagnose` over the API, from inside the appliance's namespace."""
    token = appliance.workdir / "api-read.tokens"
    res = lab.exec("lb", [sys.executable, "-m", "hpclb.faces.cli", "diagnose",
                          "--api", appliance.api_url, "--token-file", str(token)],
                   check=False, timeout=60,
                   # rich wraps to the terminal's width: a wide one keeps titles whole.
                   env={**os.environ, "COLUMNS": "400"})
    assert res.returncode == 0, res.stdout + res.stderr
    (flap,) = flapping(findings(appliance))
    assert flap["title"] in res.stdout, res.stdout
    assert "hpclb diagnose" in res.stdout
