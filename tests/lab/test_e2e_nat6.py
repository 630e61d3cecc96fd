"""Lab end-to-end in NAT mode over IPv6: real packets through each data plane, the
appliance as the dual-stack gateway between a client network and a cluster network.

A dual-stack ``GatewayLab`` (``ipv6=True``: ULAs beside every IPv4 address, the
backends' IPv6 default route the appliance's cluster-side ``fd48:4c03::1``, an IPv4
and an IPv6 SNAT pool address on the appliance's ``eth1``) and one `hpclb run` per
data plane, shared by the tests (set-ups cost more than the tests), serving three
NAT VIPs on TCP and UDP: the IPv4 one, an IPv6 one without SNAT (``LAB_VIP6``) and an
IPv6 one with SNAT (``VIP6_SNAT``), TCP probes and ``on_backend_down: reschedule``.

1. the IPv6 VIP: TCP connections and UDP flows land where the data plane's ring
   says (the 40-byte IPv6 flow hash), reach every backend, the replies are
   translated back (the client talks to the VIP only), and the backends see the
   client's own IPv6 address and port;
2. SNAT: the IPv6 SNAT VIP's backends see the IPv6 pool address (resolved by NDP:
   the appliance's kernel answers in XDP mode, the forwarder in DPDK mode, which
   also answers for the NAT VIP) with ports from the configured range, the client
   its answers;
3. `hpclb stats` shows the connection tables' figures: both families' tables
   (capacity twice the hello's per-table size), the held connections established;
4. a backend whose link goes down: the probes mark it down, new IPv6 connections go
   elsewhere, its UDP flows move, its TCP connections are moved and reset by the
   new backend, nobody else's connection notices;
5. the IPv4 VIP works beside the IPv6 ones.

A plane whose configuration or hello has no IPv6 NAT ("nat6") skips, saying so,
except in CI (env CI), which must run this suite. Fixed client source ports from a
range of this suite's own (30000-39999), one part per data plane. Nothing here
asserts on speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LAB_VIP6, LabAppliance, LabApplianceError
from hpclb.lab.gateway import GatewayLab
from hpclb.lab.topology import CLIENT_IP6, default_pass_obj

from .nat_holder import (
    BACKENDS,
    HOLD_TIMEOUT_S,
    Holder,
    assert_all_held,
    backend_states,
    by_backend,
    counters,
    established_peers,
    holders,
    kill_connections,
    predicted,
    wait_for,
    wait_slow_start_over,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="lab tests need root (network namespaces, veth, XDP, hugepages)"
)

WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 2.0}
VIP6_SNAT = "fd48:4c01::11"
VIPS = (LAB_VIP, LAB_VIP6, VIP6_SNAT)
SNAT_IP = "198.19.0.2"
SNAT_IP6 = "fd48:4c03::2"
SNAT_PORTS = (21000, 21999)
DOWN = 2  # LB_BACKEND_DOWN in the data plane's dump
# The probes connect to a port of their own: the appliance's kernel may pick the IPv6
# SNAT pool address as the source of its own connections (it lies on the cluster
# side as the appliance's address does), and a probe must never pass for a NATed
# connection in what a backend sees on LAB_PORT.
PROBE_PORT = LAB_PORT + 1
# A short slow start: a backend back up has its whole weight again within seconds.
POLICY: dict[str, Any] = {"slow_start_s": 2.0}
PROBE: dict[str, Any] = {"kind": "tcp", "port": PROBE_PORT, "interval_s": 0.5,
                         "timeout_s": 0.5, "rise": 2, "fall": 3, "damping": {"enabled": False}}
PORT_BASE = {"xdp": 30000, "dpdk": 35000}  # each plane's fixed source ports


def unavailable(why: str) -> None:
    """Skip (printing why), or fail in CI, which must run this suite."""
    print(why)
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the IPv6 NAT lab suite: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def lab() -> Iterator[GatewayLab]:
    with GatewayLab(prefix=f"u{uuid.uuid4().hex[:6]}", backends=len(BACKENDS), vips=VIPS,
                    ipv6=True, snat_ips=(SNAT_IP, SNAT_IP6),
                    peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT, udp=True)
        lab.start_backends(PROBE_PORT)
        yield lab


@pytest.fixture(scope="module", params=["xdp", "dpdk"])
def appliance(request: pytest.FixtureRequest, lab: GatewayLab,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabAppliance]:
    """One `hpclb run` per data plane, shared by its tests (a test that changes a
    backend puts it back)."""
    dataplane = str(request.param)
    app = LabAppliance(lab, tmp_path_factory.mktemp(f"nat6-{dataplane}"), WEIGHTS,
                       dataplane=dataplane, mode="nat", vips=VIPS, probe=PROBE,
                       policy=POLICY,
                       nat={"on_backend_down": "reschedule",
                            "snat": {"addresses": [SNAT_IP, SNAT_IP6],
                                     "ports": f"{SNAT_PORTS[0]}-{SNAT_PORTS[1]}"}},
                       vip_overrides={VIP6_SNAT: {"snat": True}})
    problem = app.config_problem()
    if problem is not None:
        unavailable(f"this build's configuration has no IPv6 NAT mode: {problem}")
    try:
        try:
            app.start()
        except LabApplianceError as err:
            # A plane without "nat6" refuses the IPv6 NAT VIPs (set_vip): say so.
            capabilities = _capabilities(app)
            if "nat6" in capabilities:
                raise
            why = [line for line in str(err).splitlines() if "nat6" in line][:1]
            unavailable(f"`hpclb run` did not start on the {dataplane} data plane, whose "
                        f"hello (if it answered) has no 'nat6': {capabilities}"
                        + (f"; it said: {why[0]}" if why else f":\n{err}"))
        capabilities = _capabilities(app)
        if "nat6" not in capabilities:
            unavailable(f"the {dataplane} data plane has no IPv6 NAT mode: {capabilities}")
        app.wait_status(lambda s: all(h["up"] for h in s["health"].values()), what="all up")
        yield app
    finally:
        app.stop()


def _capabilities(app: LabAppliance) -> list[str]:
    """The running data plane's capabilities; none when it does not answer."""
    try:
        return list(app.client.hello().get("capabilities", []))
    except Exception:  # not running, or not answering: no capability to show
        return []


