"""The two-network (gateway) lab and the kernel's NAT as a baseline: the topology, the
kernel's routing of non-VIP traffic, nftables DNAT + conntrack spreading real TCP and
UDP over the backends, and a teardown that leaves nothing behind."""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclb.lab.appliance import LabAppliance
from hpclb.lab.gateway import (
    CLUSTER_BRIDGE,
    CLUSTER_ETH,
    LB_CLUSTER_IP,
    LB_CLUSTER_IP6,
    LB_CLUSTER_PEER,
    GatewayLab,
    cluster_backend_ip,
    cluster_backend_ip6,
)
from hpclb.lab.kernel_nat import (
    NFT_TABLE,
    KernelNat,
    conntrack_entries,
    install_kernel_nat,
    kernel_nat_loaded,
    nat_for_lab,
    nft_missing,
    remove_kernel_nat,
    rule_counters,
    ruleset,
)
from hpclb.lab.topology import CLIENT_IP, CLIENT_IP6, LB_IP, Lab, LabError, default_pass_obj

pytestmark = pytest.mark.root

if os.geteuid() != 0:
    pytest.skip("lab tests need root (network namespaces, veth)", allow_module_level=True)

VIP = "198.18.1.10"
PORT = 8080
BACKENDS = 3
SNAT_IP = "198.19.0.2"
VIP6 = "fd48:4c01::10"
VIP6_SNAT = "fd48:4c01::11"
SNAT_IP6 = "fd48:4c03::2"


def unique_prefix() -> str:
    # Parallel runs (other engineers, xdist) must never share namespace names.
    return "n" + secrets.token_hex(3)


def sysctl(lab: Lab, ns: str, key: str) -> str:
    return lab.exec(ns, ["sysctl", "-n", key]).stdout.strip()


def _pass_obj() -> Path | None:
    """The build's XDP_PASS program, for the appliance's peers (XDP redirects out of
    eth0 and eth1 reach them only so); without a build the kernel's tests still run."""
    try:
        return default_pass_obj()
    except Exception:  # no data plane build here
        return None


@pytest.fixture(scope="module")
def lab() -> Iterator[GatewayLab]:
    with GatewayLab(prefix=unique_prefix(), backends=BACKENDS, snat_ips=(SNAT_IP,),
                    peer_xdp_pass=_pass_obj()) as lab:
        lab.start_backends(PORT, udp=True)
        yield lab


@pytest.fixture
def need_nft() -> None:
    reason = nft_missing()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def kernel_nat(lab: GatewayLab, need_nft: None) -> Iterator[None]:
    """No baseline loaded before or after a test (each test loads its own)."""
    remove_kernel_nat(lab)
    yield
    remove_kernel_nat(lab)


# ---------------------------------------------------------------------- topology


def test_namespaces_interfaces_and_segments(lab: GatewayLab) -> None:
    assert Lab.existing_namespaces(lab.prefix) == sorted(lab.namespaces())
    assert len(lab.namespaces()) == 1 + 2 + BACKENDS
    client_seg = lab.exec("br", ["ip", "-br", "link", "show", "master", "br0"]).stdout.split()
    cluster_seg = lab.exec("br", ["ip", "-br", "link", "show", "master",
                                  CLUSTER_BRIDGE]).stdout.split()
    client_ports = {w.split("@")[0] for w in client_seg if w.startswith("v-")}
    cluster_ports = {w.split("@")[0] for w in cluster_seg if w.startswith("v-")}
    # Two L2 segments that meet only in the appliance.
    assert client_ports == {"v-cli", "v-lb"}
    assert cluster_ports == {LB_CLUSTER_PEER, *(f"v-b{i}" for i in range(1, BACKENDS + 1))}
    lb_addrs = {(w[1], w[3]) for w in map(str.split, lab.exec(
        "lb", ["ip", "-4", "-o", "addr"]).stdout.splitlines())}
    assert lb_addrs == {("lo", "127.0.0.1/8"), ("eth0", f"{LB_IP}/24"),
                        (CLUSTER_ETH, f"{LB_CLUSTER_IP}/24"), (CLUSTER_ETH, f"{SNAT_IP}/32"),
                        ("lo", f"{VIP}/32")}, lb_addrs
    assert lab.mac("lb", "eth0") != lab.mac("lb", CLUSTER_ETH)
    for role in lab.roles():
        assert lab.operstate(role) == "UP"
    assert lab.operstate("lb", CLUSTER_ETH) == "UP"
    assert lab.ip_of("cli") == CLIENT_IP and lab.ip_of("lb") == LB_IP
    assert lab.gateway_ip == LB_CLUSTER_IP


