"""Lab end-to-end: IPv6 VIPs in DSR mode on both data planes, on the dual-stack lab.

Client, appliance and three backends on one LAN with IPv4 and IPv6 (ULA)
addresses (``Lab(ipv6=True)``); the appliance serves an IPv4 and an IPv6 VIP
(``LAB_VIP``, ``LAB_VIP6``) from two pools, the backends by their IPv4 and by
their IPv6 addresses; the backends hold both VIPs on loopback and answer the
client directly (DSR). Real TCP connections and UDP flows to the IPv6 VIP reach
every backend in the weights' proportions, keep their backend across a weight
change, and a backend taken down has its flows, and only those, moved; the IPv4
VIP keeps working beside it.
"""

from __future__ import annotations

import ipaddress
import os
import time
import uuid
from collections.abc import Iterator

import pytest

from hpclb.contract.flowhash import flow_slot
from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LAB_VIP6, LabAppliance
from hpclb.lab.topology import Lab, default_pass_obj

from .flow_moves import check_a_backend_down_moves_only_its_flows

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="lab tests need root (network namespaces, veth, XDP, hugepages)"
)

WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 2.0}
SPORT_BASE = {"xdp": 44000, "dpdk": 45000}  # TCP source ports, one range per plane


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(prefix=f"s{uuid.uuid4().hex[:6]}", backends=3, vips=(LAB_VIP, LAB_VIP6),
             ipv6=True, peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT, udp=True)
        yield lab


@pytest.fixture(scope="module", params=["xdp", "dpdk"])
def appliance(request: pytest.FixtureRequest, lab: Lab,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabAppliance]:
    """One `hpclb run` per data plane, shared by its tests (which put back the
    weights and states they change)."""
    dataplane = str(request.param)
    with LabAppliance(lab, tmp_path_factory.mktemp(f"v6-{dataplane}"), WEIGHTS,
                      dataplane=dataplane, vips=(LAB_VIP, LAB_VIP6)) as appliance:
        yield appliance


def test_lab_is_dual_stack(lab: Lab) -> None:
    """The lab itself, before any appliance: IPv6 between the client and each
    backend, the IPv6 VIP on the backends' loopback, and the client's route to it
    through the appliance."""
    for i in (1, 2, 3):
        assert lab.ping("cli", lab.ip6_of(f"b{i}"))
        lo = lab.exec(f"b{i}", ["ip", "-6", "-o", "addr", "show", "dev", "lo"]).stdout
        assert f"{LAB_VIP6}/128" in lo
    route = lab.exec("cli", ["ip", "-6", "route", "get", LAB_VIP6]).stdout
    assert f"via {lab.ip6_of('lb')}" in route


def test_ipv6_tcp_and_udp_reach_every_backend_by_weight(lab: Lab,
                                                       appliance: LabAppliance) -> None:
    tcp = lab.run_client(LAB_VIP6, LAB_PORT, connections=600,
                         sport_first=SPORT_BASE[appliance.dataplane])
    assert tcp["failures"] == 0, (tcp["errors"], appliance.client.stats()["counters"])
    total_w = sum(WEIGHTS.values())
    for name, w in WEIGHTS.items():
        share = tcp["counts"].get(name, 0) / tcp["ok"]
        assert abs(share - w / total_w) <= 0.07, (name, share, tcp["counts"])
    # Every connection landed where the model puts it: the 40-byte IPv6 flow key
    # hashed into the data plane's own ring of the IPv6 TCP VIP.
    dump = appliance.client.dump()
    vip_id = next(v["vip_id"] for v in dump["vips"]
                  if bytes(v["addr"]) == ipaddress.ip_address(LAB_VIP6).packed
                  and v["proto"] == 6)
    names = {b["id"]: f"b{bytes(b['addr'])[-1] - 0x10}" for b in dump["backends"]
             if len(bytes(b["addr"])) == 16}
    ring = appliance.client.get_ring(vip_id)
    for sport, name in tcp["placements"].items():
        slot = flow_slot(bytes(dump["hash_key"]), lab.ip6_of("cli"), LAB_VIP6, int(sport),
                         LAB_PORT, 6, len(ring))
        assert names[int(ring[slot])] == name, (sport, name)
    udp = lab.run_client(LAB_VIP6, LAB_PORT, connections=200, udp=True)
    assert udp["failures"] == 0, udp["errors"]
    assert set(udp["counts"]) == set(WEIGHTS)
    counters = appliance.client.stats()["counters"]
    assert counters["flow_new"] >= 800
    assert counters["fwd_tx"] >= 600 * 3  # SYN, ACK, request... of each connection


def test_ipv4_vip_works_beside_the_ipv6_one(lab: Lab, appliance: LabAppliance) -> None:
    v4 = lab.run_client(LAB_VIP, LAB_PORT, connections=200,
                        sport_first=SPORT_BASE[appliance.dataplane] + 700)
    assert v4["failures"] == 0, v4["errors"]
    assert set(v4["counts"]) == set(WEIGHTS)


def test_ipv6_flows_keep_their_backend_across_a_weight_change(
        lab: Lab, appliance: LabAppliance) -> None:
    stream = lab.start_stream(LAB_VIP6, LAB_PORT, interval_ms=50, duration=4.0)
    before = lab.udp_flows(LAB_VIP6, LAB_PORT, "20000-20199")
    assert set(before.values()) == set(WEIGHTS)
    try:
        time.sleep(1.0)
        appliance.set_weight("b1", 5.0)
        appliance.set_weight("b3", 0.5)
        assert lab.udp_flows(LAB_VIP6, LAB_PORT, "20000-20199") == before
        report = lab.wait_json(stream, timeout=30)
        assert report["errors"] == [] and len(report["distinct"]) == 1, report
        assert len(report["names"]) >= 40
    finally:
        appliance.set_weight("b1", WEIGHTS["b1"])
        appliance.set_weight("b3", WEIGHTS["b3"])


def test_ipv6_backend_down_moves_its_flows_and_nothing_else(
        lab: Lab, appliance: LabAppliance) -> None:
    check_a_backend_down_moves_only_its_flows(lab, appliance, LAB_VIP6, "21000-21299",
                                              set(WEIGHTS))


def test_icmpv6_to_the_appliance_is_the_kernels(lab: Lab, appliance: LabAppliance) -> None:
    """ICMPv6 is never balanced: an echo request to the appliance's IPv6 address
    reaches its kernel (XDP passes it; the DPDK forwarder hands it to its TAP)."""
    before = appliance.client.stats()["counters"]["pass_not_vip"]
    lab.ping("cli", lab.ip6_of("lb"), count=2)
    assert appliance.client.stats()["counters"]["pass_not_vip"] >= before + 2
    if appliance.dataplane == "xdp":
        assert lab.ping("cli", lab.ip6_of("lb"), count=1)