@pytest.fixture
def hold(lab: GatewayLab, tmp_path: Path) -> Iterator[Callable[..., Holder]]:
    """Starts Holders (on LAB_VIP6 unless told); any still running afterwards is
    stopped."""
    with holders(lab, tmp_path, vip=LAB_VIP6) as start:
        yield start


# --------------------------------------------------------------------------- helpers


def ports(app: LabAppliance, offset: int) -> int:
    """The first fixed source port of a test's range on this data plane."""
    return PORT_BASE[app.dataplane] + offset


def udp_flows(lab: GatewayLab, vip: str, first: int, count: int) -> dict[int, str]:
    flows = lab.udp_flows(vip, LAB_PORT, f"{first}-{first + count - 1}")
    return {int(port): name for port, name in flows.items()}


def hpclb_stats(app: LabAppliance, *args: str) -> str:
    """`hpclb stats` against the appliance's data plane: its output."""
    res = subprocess.run([sys.executable, "-m", "hpclb.faces.cli", "stats", "--socket",
                          app.socket, *args], capture_output=True, text=True, timeout=30,
                         check=False)
    assert res.returncode == 0, res.stderr
    return res.stdout


# --------------------------------------------------------------------------- the lab


def test_the_gateway_lab_is_dual_stack(lab: GatewayLab) -> None:
    """Before any appliance: the client reaches every backend's IPv6 address through
    the appliance's kernel (one hop), the backends route IPv6 through its cluster
    side and hold nothing on lo, and they resolve the IPv6 SNAT pool address by NDP
    (the appliance's kernel holds it on eth1)."""
    for i in range(1, len(BACKENDS) + 1):
        b = f"b{i}"
        assert lab.ping("cli", lab.ip6_of(b)) and lab.ping(b, CLIENT_IP6), b
        route = lab.exec(b, ["ip", "-6", "route", "get", CLIENT_IP6]).stdout
        assert f"via {lab.gateway_ip6} dev eth0" in route, route
        lo = lab.exec(b, ["ip", "-6", "-o", "addr", "show", "dev", "lo"]).stdout
        assert [line.split()[3] for line in lo.splitlines()] == ["::1/128"], lo
    for vip in (LAB_VIP6, VIP6_SNAT):
        route = lab.exec("cli", ["ip", "-6", "route", "get", vip]).stdout
        assert f"via {lab.ip6_of('lb')} dev eth0" in route, route
    out = lab.exec("cli", ["ping", "-6", "-n", "-c", "1", "-W", "2", lab.ip6_of("b1")]).stdout
    assert "ttl=63" in out, out  # routed by the appliance: the hop limit went down by one
    assert lab.ping("b1", SNAT_IP6)
    neigh = lab.exec("b1", ["ip", "-6", "neigh", "show", SNAT_IP6]).stdout
    assert lab.mac("lb", "eth1") in neigh and "PERMANENT" not in neigh, neigh
    report = lab.run_client(lab.ip6_of("b2"), LAB_PORT, connections=10)
    assert report["counts"] == {"b2": 10}, report


