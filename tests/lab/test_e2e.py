"""Lab end-to-end: real packets through each data plane in DSR mode.

Client, appliance and three backends in network namespaces; `hpclb run` with
the XDP program attached natively to the appliance's veth, or with the DPDK
forwarder on that veth (net_af_xdp, the appliance's addresses on its exception
TAP); real TCP connections and UDP flows from the client; backends answer with
their names straight to the client (DSR). Every test runs on both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hpclb.contract.flowhash import flow_slot
from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LabAppliance
from hpclb.lab.topology import Lab, default_pass_obj

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="lab tests need root (network namespaces, veth, XDP, hugepages)"
)

WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 2.0}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(prefix=f"e{uuid.uuid4().hex[:6]}", backends=3,
             peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT, udp=True)
        yield lab


METRICS_PORT = 9108

# Fetches a URL; prints the body, or "ERROR <reason>" (run in a lab namespace).
FETCH = """
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        sys.stdout.write(r.read().decode())
except OSError as err:
    print("ERROR", err)
"""


@pytest.fixture
def appliance(lab: Lab, tmp_path: Path, dataplane: str) -> Iterator[LabAppliance]:
    with LabAppliance(lab, tmp_path, WEIGHTS, dataplane=dataplane,
                      metrics=f":{METRICS_PORT}") as appliance:
        yield appliance


def fetch(lab: Lab, ns: str, url: str) -> str:
    return lab.exec(ns, [sys.executable, "-c", FETCH, url]).stdout


def udp_flows(lab: Lab, sports: str) -> dict[str, str]:
    return lab.udp_flows(LAB_VIP, LAB_PORT, sports)


def test_the_configured_data_plane_runs(appliance: LabAppliance, dataplane: str) -> None:
    hello = appliance.client.hello()
    expected = {"xdp": ("xdp", "native"), "dpdk": ("dpdk", "poll")}[dataplane]
    assert (hello["dataplane"], hello["attach_mode"]) == expected
    assert f"data plane: {dataplane} (configured)" in appliance.log_text()


def test_prometheus_metrics_carry_the_data_planes_counters(
        lab: Lab, appliance: LabAppliance) -> None:
    """The exporter (appliance.metrics) serves the data plane's counters and the
    backends' health and weights, refreshed every second, on the appliance's
    management address inside its namespace (reached here from the client's
    network), and never on a VIP."""
    from prometheus_client.parser import text_string_to_metric_families

    assert lab.run_client(LAB_VIP, LAB_PORT, connections=50)["failures"] == 0
    deadline = time.monotonic() + 15
    url = f"http://{lab.ip_of('lb')}:{METRICS_PORT}/metrics"
    while True:
        text = fetch(lab, "cli", url)
        assert not text.startswith("ERROR"), text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        fwd = samples.get(("hpclb_dataplane_packets_total", (("counter", "fwd_tx"),)), 0)
        if fwd >= 150 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert fwd >= 150  # SYN, ACK, request... of 50 connections
    assert {samples[("hpclb_backend_up", (("backend", b),))] for b in WEIGHTS} == {1.0}
    assert samples[("hpclb_backend_weight", (("backend", "b3"), ("pool", "lab")))] == 2.0
    assert fetch(lab, "cli", f"http://{LAB_VIP}:{METRICS_PORT}/metrics").startswith("ERROR")
    assert fetch(lab, "lb", f"http://127.0.0.1:{METRICS_PORT}/metrics").startswith("ERROR")


def test_the_appliance_itself_stays_reachable(lab: Lab, appliance: LabAppliance,
                                              dataplane: str) -> None:
    """Management traffic is not for a VIP: the kernel answers it (through the
    DPDK forwarder's exception TAP, which carries the appliance's address)."""
    assert lab.ping("cli", lab.ip_of("lb"), count=3)
    if dataplane == "dpdk":
        addrs = lab.exec("lb", ["ip", "-4", "-o", "addr", "show", "dev", "hpclb0"]).stdout
        assert f"{lab.ip_of('lb')}/" in addrs
        assert lab.exec("lb", ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout == ""
        stats = appliance.client.stats()
        assert stats["counters"]["pass_not_ipv4"] > 0  # ARP for the appliance, via the TAP
        assert stats["ports"][0]["rx_packets"] > 0


def test_ring_patches_under_a_udp_stream_lose_and_move_nothing(
        lab: Lab, appliance: LabAppliance) -> None:
    """100 ring patches while a steady UDP stream runs over 200 flows: every
    datagram is answered, each flow by one backend only (patches move slots,
    never a pinned flow)."""
    import sys

    vip_id = next(v["vip_id"] for v in appliance.client.dump()["vips"] if v["proto"] == 17)
    ids = np.array(sorted(b["id"] for b in appliance.client.dump()["backends"]), dtype=np.uint32)
    stream = lab.popen("cli", [sys.executable, "-m", "hpclb.lab.node", "udpstream", "--vip",
                               LAB_VIP, "--port", str(LAB_PORT), "--sports", "26000-26199",
                               "--pps", "2000", "--duration", "6", "--json"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rng = np.random.default_rng(3)
    time.sleep(0.5)
    ring_size = len(appliance.client.get_ring(vip_id))
    for _ in range(100):
        slots = np.unique(rng.integers(0, ring_size, 600)).astype(np.uint32)
        appliance.client.patch_ring(vip_id, slots, rng.choice(ids, len(slots)))
        time.sleep(0.04)
    report = lab.wait_json(stream, timeout=60)
    assert report["errors"] == {}, report
    assert report["sent"] > 5000
    assert report["answered"] == report["sent"], "datagrams lost"
    moved = {sport: names for sport, names in report["flows"].items() if len(names) != 1}
    assert moved == {}, f"flows answered by more than one backend: {moved}"


def test_1000_connections_follow_the_weights(lab: Lab, appliance: LabAppliance,
                                            dataplane: str) -> None:
    """1000 TCP connections from fixed source ports (41000.. for XDP, 43000..
    for DPDK: the other run's connections are still in TIME_WAIT), so the
    shares are reproducible: every connection lands on the backend the model
    predicts from the data plane's own ring, and the shares are within 5
    points of the weights."""
    report = lab.run_client(LAB_VIP, LAB_PORT, connections=1000, concurrency=50,
                            sport_first={"xdp": 41000, "dpdk": 43000}[dataplane])
    assert report["failures"] == 0, report["errors"]
    total_w = sum(WEIGHTS.values())
    for name, w in WEIGHTS.items():
        share = report["counts"].get(name, 0) / report["ok"]
        assert abs(share - w / total_w) <= 0.05, (name, share, report["counts"])

    dump = appliance.client.dump()
    names = {b["id"]: f"b{bytes(b['addr'])[3] - 10}" for b in dump["backends"]}
    ring = appliance.client.get_ring(0)
    key = bytes(dump["hash_key"])
    for sport, name in report["placements"].items():
        slot = flow_slot(key, lab.ip_of("cli"), LAB_VIP, int(sport), LAB_PORT, 6, len(ring))
        assert names[int(ring[slot])] == name, (sport, name)
    counters = appliance.client.stats()["counters"]
    assert counters["fwd_tx"] >= 1000 * 3  # SYN, ACK, request, FIN... at least 3 each
    assert counters["flow_new"] >= 1000


def test_long_lived_stream_survives_a_weight_change(lab: Lab, appliance: LabAppliance) -> None:
    stream = lab.start_stream(LAB_VIP, LAB_PORT, interval_ms=50, duration=5.0)
    time.sleep(1.5)
    appliance.set_weight("b1", 6.0)
    appliance.set_weight("b3", 0.5)
    report = lab.wait_json(stream, timeout=30)
    assert report["errors"] == []
    assert len(report["names"]) >= 60, "the stream kept answering for its whole duration"
    assert len(report["distinct"]) == 1, "every line was answered by the same backend"


def test_backend_down_moves_its_flows_and_nothing_else(lab: Lab, appliance: LabAppliance) -> None:
    before = udp_flows(lab, "20000-20299")
    assert set(before.values()) == set(WEIGHTS)
    appliance.set_state("b2", "down")
    after = udp_flows(lab, "20000-20299")
    moved = [p for p in before if before[p] != after[p]]
    assert moved and all(before[p] == "b2" for p in moved), "only b2's flows moved"
    assert "b2" not in after.values()
    assert len(moved) == list(before.values()).count("b2")


def test_draining_backend_keeps_flows_takes_no_new_ones(lab: Lab, appliance: LabAppliance) -> None:
    before = udp_flows(lab, "21000-21199")
    appliance.set_state("b3", "draining")
    assert udp_flows(lab, "21000-21199") == before
    fresh = udp_flows(lab, "22000-22199")
    assert "b3" not in fresh.values()


def test_control_plane_death_does_not_stop_forwarding(lab: Lab, appliance: LabAppliance) -> None:
    """kill -9 of `hpclb run`: the data plane keeps forwarding with its tables."""
    before = udp_flows(lab, "23000-23099")
    assert appliance.proc is not None
    appliance.proc.kill()
    appliance.proc.wait()
    assert udp_flows(lab, "23000-23099") == before
    report = lab.run_client(LAB_VIP, LAB_PORT, connections=200)
    assert report["failures"] == 0
    # A new control plane adopts the running data plane and pushes nothing new.
    appliance.start()
    log = appliance.log_text()
    assert "adopted running data plane" in log
    pushes = [line for line in log.splitlines() if "pushed tables" in line]
    assert pushes[-1].endswith("key=same backends=0 vips=0 vips_deleted=0 full_rings=0 "
                               "patched_slots=0"), log
    assert udp_flows(lab, "23000-23099") == before


def test_broken_reload_keeps_the_running_configuration(lab: Lab,
                                                       appliance: LabAppliance) -> None:
    before = udp_flows(lab, "24000-24099")
    appliance.config_path.write_text("appliance: [this is not: valid\n")
    assert appliance.proc is not None
    appliance.proc.send_signal(1)  # SIGHUP
    deadline = time.monotonic() + 10
    while "reload refused" not in appliance.log_text():
        assert time.monotonic() < deadline, appliance.log_text()
        time.sleep(0.05)
    assert appliance.proc.poll() is None
    assert udp_flows(lab, "24000-24099") == before


def test_killed_data_plane_is_restarted_without_breaking_a_stream(
        lab: Lab, appliance: LabAppliance, dataplane: str) -> None:
    """kill -9 of the data plane; `hpclb run` restarts it and pushes the tables
    again. XDP: the attached program keeps forwarding from the pinned maps. DPDK:
    the forwarder is the data path, so packets wait for the restart (about a
    second), which TCP's retransmission covers. A TCP stream running across it
    never notices either way."""
    # A DPDK restart leaves a second or two without forwarding (the forwarder is
    # the data path; frames are dropped, never passed to the kernel holding the
    # VIP): TCP retransmits across it, so the reads may wait that long.
    stream = lab.start_stream(LAB_VIP, LAB_PORT, interval_ms=50, duration=5.0, timeout=10.0)
    time.sleep(1.0)
    pid = appliance.dataplane_pid()
    pushes = appliance.pushes()
    os.kill(pid, signal.SIGKILL)
    appliance.wait_pushes(pushes + 1, timeout_s=30)
    assert appliance.dataplane_pid() != pid
    assert "restarting" in appliance.log_text()
    report = lab.wait_json(stream, timeout=30)
    assert report["errors"] == [] and len(report["distinct"]) == 1
    # XDP forwards all along (100 lines in 5 s); DPDK pauses for the restart.
    assert len(report["names"]) >= (60 if dataplane == "xdp" else 10)
    assert lab.run_client(LAB_VIP, LAB_PORT, connections=200)["failures"] == 0


def test_backend_that_does_not_answer_arp_is_out_until_it_does(lab: Lab, tmp_path: Path,
                                                               dataplane: str) -> None:
    """A backend whose MAC cannot be resolved does not stop the appliance: it is
    held DOWN, out of the ring, and enters once it answers ARP (the retry)."""
    lab.set_backend_link(2, up=False)
    # Earlier tests left b2 in the appliance's neighbour cache: forget it, as
    # after a reboot, so that the MAC must come from ARP.
    lab.exec("lb", ["ip", "neigh", "flush", "all"])
    try:
        with LabAppliance(lab, tmp_path, WEIGHTS, dataplane=dataplane) as appliance:
            assert "taken out of the ring" in appliance.log_text()
            states = {b["id"]: b["state"] for b in appliance.client.dump()["backends"]}
            assert sorted(states.values()) == [0, 0, 2], states  # b2 DOWN
            report = lab.run_client(LAB_VIP, LAB_PORT, connections=200)
            assert report["failures"] == 0, report["errors"]
            assert set(report["counts"]) == {"b1", "b3"}
            lab.set_backend_link(2, up=True)
            deadline = time.monotonic() + 30  # retries every 5 s until b2 answers ARP
            while sorted(states.values()) != [0, 0, 0]:
                assert time.monotonic() < deadline, (states, appliance.log_text())
                time.sleep(0.2)
                states = {b["id"]: b["state"] for b in appliance.client.dump()["backends"]}
            ring = appliance.client.get_ring(0)
            shares = {bid: int((ring == bid).sum()) / len(ring) for bid in states}
            assert all(abs(share - 0.25) < 0.01 or abs(share - 0.5) < 0.01
                       for share in shares.values()), shares  # b2 back at its weight
            report = lab.run_client(LAB_VIP, LAB_PORT, connections=400)
            assert report["failures"] == 0, report["errors"]
            assert report["counts"].get("b2", 0) > 50
    finally:
        lab.set_backend_link(2, up=True)


def test_wedged_data_plane_is_killed_and_restarted(lab: Lab, appliance: LabAppliance,
                                                   dataplane: str) -> None:
    """A data plane that stops answering (SIGSTOP) is killed after three missed
    hellos and restarted. XDP: the attached program forwards all along (a
    stopped DPDK forwarder is a stopped data path, so only XDP is asked to)."""
    before = udp_flows(lab, "25000-25049")
    pid = appliance.dataplane_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        if dataplane == "xdp":
            assert udp_flows(lab, "25000-25049") == before, "forwarding while wedged"
        deadline = time.monotonic() + 90
        while appliance.dataplane_pid() == pid:
            assert time.monotonic() < deadline, appliance.log_text()
            time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert "is wedged: killing it" in appliance.log_text()
    appliance.wait_pushes(2, timeout_s=30)
    assert udp_flows(lab, "25000-25049") == before
