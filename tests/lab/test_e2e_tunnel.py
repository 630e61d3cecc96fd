"""Lab end-to-end: tunnel mode (DSR through IPIP or GUE) on both data planes.

The routed tunnel lab (``hpclb.lab.tunnel``): the client and the appliance on one
network, three backends on another behind a router, each running the decapsulation
program (``dataplane/xdp/decap.bpf.c``) on its interface and holding the VIPs on
loopback. First the lab's own plumbing, with frames crafted as lb_encap.h writes
them (no data plane); then `hpclb run` with tunnel VIPs on each data plane: real TCP
connections and UDP flows from the client reach every backend through the router
inside IPIP (IPv4 in IPv4) or GUE over IPv6 (IPv4 and IPv6 VIPs: 4in6 and 6in6), and
the answers come straight back (DSR). Flows keep their backend across a weight
change; a backend taken down has its flows, and only those, moved.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LAB_VIP6, LabAppliance
from hpclb.lab.topology import default_pass_obj
from hpclb.lab.tunnel import TunnelLab

from .flow_moves import check_a_backend_down_moves_only_its_flows
from .tunnel_frames import inject_and_receive, stats_json

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="lab tests need root (network namespaces, veth, XDP, hugepages)"
)

WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 2.0}
GUE_PORT = 6635  # not decap.bpf.c's default: the port really is configured


@pytest.fixture(scope="module")
def lab() -> Iterator[TunnelLab]:
    with TunnelLab(prefix=f"t{uuid.uuid4().hex[:6]}", backends=3,
                   peer_xdp_pass=default_pass_obj(), gue_port=GUE_PORT) as lab:
        lab.start_backends(LAB_PORT, udp=True)
        yield lab


# ---------------------------------------------------------------- the lab's plumbing


@pytest.mark.parametrize(("outer", "encap", "inner"), [
    (4, "ipip", 4), (4, "gue", 4), (6, "ipip", 4), (6, "gue", 4), (6, "ipip", 6),
    (6, "gue", 6), (4, "ipip", 6)])
def test_router_and_decap_deliver_a_crafted_tunnel_frame(lab: TunnelLab, outer: int,
                                                         encap: str, inner: int) -> None:
    """Each outer/inner pair lb_encap.h writes (and 6in4, which the decapsulation
    takes although the appliance never sends it) crosses the router, loses its outer
    headers on the backend, and the backend answers the client from the VIP."""
    backend = 2
    before = lab.decap_stats(backend)
    vip = LAB_VIP if inner == 4 else LAB_VIP6
    sport = 30000 + outer * 100 + inner * 10 + (encap == "gue")
    answer = inject_and_receive(lab, outer=outer, encap=encap, inner=inner, backend=backend,
                                vip=vip, sport=sport)
    assert answer == f"b{backend}", stats_json(lab)
    after = lab.decap_stats(backend)
    assert after["decapsulated"] == before["decapsulated"] + 1
    assert after["malformed"] == before["malformed"]


def test_decap_counts_a_malformed_tunnel_frame_and_delivers_nothing(lab: TunnelLab) -> None:
    before = lab.decap_stats(1)
    answer = inject_and_receive(lab, outer=4, encap="gue", inner=4, backend=1, vip=LAB_VIP,
                                sport=30901, bad=True, wait=1.0)
    assert answer == ""
    after = lab.decap_stats(1)
    assert after["malformed"] == before["malformed"] + 1
    assert after["decapsulated"] == before["decapsulated"]


def test_decap_passes_udp_to_another_port_untouched(lab: TunnelLab) -> None:
    """GUE to a port the backend was not told is ordinary UDP: passed to the
    kernel (which has nothing listening there), never decapsulated."""
    before = lab.decap_stats(3)
    answer = inject_and_receive(lab, outer=4, encap="gue", inner=4, backend=3, vip=LAB_VIP,
                                sport=30902, gue_port=GUE_PORT + 1, wait=1.0)
    assert answer == ""
    after = lab.decap_stats(3)
    assert after["decapsulated"] == before["decapsulated"]
    assert after["passed"] > before["passed"]


def test_backends_answer_directly_on_their_own_addresses(lab: TunnelLab) -> None:
    """Not tunnelled: the client reaches a backend's own address through the router
    (management traffic, probes), which the decapsulation program passes."""
    for i in (1, 3):
        for addr in (lab.backend_ip(i), lab.ip6_of(f"b{i}")):
            report = lab.run_client(addr, LAB_PORT, connections=5)
            assert report["counts"] == {f"b{i}": 5}, report


# ---------------------------------------------------------------- the appliance

# (name, the backends' family = the outer headers', tunnel block, VIPs)
VARIANTS = {
    "ipip4in4": (4, {"encap": "ipip", "source": "198.18.0.240/28"}, (LAB_VIP,)),
    "gue_over6": (6, {"encap": "gue", "gue_port": GUE_PORT, "source": "fd48:4c00::f0/124"},
                  (LAB_VIP, LAB_VIP6)),
}


APPLIANCES = [(dp, v) for dp in ("xdp", "dpdk") for v in VARIANTS]
# Fixed TCP source ports per appliance (an earlier one's connections may still be in
# TIME_WAIT on the client): 41000 + 600 per data plane and variant.
SPORT_BASE = {a: 41000 + 600 * n for n, a in enumerate(APPLIANCES)}


@pytest.fixture(scope="module", params=APPLIANCES, ids=lambda p: f"{p[0]}-{p[1]}")
def appliance(request: pytest.FixtureRequest, lab: TunnelLab,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabAppliance]:
    """One `hpclb run` per data plane and variant, shared by that variant's tests
    (they put back the weights and states they change)."""
    dataplane, variant = request.param
    family, tunnel, vips = VARIANTS[variant]
    with LabAppliance(lab, tmp_path_factory.mktemp(f"tun-{dataplane}-{variant}"), WEIGHTS,
                      dataplane=dataplane, mode="tunnel", vips=vips, backend_family=family,
                      tunnel=tunnel) as appliance:
        yield appliance


def _sport_base(appliance: LabAppliance) -> int:
    variant = next(k for k, v in VARIANTS.items() if v[0] == appliance.backend_family)
    return SPORT_BASE[(appliance.dataplane, variant)]


def test_tunnelled_tcp_and_udp_reach_every_backend(lab: TunnelLab,
                                                    appliance: LabAppliance) -> None:
    decap_before = {i: lab.decap_stats(i)["decapsulated"] for i in (1, 2, 3)}
    for n, vip in enumerate(appliance.vips):
        tcp = lab.run_client(vip, LAB_PORT, connections=200,
                             sport_first=_sport_base(appliance) + 300 * n)
        assert tcp["failures"] == 0, (vip, tcp["errors"], appliance.client.stats()["counters"])
        assert set(tcp["counts"]) == set(WEIGHTS), (vip, tcp["counts"])
        udp = lab.run_client(vip, LAB_PORT, connections=200, udp=True)
        assert udp["failures"] == 0, (vip, udp["errors"])
        assert set(udp["counts"]) == set(WEIGHTS), (vip, udp["counts"])
    counters = appliance.client.stats()["counters"]
    assert counters["tunnel_encap"] >= 400 * len(appliance.vips)
    assert counters["drop_encap"] == 0
    for i in (1, 2, 3):
        assert lab.decap_stats(i)["decapsulated"] > decap_before[i], stats_json(lab)


def test_flows_keep_their_backend_across_a_weight_change(
        lab: TunnelLab, appliance: LabAppliance) -> None:
    vip = appliance.vips[-1]
    stream = lab.start_stream(vip, LAB_PORT, interval_ms=50, duration=4.0)
    before = lab.udp_flows(vip, LAB_PORT, "20000-20199")
    assert set(before.values()) == set(WEIGHTS)
    try:
        time.sleep(1.0)
        appliance.set_weight("b1", 5.0)
        assert lab.udp_flows(vip, LAB_PORT, "20000-20199") == before
        report = lab.wait_json(stream, timeout=30)
        assert report["errors"] == [] and len(report["distinct"]) == 1, report
        assert len(report["names"]) >= 40
        fresh = lab.run_client(vip, LAB_PORT, connections=300, udp=True)
        assert fresh["failures"] == 0
        assert fresh["counts"]["b1"] > fresh["counts"]["b2"]  # 5 : 1 of new flows
    finally:
        appliance.set_weight("b1", WEIGHTS["b1"])


def test_a_backend_taken_down_has_its_flows_moved(lab: TunnelLab,
                                                  appliance: LabAppliance) -> None:
    check_a_backend_down_moves_only_its_flows(lab, appliance, appliance.vips[0], "21000-21299",
                                              set(WEIGHTS))


def test_outer_headers_on_the_wire_are_lb_encaps(lab: TunnelLab, appliance: LabAppliance,
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """What the router receives from the appliance: outer source inside the
    configured prefix, set per flow (several flows, several sources), TTL/hop limit
    64, IPv4 with DF, GUE to the configured port with a zero UDP checksum and a
    source port in 49152..65535."""
    from scapy.all import IP, UDP, IPv6, rdpcap

    family, tunnel, _ = next(v for v in VARIANTS.values() if v[0] == appliance.backend_family)
    pcap = tmp_path_factory.mktemp("cap") / "outer.pcap"
    cap = lab.popen("rt", ["tcpdump", "-n", "-U", "-i", "eth0", "-c", "40", "-w", str(pcap),
                           "ip proto 4" if family == 4 else "ip6 and udp"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)  # tcpdump's filter in place
        lab.udp_flows(appliance.vips[0], LAB_PORT, "22000-22039")
        cap.wait(timeout=20)
    finally:
        lab.stop_process(cap)
    frames = rdpcap(str(pcap))
    assert len(frames) == 40
    source = ipaddress.ip_network(tunnel["source"])
    sources = set()
    for f in frames:
        outer = f[IP] if family == 4 else f[IPv6]
        assert ipaddress.ip_address(outer.src) in source, outer.src
        sources.add(outer.src)
        if family == 4:
            assert outer.ttl == 64 and outer.flags.DF and outer.proto == 4
        else:
            assert outer.hlim == 64 and outer.nh == 17
            udp = f[UDP]
            assert udp.dport == tunnel["gue_port"] and udp.chksum == 0
            assert 49152 <= udp.sport <= 65535
    assert len(sources) > 4, sources  # 4 flow bits over 40 flows