# --------------------------------------------------------------------------- 1. spread


def test_ipv6_nat_reaches_every_backend_and_backends_see_the_client(
        lab: GatewayLab, appliance: LabAppliance, hold: Callable[..., Holder]) -> None:
    """600 TCP connections and 200 UDP flows to the IPv6 NAT VIP from fixed source
    ports: every one answered, on the backend the data plane's ring predicts, every
    backend used in about the weights' shares; the backends see the client's own
    IPv6 address and port."""
    before = counters(appliance)
    first = ports(appliance, 0)
    report = lab.run_client(LAB_VIP6, LAB_PORT, connections=600, concurrency=50,
                            sport_first=first, deadline=120.0)
    assert report["failures"] == 0, (report["errors"], counters(appliance))
    total = sum(WEIGHTS.values())
    for name, weight in WEIGHTS.items():
        share = report["counts"].get(name, 0) / report["ok"]
        assert abs(share - weight / total) <= 0.07, (name, share, report["counts"])
    placements = {int(sport): name for sport, name in report["placements"].items()}
    assert placements == predicted(appliance, CLIENT_IP6, LAB_VIP6, 6,
                                   list(range(first, first + 600)))

    flows = udp_flows(lab, LAB_VIP6, ports(appliance, 1000), 200)
    assert len(flows) == 200
    assert flows == predicted(appliance, CLIENT_IP6, LAB_VIP6, 17, sorted(flows))
    assert set(Counter(flows.values())) == set(BACKENDS), flows

    baseline = established_peers(lab)
    holder = hold(12, ports(appliance, 1300))
    conns = holder.wait_lines(2, since=holder.opened)
    assert_all_held(conns)
    peers = established_peers(lab, since=baseline)
    for name, held in by_backend(conns).items():
        assert peers[name] == {(CLIENT_IP6, c["sport"]) for c in held}, (name, peers, held)
    assert_all_held(holder.close())

    c = counters(appliance)
    assert c["conn_new"] - before["conn_new"] >= 600 + 200 + 12, c
    assert c["conn_reply"] - before["conn_reply"] >= 600 * 2 + 200, c
    assert c["drop_snat_exhausted"] == before["drop_snat_exhausted"], c
    assert c["drop_conn_full"] == before["drop_conn_full"], c


# --------------------------------------------------------------------------- 2. SNAT