def test_routes_and_forwarding(lab: GatewayLab) -> None:
    assert sysctl(lab, "lb", "net.ipv4.ip_forward") == "1"
    for dst in (VIP, cluster_backend_ip(1)):
        route = lab.exec("cli", ["ip", "route", "get", dst]).stdout
        assert f"via {LB_IP} dev eth0" in route, route
    for i in range(1, BACKENDS + 1):
        route = lab.exec(f"b{i}", ["ip", "route", "get", CLIENT_IP]).stdout
        assert f"via {LB_CLUSTER_IP} dev eth0" in route, route
    route = lab.exec("lb", ["ip", "route", "get", cluster_backend_ip(2)]).stdout
    assert f"dev {CLUSTER_ETH}" in route and "via" not in route, route


def test_backends_hold_nothing_on_lo(lab: GatewayLab) -> None:
    for i in range(1, BACKENDS + 1):
        ns = f"b{i}"
        lo = lab.exec(ns, ["ip", "-4", "-o", "addr", "show", "dev", "lo"]).stdout
        assert [line.split()[3] for line in lo.splitlines()] == ["127.0.0.1/8"], lo
        eth = lab.exec(ns, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
        assert [line.split()[3] for line in eth.splitlines()] == [
            f"{cluster_backend_ip(i)}/24"], eth
        # No DSR sysctls: the backends answer ARP as any host does.
        assert sysctl(lab, ns, "net.ipv4.conf.all.arp_ignore") == "0"
        assert sysctl(lab, ns, "net.ipv4.conf.all.arp_announce") == "0"


def test_non_vip_traffic_is_routed_by_the_kernel(lab: GatewayLab) -> None:
    """No NAT loaded: the client reaches each backend's own address through the
    gateway, and the backend sees the client's address (plain routing)."""
    if nft_missing() is None:
        remove_kernel_nat(lab)
    for i in range(1, BACKENDS + 1):
        assert lab.ping("cli", cluster_backend_ip(i)), i
        assert lab.ping(f"b{i}", CLIENT_IP), i
        report = lab.run_client(cluster_backend_ip(i), PORT, connections=20, concurrency=5)
        assert report["counts"] == {f"b{i}": 20} and report["failures"] == 0, report
        udp = lab.run_client(cluster_backend_ip(i), PORT, connections=10, udp=True)
        assert udp["counts"] == {f"b{i}": 10}, udp
    # One hop: the gateway decrements the TTL (a routed, not a bridged, path).
    out = lab.exec("cli", ["ping", "-n", "-c", "1", "-W", "2", cluster_backend_ip(1)]).stdout
    assert "ttl=63" in out, out


def test_without_nat_the_vip_is_the_appliances_own(lab: GatewayLab, kernel_nat: None) -> None:
    # Nothing listens on the appliance: the VIP is its own address, not a service.
    report = lab.run_client(VIP, PORT, connections=5, timeout=1.0)
    assert report["ok"] == 0 and report["errors"] == {"refused": 5}, report


# ---------------------------------------------------------------------- kernel NAT


def test_ruleset_text() -> None:
    nat = KernelNat(VIP, PORT, ("198.19.0.11", "198.19.0.12"))
    text = ruleset(nat)
    assert f"table ip {NFT_TABLE} {{" in text
    assert ("ip daddr 198.18.1.10 meta l4proto { tcp, udp } th dport 8080 counter dnat to "
            "numgen random mod 2 map { 0 : 198.19.0.11, 1 : 198.19.0.12 }") in text
    assert "masquerade" not in text
    hashed = ruleset(KernelNat(VIP, PORT, ("198.19.0.11",), backend_port=9000,
                               balance="jhash", masquerade=True, protocols=("tcp",)))
    assert "dnat ip to jhash ip saddr . th sport . ip daddr . th dport mod 1 seed " in hashed
    assert "map { 0 : 198.19.0.11 . 9000 }" in hashed and "{ tcp }" in hashed
    assert 'oifname "eth1" ct status dnat counter masquerade' in hashed
    snat = ruleset(KernelNat(VIP, PORT, ("198.19.0.11",), snat_to=SNAT_IP))
    assert f'oifname "eth1" ct status dnat counter snat to {SNAT_IP}' in snat
    with pytest.raises(ValueError):
        KernelNat(VIP, PORT, ("198.19.0.11",), masquerade=True, snat_to=SNAT_IP)
    with pytest.raises(ValueError):
        KernelNat(VIP, PORT, ())
    with pytest.raises(ValueError):
        KernelNat(VIP, PORT, ("198.19.0.11",), protocols=("sctp",))


def _spread(report: dict[str, object], connections: int) -> None:
    counts = report["counts"]
    assert isinstance(counts, dict)
    assert report["failures"] == 0 and sum(counts.values()) == connections, report
    assert set(counts) == {f"b{i}" for i in range(1, BACKENDS + 1)}, report
    # Random or hashed, each of three backends gets about a third; far from it is a bug
    # (the bound is > 6 standard deviations below the mean for 300 connections).
    assert min(counts.values()) >= connections // 6, report


@pytest.mark.parametrize("balance", ["random", "jhash"])
def test_kernel_nat_spreads_tcp_over_the_backends(
    lab: GatewayLab, kernel_nat: None, balance: str,
) -> None:
    install_kernel_nat(lab, nat_for_lab(lab, VIP, PORT, balance=balance))
    assert kernel_nat_loaded(lab)
    connections = 300
    first = 41000 if balance == "random" else 41500  # this test's entries alone
    report = lab.run_client(VIP, PORT, connections=connections, concurrency=20,
                            sport_first=first)
    _spread(report, connections)
    # One nat-chain traversal per connection: conntrack handles the rest.
    assert rule_counters(lab)["dnat"] == connections
    entries = [e for e in conntrack_entries(lab) if e.proto == "tcp" and e.orig[1] == VIP
               and first <= e.orig[2] < first + connections]
    assert len(entries) == connections
    assert {e.backend for e in entries} == {cluster_backend_ip(i)
                                            for i in range(1, BACKENDS + 1)}
    # Without masquerade the backends see the client itself.
    assert not any(e.snat for e in entries)


def test_kernel_nat_udp(lab: GatewayLab, kernel_nat: None) -> None:
    install_kernel_nat(lab, nat_for_lab(lab, VIP, PORT))
    connections = 300
    report = lab.run_client(VIP, PORT, connections=connections, concurrency=20, udp=True)
    _spread(report, connections)


@pytest.fixture
def short_udp_conntrack(lab: GatewayLab) -> Iterator[float]:
    """UDP conntrack entries of the appliance expire after 1 s (30 s by default) for
    the test: a flow sent again after that is a new connection to the NAT rules."""
    key = "net.netfilter.nf_conntrack_udp_timeout"
    before = sysctl(lab, "lb", key)
    lab.sysctl("lb", {key: "1"})
    yield 2.0
    lab.sysctl("lb", {key: before})


def test_kernel_nat_jhash_is_a_function_of_the_flow(
    lab: GatewayLab, kernel_nat: None, short_udp_conntrack: float,
) -> None:
    """Once a flow's conntrack entry is gone (expired, or a restarted gateway), jhash
    sends the flow to the same backend again, numgen random to any."""
    placements: dict[str, list[dict[str, str]]] = {}
    for balance in ("random", "jhash"):
        install_kernel_nat(lab, nat_for_lab(lab, VIP, PORT, balance=balance,
                                            protocols=("udp",)))
        runs = placements.setdefault(balance, [])
        for _ in range(2):
            time.sleep(short_udp_conntrack)  # the previous run's entries expire
            runs.append(lab.udp_flows(VIP, PORT, "21000-21059"))
    for runs in placements.values():
        assert all(len(r) == 60 and len(set(r.values())) == BACKENDS for r in runs), runs
    assert placements["jhash"][0] == placements["jhash"][1]
    # 60 flows over 3 backends placed the same twice at random: chance 3^-60.
    assert placements["random"][0] != placements["random"][1]


@pytest.mark.parametrize(("source", "first"), [("masquerade", 42000), ("snat_to", 42400)])
def test_kernel_nat_source_nat(
    lab: GatewayLab, kernel_nat: None, source: str, first: int,
) -> None:
    """Masquerade (the appliance's cluster-side address) or SNAT to a pool address:
    the backends see the appliance, not the client, and still answer through it."""
    if source == "masquerade":
        nat, seen = nat_for_lab(lab, VIP, PORT, masquerade=True), LB_CLUSTER_IP
    else:
        nat, seen = nat_for_lab(lab, VIP, PORT, snat_to=SNAT_IP), SNAT_IP
    install_kernel_nat(lab, nat)
    connections = 300  # from fixed source ports: this test's entries alone
    report = lab.run_client(VIP, PORT, connections=connections, concurrency=20,
                            sport_first=first)
    _spread(report, connections)
    counters = rule_counters(lab)
    verdict = "masquerade" if source == "masquerade" else "snat"
    assert counters["dnat"] == connections and counters[verdict] == connections, counters
    # A long-lived connection: its backend sees the appliance's address.
    stream = lab.start_stream(VIP, PORT, interval_ms=50, duration=1.5)
    try:
        peers = _wait_established_peers(lab, timeout=5.0)
    finally:
        result = Lab.wait_json(stream)
    assert result["errors"] == [] and len(result["distinct"]) == 1, result
    assert peers and all(p == seen for p in peers), peers
    entries = [e for e in conntrack_entries(lab)
               if e.orig[1] == VIP and first <= e.orig[2] < first + connections]
    assert len(entries) == connections, entries
    assert all(e.snat and e.reply[1] == seen for e in entries), entries


def _wait_established_peers(lab: GatewayLab, timeout: float) -> list[str]:
    """The peer addresses of established connections to PORT on every backend."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        peers: list[str] = []
        for i in range(1, BACKENDS + 1):
            out = lab.exec(f"b{i}", ["ss", "-Htn", "state", "established",
                                     f"( sport = :{PORT} )"]).stdout
            peers += [line.split()[-1].rsplit(":", 1)[0] for line in out.splitlines()]
        if peers:
            return peers
        time.sleep(0.05)
    return []


def test_removing_the_baseline_restores_plain_routing(lab: GatewayLab, kernel_nat: None) -> None:
    install_kernel_nat(lab, nat_for_lab(lab, VIP, PORT))
    assert lab.run_client(VIP, PORT, connections=10)["ok"] == 10
    assert remove_kernel_nat(lab)
    assert not kernel_nat_loaded(lab) and not remove_kernel_nat(lab)
    tables = lab.exec("lb", ["nft", "list", "tables"]).stdout
    assert NFT_TABLE not in tables
    # New connections meet the appliance's own VIP again; non-VIP traffic still routes.
    assert lab.run_client(VIP, PORT, connections=5, timeout=1.0)["errors"] == {"refused": 5}
    assert lab.run_client(cluster_backend_ip(1), PORT, connections=5)["counts"] == {"b1": 5}


# ---------------------------------------------------------------------- teardown


def test_teardown_leaves_nothing(need_nft: None) -> None:
    prefix = unique_prefix()
    with GatewayLab(prefix=prefix, backends=2) as lab:
        lab.start_backend(1)
        install_kernel_nat(lab, nat_for_lab(lab, VIP, PORT))
        assert len(Lab.existing_namespaces(prefix)) == 5
    assert Lab.existing_namespaces(prefix) == []


def test_teardown_after_exception() -> None:
    prefix = unique_prefix()
    with pytest.raises(RuntimeError, match="boom"), GatewayLab(prefix=prefix, backends=1) as lab:
        lab.start_backend(1)
        raise RuntimeError("boom")
    assert Lab.existing_namespaces(prefix) == []


def test_sigterm_tears_down_and_cleanup_stale_after_sigkill() -> None:
    prefix = unique_prefix()
    proc = _gateway_lab_in_child(prefix)
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)
    assert Lab.existing_namespaces(prefix) == []

    proc = _gateway_lab_in_child(prefix)
    proc.kill()  # no handler runs: the namespaces and the server survive
    proc.wait(10)
    expected = sorted(f"{prefix}-{r}" for r in ("br", "cli", "lb", "b1"))
    assert Lab.existing_namespaces(prefix) == expected
    assert sorted(Lab.cleanup_stale(prefix)) == expected
    assert Lab.existing_namespaces(prefix) == []


def _gateway_lab_in_child(prefix: str) -> subprocess.Popen[str]:
    code = textwrap.dedent(f"""
        import time
        from hpclb.lab.gateway import GatewayLab
        with GatewayLab(prefix={prefix!r}, backends=1) as lab:
            lab.start_backend(1)
            print("up", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "up":
        proc.kill()
        proc.wait(10)
        Lab.cleanup_stale(prefix)
        pytest.fail(f"child gateway lab did not come up: {line!r}")
    return proc


# ---------------------------------------------------------------------- hpclb in NAT mode


@pytest.fixture
def nat_appliance(lab: GatewayLab, dataplane: str, tmp_path: Path) -> Iterator[LabAppliance]:
    """`hpclb run` with the VIPs in NAT mode on the module's gateway lab (no kernel
    NAT loaded); skipped where this build's configuration or data plane has none."""
    if nft_missing() is None:
        remove_kernel_nat(lab)
    if lab.peer_xdp_pass is None:
        pytest.skip("no pass.bpf.o: the data plane is not built")
    appliance = LabAppliance(lab, tmp_path, {f"b{i}": 1.0 for i in range(1, BACKENDS + 1)},
                             dataplane=dataplane, mode="nat")
    problem = appliance.config_problem()
    if problem is not None:
        pytest.skip(f"this build's configuration has no NAT mode: {problem}")
    with appliance:
        capabilities = appliance.client.hello().get("capabilities", [])
        if "nat" not in capabilities:
            pytest.skip(f"the {dataplane} data plane has no NAT mode: {capabilities}")
        yield appliance


def test_hpclb_nat_end_to_end(lab: GatewayLab, nat_appliance: LabAppliance) -> None:
    """hpclb in NAT mode where the kernel baseline was: TCP and UDP from the client
    to the VIP spread over the backends, which hold nothing on lo, see the client's
    own address and answer through the appliance; non-VIP traffic is still routed."""
    connections = 300
    first = 43000 if nat_appliance.dataplane == "xdp" else 43400  # fresh 4-tuples
    tcp = lab.run_client(VIP, PORT, connections=connections, concurrency=20,
                         sport_first=first)
    _spread(tcp, connections)
    udp = lab.run_client(VIP, PORT, connections=150, concurrency=20, udp=True)
    assert udp["failures"] == 0 and udp["ok"] == 150, udp
    stream = lab.start_stream(VIP, PORT, interval_ms=50, duration=1.5)
    try:
        peers = _wait_established_peers(lab, timeout=5.0)
    finally:
        result = Lab.wait_json(stream)
    assert result["errors"] == [] and len(result["distinct"]) == 1, result
    assert peers and all(p == CLIENT_IP for p in peers), peers
    counters = nat_appliance.client.stats()["counters"]
    assert counters.get("conn_new", 0) >= connections, counters
    assert lab.run_client(cluster_backend_ip(2), PORT, connections=5)["counts"] == {"b2": 5}


def test_nat_appliance_configuration(tmp_path: Path) -> None:
    """What LabAppliance writes for NAT mode on the gateway lab: two interfaces, every
    backend behind eth1, VIPs in mode nat, services on the cluster side; and this
    build's configuration accepts it (or says why not, which the demo prints)."""
    gw = GatewayLab(prefix=unique_prefix(), snat_ips=(SNAT_IP,))  # never brought up
    appliance = LabAppliance(gw, tmp_path, {"b1": 1.0, "b2": 1.0}, mode="nat",
                             nat={"snat": {"addresses": [SNAT_IP]}},
                             vip_options={"snat": True})
    cfg = appliance.config()
    assert cfg["appliance"]["interfaces"] == {"ingress": "eth0", "egress": [CLUSTER_ETH]}
    assert cfg["appliance"]["management_address"] == LB_CLUSTER_IP
    assert all(b["via"] == CLUSTER_ETH and b["address"].startswith("198.19.0.")
               for b in cfg["pools"]["lab"]["backends"])
    assert {v["mode"] for v in cfg["vips"]} == {"nat"} and all(v["snat"] for v in cfg["vips"])
    assert cfg["nat"] == {"snat": {"addresses": [SNAT_IP]}}
    problem = appliance.config_problem()
    if problem is not None and "not implemented" in problem:
        pytest.skip(f"this build's configuration has no NAT mode yet: {problem}")
    assert problem is None
    with pytest.raises(ValueError, match="GatewayLab"):
        LabAppliance(gw, tmp_path, {"b1": 1.0}, mode="dsr")
    with pytest.raises(ValueError, match="GatewayLab"):
        LabAppliance(Lab(prefix=unique_prefix()), tmp_path, {"b1": 1.0}, mode="nat")


def test_dual_stack_gateway_naming_and_nat6_configuration(tmp_path: Path) -> None:
    """A dual-stack gateway lab (never brought up): the cluster network's IPv6 twin
    (fd48:4c03::/64), SNAT pool addresses of both families (IPv6 ones only in dual
    stack); what LabAppliance writes for an IPv6 NAT VIP: the lab6 pool of the
    backends' cluster-side IPv6 addresses behind eth1, SNAT on the one VIP told so."""
    with pytest.raises(ValueError, match="snat_ips"):
        GatewayLab(prefix=unique_prefix(), snat_ips=(SNAT_IP6,))  # IPv4 only
    with pytest.raises(ValueError, match="snat_ips"):
        GatewayLab(prefix=unique_prefix(), ipv6=True, snat_ips=("fd48:4c03::11",))
    gw = GatewayLab(prefix=unique_prefix(), ipv6=True, vips=(VIP, VIP6, VIP6_SNAT),
                    snat_ips=(SNAT_IP, SNAT_IP6))
    assert gw.ip6_of("b2") == cluster_backend_ip6(2) == "fd48:4c03::12"
    assert gw.ip6_of("cli") == CLIENT_IP6 and gw.gateway_ip6 == LB_CLUSTER_IP6
    assert gw.snat_ips4 == (SNAT_IP,) and gw.snat_ips6 == (SNAT_IP6,)
    eth1 = next(p for p in gw.ports() if p.role == "lb" and p.ifname == CLUSTER_ETH)
    assert eth1.address6 == LB_CLUSTER_IP6 and eth1.prefixlen6 == 64
    assert all(p.address6 for p in gw.ports())
    with pytest.raises(LabError):
        _ = GatewayLab(prefix=unique_prefix()).gateway_ip6

    nat = {"snat": {"addresses": [SNAT_IP, SNAT_IP6]}}
    appliance = LabAppliance(gw, tmp_path, {"b1": 1.0, "b2": 1.0}, mode="nat",
                             vips=(VIP, VIP6, VIP6_SNAT), nat=nat,
                             vip_overrides={VIP6_SNAT: {"snat": True}})
    cfg = appliance.config()
    assert [b["address"] for b in cfg["pools"]["lab6"]["backends"]] == [
        cluster_backend_ip6(1), cluster_backend_ip6(2)]
    assert all(b["via"] == CLUSTER_ETH for b in cfg["pools"]["lab6"]["backends"])
    snat = {(v["address"], v["protocol"]): v.get("snat", False) for v in cfg["vips"]}
    assert snat == {(a, p): a == VIP6_SNAT for a in (VIP, VIP6, VIP6_SNAT)
                    for p in ("tcp", "udp")}
    assert {v["pool"] for v in cfg["vips"] if ":" in v["address"]} == {"lab6"}
    assert cfg["nat"] == nat
    with pytest.raises(ValueError, match="vip_overrides"):
        LabAppliance(gw, tmp_path, {"b1": 1.0}, mode="nat", vips=(VIP,),
                     vip_overrides={VIP6_SNAT: {"snat": True}})


# ---------------------------------------------------------------------- bench


def test_nat_bench_smoke(tmp_path: Path, need_nft: None) -> None:
    """`hpclb bench --mode nat`, briefly, on the kernel's kinds: it runs, cleans up
    and writes the JSON. Never a speed assertion."""
    from hpclb.host import install
    from hpclb.lab.nat_bench import run_nat_bench

    for tool in ("trafgen", "conntrack"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (./bootstrap)")
    try:
        install.find("sink.bpf.o")
    except Exception as err:  # the data plane's build is not there
        pytest.skip(f"no sink.bpf.o: {err}")
    out, prefix = tmp_path / "bench_nat.json", unique_prefix()
    assert run_nat_bench(out, seconds=0.5, trials=1, flows=300, ndr_steps=0,
                         kinds=("route", "nftables"), prefix=prefix) == 0
    assert Lab.existing_namespaces(prefix) == []
    report = json.loads(out.read_text())
    assert report["benchmark"] == "forwarding_udp64_nat" and report["skipped"] == {}
    assert set(report["median_forwarded_pps"]) == {"route", "nftables"}
    # Frames went through each kind (the sink's frame count): the
    # bench ran its path end to end. How fast is the JSON's business.
    for kind, trials in report["trials"].items():
        assert any(t["forwarded_frames"] >= 1 for t in trials), (kind, trials)
    assert report["cost"]["warmup"]["nftables"]["conntrack_entries"] >= 300
    assert report["cost"]["warmup"]["route"]["conntrack_entries"] == 0