def test_ipv6_snat_backends_see_the_pool_address(
        lab: GatewayLab, appliance: LabAppliance, hold: Callable[..., Holder]) -> None:
    """The IPv6 SNAT VIP: TCP and UDP answered by every backend; each backend's peers
    are the IPv6 pool address with ports from the configured range, never the
    client; the data plane counts a SNAT port per open connection."""
    report = lab.run_client(VIP6_SNAT, LAB_PORT, connections=200, concurrency=20,
                            sport_first=ports(appliance, 1400))
    assert report["failures"] == 0 and set(report["counts"]) == set(BACKENDS), report
    flows = udp_flows(lab, VIP6_SNAT, ports(appliance, 1700), 100)
    assert len(flows) == 100 and set(flows.values()) == set(BACKENDS), flows

    baseline = established_peers(lab)
    holder = hold(12, ports(appliance, 1900), vip=VIP6_SNAT)
    conns = holder.wait_lines(2, since=holder.opened)
    assert_all_held(conns)
    peers = established_peers(lab, since=baseline)
    for name, held in by_backend(conns).items():
        assert len(peers[name]) == len(held), (name, peers, held)
        assert all(addr == SNAT_IP6 and SNAT_PORTS[0] <= port <= SNAT_PORTS[1]
                   for addr, port in peers[name]), peers
    all_ports = [port for ps in peers.values() for _, port in ps]
    assert len(set(all_ports)) == len(all_ports) == 12, peers
    stats = appliance.client.stats()
    assert stats["conns"]["snat_ports_in_use"] >= 12, stats["conns"]
    assert stats["counters"]["drop_snat_exhausted"] == 0, stats["counters"]
    assert_all_held(holder.close())


def test_ndp_resolves_the_snat_pool_address_and_the_forwarder_answers_for_the_vip(
        lab: GatewayLab, appliance: LabAppliance) -> None:
    """Neighbour discovery of the appliance's NAT addresses with the data plane in
    place. The backends forget the IPv6 SNAT pool address and resolve it again
    through SNAT traffic: to the appliance's cluster-side MAC (the DPDK forwarder
    answers, counted ndp_reply; in XDP mode the kernel, which holds it). A client
    that has the IPv6 NAT VIP on-link (a /128 route on its LAN) resolves it to the
    appliance's client-side MAC in DPDK mode, where the forwarder holds the VIPs (in
    XDP mode the VIP is on the appliance's lo, which Linux announces on no other
    interface; the lab's client routes it through the appliance)."""
    # The counters first: a backend may solicit again (a late segment of an earlier
    # test's connection) as soon as its entry is flushed, before a later snapshot.
    before = counters(appliance)
    for i in range(1, len(BACKENDS) + 1):
        lab.exec(f"b{i}", ["ip", "-6", "neigh", "flush", "to", SNAT_IP6])
    report = lab.run_client(VIP6_SNAT, LAB_PORT, connections=60, concurrency=10,
                            sport_first=ports(appliance, 2600))
    assert report["failures"] == 0 and set(report["counts"]) == set(BACKENDS), report
    for i in range(1, len(BACKENDS) + 1):
        neigh = lab.exec(f"b{i}", ["ip", "-6", "neigh", "show", SNAT_IP6]).stdout
        assert lab.mac("lb", "eth1") in neigh, (i, neigh)
    if appliance.dataplane != "dpdk":
        return
    assert counters(appliance)["ndp_reply"] >= before["ndp_reply"] + len(BACKENDS)
    try:
        lab.exec("cli", ["ip", "-6", "route", "add", f"{LAB_VIP6}/128", "dev", "eth0"])
        report = lab.run_client(LAB_VIP6, LAB_PORT, connections=20, concurrency=10,
                                sport_first=ports(appliance, 2700))
        assert report["failures"] == 0, report
        neigh = lab.exec("cli", ["ip", "-6", "neigh", "show", LAB_VIP6]).stdout
        assert lab.mac("lb", "eth0") in neigh, neigh
    finally:
        lab.exec("cli", ["ip", "-6", "route", "del", f"{LAB_VIP6}/128", "dev", "eth0"],
                 check=False)
        lab.exec("cli", ["ip", "-6", "neigh", "flush", "to", LAB_VIP6], check=False)


# --------------------------------------------------------------------------- 3. stats


def test_hpclb_stats_shows_both_connection_tables(
        lab: GatewayLab, appliance: LabAppliance, hold: Callable[..., Holder]) -> None:
    """`hpclb stats` under 20 held IPv6 connections: the capacity is both families'
    tables (twice the hello's per-table size), the entries at least two per held
    connection, the held ones established; the text form has the table too."""
    holder = hold(20, ports(appliance, 2000))
    assert_all_held(holder.opened)
    per_table = int(appliance.client.hello()["conn_table_size"])
    conns = json.loads(hpclb_stats(appliance, "--json"))["conns"]
    assert conns["capacity"] == 2 * per_table, conns
    assert conns["entries"] >= 2 * 20, conns
    assert conns["by_state"]["established"] >= 20, conns
    text = hpclb_stats(appliance)
    assert "connection table (NAT)" in text and str(2 * per_table) in text, text
    assert_all_held(holder.close())


# --------------------------------------------------------------------------- 4. backend down


def test_ipv6_backend_down_takes_no_new_flows_and_its_connections_are_rescheduled(
        lab: GatewayLab, appliance: LabAppliance, hold: Callable[..., Holder]) -> None:
    """b2's link goes down under 30 held IPv6 connections and 200 UDP flows: the
    probes mark it down, the data plane holds it DOWN; new connections succeed
    elsewhere; b2's UDP flows, and only those, move and are answered; b2's TCP
    connections are moved and reset by the new backend ("reset" at the client, never
    a hang); the others never notice. Once the link is back, b2 takes new ones."""
    holder = hold(30, ports(appliance, 2100))
    assert_all_held(holder.opened)
    on_b2 = {c["sport"] for c in by_backend(holder.opened)["b2"]}
    assert on_b2, holder.opened
    udp_first = ports(appliance, 2200)
    before = udp_flows(lab, LAB_VIP6, udp_first, 200)
    assert "b2" in before.values()
    resched = counters(appliance)["conn_reschedule"]

    lab.set_backend_link(2, up=False)
    try:
        appliance.wait_status(lambda s: not s["health"]["b2-v6"]["up"], what="b2 down")
        wait_for(lambda: backend_states(appliance, 6)["b2"] == DOWN, 10,
                 "b2 DOWN in the data plane")
        fresh = lab.run_client(LAB_VIP6, LAB_PORT, connections=200, concurrency=20)
        assert fresh["failures"] == 0 and "b2" not in fresh["counts"], fresh
        after = udp_flows(lab, LAB_VIP6, udp_first, 200)
        moved = {p for p in before if before[p] != after[p]}
        assert moved == {p for p, n in before.items() if n == "b2"}, (before, after)

        conns = holder.wait(lambda cs: all(c["error"] for c in cs if c["sport"] in on_b2),
                            timeout_s=HOLD_TIMEOUT_S + 10, what="b2's connections ended")
        ended = {c["sport"]: c["error"] for c in conns if c["sport"] in on_b2}
        assert set(ended.values()) == {"reset"}, ended
        conns = holder.wait_lines(5, since=conns)
        assert_all_held([c for c in conns if c["sport"] not in on_b2])
        c = counters(appliance)
        assert c["conn_reschedule"] >= resched + len(on_b2) + len(moved), c
    finally:
        lab.set_backend_link(2, up=True)
        kill_connections(lab, 2, on_b2)
    appliance.wait_status(lambda s: s["health"]["b2-v6"]["up"], what="b2 up again")
    wait_for(lambda: backend_states(appliance, 6)["b2"] != DOWN, 10, "b2 up in the data plane")
    wait_slow_start_over(appliance, "b2", WEIGHTS["b2"], 6)
    back = lab.run_client(LAB_VIP6, LAB_PORT, connections=100, concurrency=20)
    assert back["failures"] == 0 and back["counts"].get("b2", 0) > 0, (
        back, appliance.client.dump()["backends"], counters(appliance))
    assert_all_held([c for c in holder.close() if c["sport"] not in on_b2])


# --------------------------------------------------------------------------- 5. IPv4


def test_the_ipv4_nat_vip_works_beside_the_ipv6_ones(lab: GatewayLab,
                                                     appliance: LabAppliance) -> None:
    tcp = lab.run_client(LAB_VIP, LAB_PORT, connections=100, concurrency=20,
                         sport_first=ports(appliance, 2500))
    assert tcp["failures"] == 0 and set(tcp["counts"]) == set(BACKENDS), tcp
    udp = lab.run_client(LAB_VIP, LAB_PORT, connections=50, concurrency=10, udp=True)
    assert udp["failures"] == 0, udp
