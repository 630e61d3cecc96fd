"""hpclb-dpdk as a process: its command line, its telemetry socket (read with
DPDK's own dpdk-telemetry.py and with hpclb's client), its shutdown, and the
kernel side of its exception path (addresses handed to the TAP and back).

The packet semantics are the conformance suite's (tests/conformance), the
protocol the protocol suite's (test_protocol_server.py), both on this binary.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from scapy.layers.inet import ICMP, IP, TCP, UDP, IPerror, TCPerror, UDPerror
from scapy.layers.inet6 import (
    ICMPv6DestUnreach,
    ICMPv6ND_NA,
    ICMPv6ND_NS,
    ICMPv6NDOptDstLLAddr,
    ICMPv6NDOptSrcLLAddr,
    IPerror6,
    IPv6,
)
from scapy.layers.l2 import ARP, Ether

from hpclb.balancing import maglev
from hpclb.contract.tables import (
    STAT_NAMES,
    Backend,
    BackendState,
    Encap,
    NatConfig,
    TableSet,
    Vip,
    VipMode,
    mac_str,
)
from hpclb.dataplane import exception_path
from hpclb.dataplane.dpdk import (
    DpdkLaunch,
    DpdkPort,
    find_dpdk_forwarder,
    forwarder_argv,
    reserve_hugepages,
)
from hpclb.dataplane.push import fetch_tables, push_tables
from hpclb.dataplane.supervisor import DataplaneProcess
from hpclb.host import install
from hpclb.host import netns as host_netns
from hpclb.lab import dpdk_telemetry

from .exception_ns import appliance_and_client, probe_vip, sh, veth_netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="needs root: network namespaces, hugepages, AF_XDP"),
]


@pytest.fixture
def netns() -> Iterator[str]:
    with veth_netns("hlbf") as name:
        yield name


def launch(netns: str, tmp: Path, **kw: object) -> DpdkLaunch:
    settings: dict = {
        "ports": (DpdkPort(0, "af_xdp", iface="d0", tap="exc0"),),
        "socket": f"ipc://{tmp}/dp.sock", "netns": netns, "flow_table_size": 4096,
        "idle_sleep_us": 100, "socket_mem_mb": 256, "file_prefix": f"hlbf-{uuid.uuid4().hex[:8]}",
    }
    settings.update(kw)
    result = DpdkLaunch(**settings)
    assert reserve_hugepages(result.socket_mem_mb) >= result.socket_mem_mb
    return result


def _tables(nbackends: int) -> TableSet:
    t = TableSet(hash_key=bytes(16), ring_size=65537)
    for i in range(nbackends):
        t.backends[i] = Backend(i, ipaddress.IPv4Address(f"198.18.{2 + i // 250}.{1 + i % 250}"),
                                f"02:00:00:00:{i // 256:02x}:{i % 256:02x}", BackendState.UP)
    t.vips[5] = Vip(5, ipaddress.IPv4Address("198.18.1.10"), 80, 6)
    t.rings[5] = maglev.build_table([(i, f"b{i}", 1.0) for i in range(nbackends)], 65537)
    return t


def test_telemetry_socket_serves_the_forwarders_counters(netns: str, tmp_path: Path) -> None:
    spec = launch(netns, tmp_path)
    dp = DataplaneProcess(argv=forwarder_argv(spec), endpoint=spec.socket,
                          pidfile=tmp_path / "pid", log_path=tmp_path / "log")
    dp.start()
    try:
        stats = dpdk_telemetry.query(spec.file_prefix, "/hpclb/stats")
        assert set(STAT_NAMES) <= set(stats)
        assert stats["workers"] == 1 and stats["tsc_hz"] > 0
        workers = dpdk_telemetry.query(spec.file_prefix, "/hpclb/workers")
        assert workers["worker0"]["lcore"] == 1 and workers["worker0"]["total_cycles"] > 0
        ports = dpdk_telemetry.query(spec.file_prefix, "/hpclb/ports")
        assert set(ports) == {"port0"} and ports["port0"]["device"] == "net_af_xdp0"
        assert "rx_missed" in ports["port0"]
        assert dpdk_telemetry.query(spec.file_prefix, "/hpclb/vips") == {}
        # Tables pushed through the protocol show up, with their counters.
        push_tables(dp.client, None, _tables(150))
        vips = dpdk_telemetry.query(spec.file_prefix, "/hpclb/vips")
        assert vips == {"vip5": {"packets": 0, "bytes": 0, "addr": "198.18.1.10", "port": 80,
                                 "proto": "tcp"}}
        page = dpdk_telemetry.query(spec.file_prefix, "/hpclb/backends")
        assert len(page) == 150 and page["backend0"]["state"] == "up"
        # At most 200 a page (a telemetry dict holds 256): the rest from an id on.
        push_tables(dp.client, _tables(150), _tables(300))
        assert len(dpdk_telemetry.query(spec.file_prefix, "/hpclb/backends")) == 200
        rest = dpdk_telemetry.query(spec.file_prefix, "/hpclb/backends,200")
        assert sorted(rest, key=lambda k: int(k[7:]))[0] == "backend200" and len(rest) == 100
        # Table protocol 2: an IPv6 VIP and backend are held and reported.
        v6 = _tables(300)
        v6.vips[6] = Vip(6, ipaddress.IPv6Address("fd00::10"), 443, 17, nat_port=8443)
        v6.rings[6] = v6.rings[5]
        v6.backends[300] = Backend(300, ipaddress.IPv6Address("fd00:1::1"), "02:00:00:00:02:01")
        push_tables(dp.client, _tables(300), v6)
        held = fetch_tables(dp.client)
        assert held.vips == v6.vips and held.backends == v6.backends
        vips = dpdk_telemetry.query(spec.file_prefix, "/hpclb/vips")
        assert vips["vip6"]["addr"] == "fd00::10" and vips["vip6"]["proto"] == "udp"
        rest = dpdk_telemetry.query(spec.file_prefix, "/hpclb/backends,300")
        assert rest["backend300"]["addr"] == "fd00:1::1"
        push_tables(dp.client, v6, _tables(300))
        assert fetch_tables(dp.client).vips == _tables(300).vips
        # DPDK's own client reads the same socket.
        tool = shutil.which("dpdk-telemetry.py")
        if tool is None:
            pytest.fail("dpdk-telemetry.py missing: the dpdk package provides it")
        out = subprocess.run([tool, "-f", spec.file_prefix], input="/hpclb/stats\n",
                             capture_output=True, text=True, timeout=30, check=True).stdout
        line = next(ln for ln in out.splitlines() if ln.startswith("{"))
        assert set(STAT_NAMES) <= set(json.loads(line)["/hpclb/stats"])
        # The TAP exists in the forwarder's namespace with the data port's MAC.
        hello = dp.client.hello()
        tap = sh("ip", "-n", netns, "-j", "link", "show", "dev", "exc0")
        assert json.loads(tap)[0]["address"] == ":".join(f"{b:02x}" for b in
                                                         bytes(hello["ports"][0]["mac"]))
    finally:
        dp.stop()
    assert dp.returncode == 0
    assert "shutting down" in (tmp_path / "log").read_text()


@pytest.mark.parametrize(("extra", "message"), [
    (["--ring-size", "4"], "--ring-size must be a prime"),
    (["--flow-table-size", "3"], "--flow-table-size must be in"),
    (["--conn-table-size", "7"], "--conn-table-size must be an even number in 4..33554432"),
    (["--conn-table-size", "2"], "--conn-table-size must be an even number"),
    (["--numa", "sometimes"], "--numa must be strict or warn"),
    (["--netns", "../x"], "bad --netns name"),
    (["--port", "a:b:c"], "bad --port"),
    (["--bogus"], "unrecognized option '--bogus'"),
])
def test_bad_arguments_exit_2_before_the_eal(extra: list[str], message: str) -> None:
    res = subprocess.run([find_dpdk_forwarder(), "-l", "0,1", "--", "--port", "x", *extra],
                         capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert "EAL:" not in res.stderr  # refused before the EAL started


def test_no_separator_or_no_port_is_refused() -> None:
    binary = find_dpdk_forwarder()
    res = subprocess.run([binary, "-l", "0,1"], capture_output=True, text=True, check=False)
    assert res.returncode == 2 and "missing '--'" in res.stderr
    res = subprocess.run([binary, "-l", "0,1", "--"], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 2 and "at least one --port" in res.stderr


def test_a_port_missing_from_the_eal_is_named(netns: str, tmp_path: Path) -> None:
    spec = launch(netns, tmp_path, numa="strict")
    argv = forwarder_argv(spec)
    argv[argv.index("net_af_xdp0:net_tap0")] = "net_af_xdp7"
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 1 and "no DPDK port named net_af_xdp7" in res.stderr, res.stderr


def test_addresses_move_to_the_tap_and_back(netns: str, tmp_path: Path) -> None:
    """hand_over/give_back on real interfaces: d0's address and its gateway
    route move to a stand-in TAP (a veth end), then come back."""

    def make_tap() -> None:
        sh("ip", "-n", netns, "link", "add", "exc0", "type", "veth", "peer", "name", "exc0p")

    make_tap()
    sh("ip", "-n", netns, "addr", "add", "198.18.7.2/24", "dev", "d0")
    sh("ip", "-n", netns, "route", "add", "198.19.0.0/16", "via", "198.18.7.1", "dev", "d0")
    record = tmp_path / "exc0.addresses.json"
    assert exception_path.hand_over("d0", "exc0", record, netns) == 1

    def addrs(dev: str) -> str:
        return sh("ip", "-n", netns, "-4", "-o", "addr", "show", "dev", dev)

    assert "198.18.7.2/24" in addrs("exc0") and addrs("d0") == ""
    assert "dev exc0" in sh("ip", "-n", netns, "route", "show", "198.19.0.0/16")
    # A forwarder restarted later re-creates its TAP empty: the record refills it.
    sh("ip", "-n", netns, "link", "del", "exc0")
    make_tap()
    assert exception_path.hand_over("d0", "exc0", record, netns) == 1
    exception_path.give_back(record, netns)
    assert "198.18.7.2/24" in addrs("d0") and not record.exists()
    assert "dev d0" in sh("ip", "-n", netns, "route", "show", "198.19.0.0/16")


@pytest.fixture
def two_namespaces() -> Iterator[tuple[str, str]]:
    """An appliance namespace (198.18.7.2 on d0, the VIPs 198.18.1.10 and .11
    on lo, as the lab's appliance holds them) and a client namespace routing
    198.18.1.0/24 through it."""
    with appliance_and_client("hlbv", "198.18.7.2/24", "198.18.7.1/24") as (app, cli):
        for vip in ("198.18.1.10", "198.18.1.11"):
            sh("ip", "-n", app, "addr", "add", f"{vip}/32", "dev", "lo")
        sh("ip", "-n", cli, "route", "add", "198.18.1.0/24", "via", "198.18.7.2")
        yield app, cli


def test_the_kernel_gives_up_the_vips_silently_and_gets_them_back(
        two_namespaces: tuple[str, str], tmp_path: Path) -> None:
    """claim_vips: the VIPs' addresses off lo and a blackhole route each, so the
    kernel drops VIP traffic without ICMP or RST, ip_forward on or off; a VIP
    that leaves the configuration gets its address back; give_back restores
    everything."""
    app, cli = two_namespaces

    def probe(vip: str) -> str:
        return probe_vip(cli, vip)

    def lo() -> str:
        return sh("ip", "-n", app, "-4", "-o", "addr", "show", "dev", "lo")

    def blackholes() -> str:
        return sh("ip", "-n", app, "route", "show", "type", "blackhole")

    assert probe("198.18.1.10") == "udp-icmp tcp-rst"  # the kernel holds the VIP
    record = tmp_path / "gw.vips.addresses.json"
    done = exception_path.claim_vips(["198.18.1.10", "198.18.1.11"], record, app)
    assert sorted(done["taken"]) == ["198.18.1.10@lo", "198.18.1.11@lo"]
    assert "198.18.1." not in lo()
    assert "198.18.1.10" in blackholes() and "198.18.1.11" in blackholes()
    for forwarding in ("0", "1"):
        sh("ip", "netns", "exec", app, "sysctl", "-qw", f"net.ipv4.ip_forward={forwarding}")
        assert probe("198.18.1.10") == "udp-silent tcp-silent", forwarding
    # Idempotent: nothing more to do.
    assert exception_path.claim_vips(["198.18.1.11", "198.18.1.10"], record, app) == {
        "taken": [], "blackholed": [], "released": []}
    # A reload drops .10: its address comes back, its blackhole goes.
    done = exception_path.claim_vips(["198.18.1.11"], record, app)
    assert done["released"] == ["198.18.1.10"]
    assert "198.18.1.10/32" in lo() and "198.18.1.10" not in blackholes()
    assert "198.18.1.11/32" not in lo() and "198.18.1.11" in blackholes()
    assert json.loads(record.read_text())["addresses"] == [
        {"iface": "lo", "address": "198.18.1.11", "prefixlen": 32}]
    # A VIP that is the appliance's own subnet address is left alone.
    done = exception_path.claim_vips(["198.18.1.11", "198.18.7.2"], record, app)
    assert done == {"taken": [], "blackholed": [], "released": []}
    assert "198.18.7.2/24" in sh("ip", "-n", app, "-4", "-o", "addr", "show", "dev", "d0")
    # The forwarder stops for good: all back, no blackhole, no record.
    exception_path.give_back(record, app)
    assert not record.exists()
    assert "198.18.1.10/32" in lo() and "198.18.1.11/32" in lo()
    assert blackholes().strip() == ""
    assert probe("198.18.1.11") == "udp-icmp tcp-rst"


def test_a_stale_af_xdp_program_is_detached(netns: str) -> None:
    """Generic (d0) or native (d1, as a killed AF_XDP port leaves it on a veth)."""
    obj = install.find("pass.bpf.o")
    for dev, mode in (("d0", "xdpgeneric"), ("d1", "xdpdrv")):
        sh("ip", "-n", netns, "link", "set", "dev", dev, mode, "obj", str(obj), "sec", "xdp")
        assert "prog/xdp" in sh("ip", "-n", netns, "link", "show", "dev", dev)
        exception_path.detach_xdp(dev, netns)
        deadline = time.monotonic() + 5
        while "prog/xdp" in sh("ip", "-n", netns, "link", "show", "dev", dev):
            assert time.monotonic() < deadline, dev
            time.sleep(0.05)


def test_sigterm_stops_workers_and_exits_0(netns: str, tmp_path: Path) -> None:
    spec = launch(netns, tmp_path, lcores=(0, 1))
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(forwarder_argv(spec), stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while "hpclb-dpdk: ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGHUP)  # ignored: only SIGTERM/SIGINT stop it
        time.sleep(0.3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- NAT mode (lb_conn.h) on the real forwarder ------------------------------
# The conformance suite compares every frame with the model; these check the
# result against scapy's own reading of it (addresses, ports, checksums
# recomputed from scratch) on one port: the wire is d1, the forwarder d0.

CLIENT_MAC = "02:aa:00:00:00:01"
BACKEND_MAC = "02:bb:00:00:00:10"
CLIENT = "198.18.7.1"
BACKEND = "198.18.2.1"
NAT_VIP = "198.18.1.10"   # TCP 80 and UDP 53 -> the backend's 8080 and 5353
SNAT_VIP = "198.18.1.11"  # TCP 80, with a source from the pool
SNAT_ADDR = "198.18.9.1"
PACKET_OUTGOING = 4


def _nat_tables() -> TableSet:
    t = TableSet(hash_key=bytes(range(16)), ring_size=65537)
    t.backends[0] = Backend(0, ipaddress.IPv4Address(BACKEND), BACKEND_MAC, BackendState.UP)
    ring = maglev.build_table([(0, "b0", 1.0)], 65537)
    t.vips[5] = Vip(5, ipaddress.IPv4Address(NAT_VIP), 80, 6, mode=VipMode.NAT, nat_port=8080)
    t.vips[6] = Vip(6, ipaddress.IPv4Address(NAT_VIP), 53, 17, mode=VipMode.NAT, nat_port=5353)
    t.vips[7] = Vip(7, ipaddress.IPv4Address(SNAT_VIP), 80, 6, mode=VipMode.NAT, snat=True)
    t.rings = {5: ring, 6: ring, 7: ring}
    t.nat = NatConfig(snat_addrs=(ipaddress.IPv4Address(SNAT_ADDR),), snat_port_min=20000,
                      snat_port_max=20999)
    return t


class Wire:
    """AF_PACKET on d1, the far end of the forwarder's port 0."""

    def __init__(self, ns: str) -> None:
        with host_netns.inside(ns):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
            self.sock.bind(("d1", 0))

    def exchange(self, frame: bytes, timeout: float = 3.0, kind: int | None = None) -> Ether:
        """Sends frame, returns the first frame of the same kind (ARP, IPv4,
        IPv6; or the EtherType `kind`) the forwarder sends back."""
        while select.select([self.sock], [], [], 0)[0]:
            self.sock.recv(65536)
        self.sock.send(frame)
        kind = Ether(frame).type if kind is None else kind
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([self.sock], [], [], left)[0]:
                break
            data, addr = self.sock.recvfrom(65536)
            if addr[2] != PACKET_OUTGOING and Ether(data).type == kind:
                return Ether(data)
        raise AssertionError(f"nothing came back for {Ether(frame).summary()}")


def checksums_ok(pkt: Ether) -> bool:
    """The IPv4 and L4 (or ICMP) checksums equal scapy's recomputation."""
    again = Ether(bytes(pkt))
    del again[IP].chksum
    del again[IP].payload.chksum
    again = Ether(bytes(again))
    return (again[IP].chksum == pkt[IP].chksum
            and again[IP].payload.chksum == pkt[IP].payload.chksum)


@contextlib.contextmanager
def nat_forwarder_in(ns: str, tmp: Path, lcores_map: str | None = None,
                     tables: TableSet | None = None,
                     **kw: object) -> Iterator[tuple[DataplaneProcess, str, Wire]]:
    """The forwarder on d0 with tables (default _nat_tables) pushed; lcores_map,
    if given, replaces "-l" with an EAL --lcores map (more workers than this
    host's CPUs)."""
    for knob in ("all", "default"):  # no kernel chatter between the frames
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{knob}.disable_ipv6=1")
    spec = launch(ns, tmp, conn_table_size=64, **kw)
    argv = forwarder_argv(spec)
    if lcores_map:
        i = argv.index("-l")
        argv[i:i + 2] = ["--lcores", lcores_map]
    dp = DataplaneProcess(argv=argv, endpoint=spec.socket, pidfile=tmp / "pid",
                          log_path=tmp / "log")
    dp.start()
    wire = Wire(ns)
    try:
        hello = dp.client.hello()
        assert "nat" in hello["capabilities"] and hello["conn_table_size"] == 64
        push_tables(dp.client, None, tables if tables is not None else _nat_tables())
        yield dp, mac_str(bytes(hello["ports"][0]["mac"])), wire
    finally:
        wire.sock.close()
        dp.stop()
    assert dp.returncode == 0


@pytest.fixture
def nat_forwarder(netns: str, tmp_path: Path) -> Iterator[tuple[DataplaneProcess, str, Wire]]:
    with nat_forwarder_in(netns, tmp_path) as running:
        yield running


def test_nat_tcp_connection_is_translated_both_ways(
        nat_forwarder: tuple[DataplaneProcess, str, Wire]) -> None:
    dp, port_mac, wire = nat_forwarder
    syn = Ether(src=CLIENT_MAC, dst=port_mac) / IP(src=CLIENT, dst=NAT_VIP) / TCP(
        sport=40000, dport=80, flags="S", seq=1000)
    out = wire.exchange(bytes(syn))
    # DNAT to the backend's address and port, the client's source kept.
    assert (out.dst, out.src) == (BACKEND_MAC, port_mac)
    assert (out[IP].src, out[IP].dst, out[TCP].sport, out[TCP].dport) == (
        CLIENT, BACKEND, 40000, 8080)
    assert out[TCP].flags == "S" and out[TCP].seq == 1000 and checksums_ok(out)

    syn_ack = Ether(src=BACKEND_MAC, dst=port_mac) / IP(src=BACKEND, dst=CLIENT) / TCP(
        sport=8080, dport=40000, flags="SA", seq=5000, ack=1001)
    back = wire.exchange(bytes(syn_ack))
    # Translated back: from the VIP, to the client's MAC.
    assert (back.dst, back.src) == (CLIENT_MAC, port_mac)
    assert (back[IP].src, back[IP].dst, back[TCP].sport, back[TCP].dport) == (
        NAT_VIP, CLIENT, 80, 40000)
    assert back[TCP].flags == "SA" and back[TCP].ack == 1001 and checksums_ok(back)

    ack = Ether(src=CLIENT_MAC, dst=port_mac) / IP(src=CLIENT, dst=NAT_VIP) / TCP(
        sport=40000, dport=80, flags="A", seq=1001, ack=5001) / b"GET / HTTP/1.0\r\n\r\n"
    out = wire.exchange(bytes(ack))
    assert out[IP].dst == BACKEND and out[TCP].dport == 8080 and checksums_ok(out)
    assert bytes(out[TCP].payload) == b"GET / HTTP/1.0\r\n\r\n"

    stats = dp.client.stats()
    counters = stats["counters"]
    assert (counters["conn_new"], counters["conn_reply"], counters["conn_hit"]) == (1, 1, 1)
    assert counters["fwd_tx"] == 3
    conns = stats["conns"]
    # The capacity is both families' tables' (64 entries each).
    assert conns["capacity"] == 128 and conns["entries"] == 2
    assert conns["by_state"]["established"] == 1 and conns["snat_ports_in_use"] == 0

    # An RST that matches nothing opens nothing.
    rst = Ether(src=CLIENT_MAC, dst=port_mac) / IP(src=CLIENT, dst=NAT_VIP) / TCP(
        sport=40999, dport=80, flags="R")
    wire.sock.send(bytes(rst))
    deadline = time.monotonic() + 3
    while dp.client.stats()["counters"]["drop_conn_invalid"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_nat_snat_udp_and_icmp(nat_forwarder: tuple[DataplaneProcess, str, Wire]) -> None:
    dp, port_mac, wire = nat_forwarder
    # The pool address is answered for, like a VIP.
    who = Ether(src=BACKEND_MAC, dst="ff:ff:ff:ff:ff:ff") / ARP(
        op=1, hwsrc=BACKEND_MAC, psrc=BACKEND, pdst=SNAT_ADDR)
    arp = wire.exchange(bytes(who))
    assert arp[ARP].op == 2 and arp[ARP].psrc == SNAT_ADDR and arp[ARP].hwsrc == port_mac

    # SNAT: the source becomes a pool pair, the reply to it comes back.
    syn = Ether(src=CLIENT_MAC, dst=port_mac) / IP(src=CLIENT, dst=SNAT_VIP) / TCP(
        sport=40001, dport=80, flags="S")
    out = wire.exchange(bytes(syn))
    assert (out[IP].src, out[IP].dst, out[TCP].dport) == (SNAT_ADDR, BACKEND, 80)
    snat_port = out[TCP].sport
    assert 20000 <= snat_port <= 20999 and checksums_ok(out)
    syn_ack = Ether(src=BACKEND_MAC, dst=port_mac) / IP(src=BACKEND, dst=SNAT_ADDR) / TCP(
        sport=80, dport=snat_port, flags="SA")
    back = wire.exchange(bytes(syn_ack))
    assert (back.dst, back[IP].src, back[IP].dst, back[TCP].sport, back[TCP].dport) == (
        CLIENT_MAC, SNAT_VIP, CLIENT, 80, 40001)
    assert checksums_ok(back)
    assert dp.client.stats()["conns"]["snat_ports_in_use"] == 1

    # UDP, and the backend's port unreachable about it: the quote and the
    # outer source become the VIP's again (lb_conn.h step 3).
    query = Ether(src=CLIENT_MAC, dst=port_mac) / IP(src=CLIENT, dst=NAT_VIP) / UDP(
        sport=41000, dport=53) / b"query"
    sent = wire.exchange(bytes(query))
    assert (sent[IP].dst, sent[UDP].dport) == (BACKEND, 5353) and checksums_ok(sent)
    unreach = (Ether(src=BACKEND_MAC, dst=port_mac) / IP(src=BACKEND, dst=CLIENT)
               / ICMP(type=3, code=3) / bytes(sent[IP])[:28])
    err = wire.exchange(bytes(unreach))
    assert (err.dst, err[IP].src, err[IP].dst) == (CLIENT_MAC, NAT_VIP, CLIENT)
    assert (err[IPerror].src, err[IPerror].dst) == (CLIENT, NAT_VIP)
    assert (err[UDPerror].sport, err[UDPerror].dport) == (41000, 53)
    assert checksums_ok(err)
    # The quoted header's own checksum is the one the client sent.
    assert err[IPerror].chksum == IP(bytes(query[IP])).chksum
    assert TCPerror not in err
    counters = dp.client.stats()["counters"]
    assert (counters["conn_new"], counters["conn_reply"], counters["nat_icmp"]) == (2, 1, 1)
    assert counters["arp_reply"] == 1


def test_nat_replies_meet_their_connection_on_any_worker(netns: str, tmp_path: Path) -> None:
    """Two workers, af_packet spreading frames over both queues by a hash of
    each frame's own tuple: a reply (whose tuple is not the request's
    reversed) lands on either worker and still finds its connection, in the
    one table the workers share; the capacity stays exact."""
    prefix = f"hlbf-{uuid.uuid4().hex[:8]}"
    with nat_forwarder_in(netns, tmp_path, lcores_map="0@0,1@1,2@1", lcores=(0, 1, 2),
                          ports=(DpdkPort(0, "af_packet", iface="d0", tap="exc0"),),
                          file_prefix=prefix) as (dp, port_mac, wire):
        for n in range(40):
            syn = Ether(src=CLIENT_MAC, dst=port_mac) / IP(src=CLIENT, dst=NAT_VIP) / TCP(
                sport=42000 + n, dport=80, flags="S")
            out = wire.exchange(bytes(syn))
            assert (out[IP].dst, out[TCP].dport) == (BACKEND, 8080) and checksums_ok(out)
            syn_ack = Ether(src=BACKEND_MAC, dst=port_mac) / IP(src=BACKEND, dst=CLIENT) / TCP(
                sport=8080, dport=42000 + n, flags="SA")
            back = wire.exchange(bytes(syn_ack))
            assert (back[IP].src, back[TCP].sport, back[TCP].dport) == (NAT_VIP, 80, 42000 + n)
            assert checksums_ok(back)
        stats = dp.client.stats()
        # 64 entries hold 32 connections: the 8 oldest went (all embryonic).
        assert stats["conns"]["entries"] == 64 and stats["conns"]["by_state"]["syn_recv"] == 32
        assert (stats["counters"]["conn_new"], stats["counters"]["conn_evict"]) == (40, 8)
        assert stats["counters"]["conn_reply"] == 40
        workers = dpdk_telemetry.query(prefix, "/hpclb/workers")
        assert all(w["frames"] > 0 for w in workers.values()) and len(workers) == 2


# --- IPv6, tunnel mode (lb_encap.h) and neighbour discovery --------------------
# As for NAT: each frame the forwarder sends is read back with scapy, its
# headers and checksums checked from scratch rather than against the model.

CLIENT6 = "fd00:7::1"
VIP6 = "fd00::10"        # TCP 80: DSR; UDP 53: tunnel IPIP (6in6); UDP 54: tunnel GUE (6in6)
BACKEND6 = "fd00:2::1"
BACKEND6_MAC = "02:bb:00:00:00:60"
TUN_VIP = "198.18.1.20"  # UDP 53: IPIP 4in4; 54: GUE over IPv4; 55: 4in6 (IPIP); 56: drop_encap
TUN_SRC4 = "198.18.9.0"
TUN_SRC6 = "fd00:9::"
GUE_PORT = 6080


def _v6_tunnel_tables() -> TableSet:
    t = TableSet(hash_key=bytes(range(16)), ring_size=65537)
    t.backends[0] = Backend(0, ipaddress.IPv6Address(BACKEND6), BACKEND6_MAC)
    t.backends[1] = Backend(1, ipaddress.IPv4Address(BACKEND), BACKEND_MAC)
    v6_ring = maglev.build_table([(0, "b0", 1.0)], 65537)
    v4_ring = maglev.build_table([(1, "b1", 1.0)], 65537)
    src4, src6 = ipaddress.IPv4Address(TUN_SRC4), ipaddress.IPv6Address(TUN_SRC6)
    vip6, vip4 = ipaddress.IPv6Address(VIP6), ipaddress.IPv4Address(TUN_VIP)
    tunnel = VipMode.TUNNEL
    t.vips[5] = Vip(5, vip6, 80, 6)
    t.vips[6] = Vip(6, vip6, 53, 17, mode=tunnel, tunnel_src=src6)
    t.vips[7] = Vip(7, vip6, 54, 17, mode=tunnel, tunnel_src=src6, tunnel_encap=Encap.GUE,
                    gue_port=GUE_PORT, tunnel_src_bits=8)
    t.vips[8] = Vip(8, vip4, 53, 17, mode=tunnel, tunnel_src=src4, tunnel_src_bits=4)
    t.vips[9] = Vip(9, vip4, 54, 17, mode=tunnel, tunnel_src=src4, tunnel_encap=Encap.GUE,
                    gue_port=GUE_PORT)
    t.vips[10] = Vip(10, vip4, 55, 17, mode=tunnel, tunnel_src=src6)
    # A tunnel source of another family than the backend's: not encapsulated.
    t.vips[11] = Vip(11, vip4, 56, 17, mode=tunnel, tunnel_src=src6)
    t.rings = {5: v6_ring, 6: v6_ring, 7: v6_ring, 8: v4_ring, 9: v4_ring, 10: v6_ring,
               11: v4_ring}
    return t


def flow_bits(src: str, sport: int) -> int:
    """lb_tunnel_flow_bits: the XOR of the source address's 16-bit words and
    the source port."""
    packed = ipaddress.ip_address(src).packed
    x = sport
    for i in range(0, len(packed), 2):
        x ^= int.from_bytes(packed[i:i + 2], "big")
    return x


@pytest.fixture
def v6_forwarder(netns: str, tmp_path: Path) -> Iterator[tuple[DataplaneProcess, str, Wire]]:
    with nat_forwarder_in(netns, tmp_path, tables=_v6_tunnel_tables()) as running:
        dp = running[0]
        caps = dp.client.hello()["capabilities"]
        assert "tunnel" in caps and "ndp_reply" in caps
        yield running


def test_ipv6_dsr_and_tunnel_encapsulations(
        v6_forwarder: tuple[DataplaneProcess, str, Wire]) -> None:
    dp, port_mac, wire = v6_forwarder
    # DSR: the MACs change, nothing else.
    syn = Ether(src=CLIENT_MAC, dst=port_mac) / IPv6(src=CLIENT6, dst=VIP6, hlim=9) / TCP(
        sport=40000, dport=80, flags="S")
    out = wire.exchange(bytes(syn))
    assert (out.dst, out.src) == (BACKEND6_MAC, port_mac)
    assert bytes(out)[12:] == bytes(syn)[12:]

    # 6in6 (IPIP): the inner packet as it came, an outer IPv6 header in front.
    inner6 = IPv6(src=CLIENT6, dst=VIP6, tc=0xb8, hlim=9) / UDP(sport=40001, dport=53) / b"q"
    out = wire.exchange(bytes(Ether(src=CLIENT_MAC, dst=port_mac) / inner6))
    assert (out.dst, out.src, out.type) == (BACKEND6_MAC, port_mac, 0x86DD)
    o6 = out[IPv6]
    assert (o6.src, o6.dst, o6.nh, o6.hlim, o6.tc) == (TUN_SRC6, BACKEND6, 41, 64, 0xb8)
    assert o6.fl == flow_bits(CLIENT6, 40001) and o6.plen == len(inner6)
    assert bytes(o6.payload) == bytes(inner6)

    # GUE over IPv6: UDP from 49152 + the flow bits, to the VIP's port,
    # checksum 0; the outer source's low 8 bits from the flow.
    inner6 = IPv6(src=CLIENT6, dst=VIP6) / UDP(sport=40002, dport=54) / b"q"
    out = wire.exchange(bytes(Ether(src=CLIENT_MAC, dst=port_mac) / inner6))
    bits = flow_bits(CLIENT6, 40002)
    assert out[IPv6].src == str(ipaddress.IPv6Address(TUN_SRC6) + (bits & 0xff))
    assert (out[IPv6].nh, out[UDP].dport, out[UDP].chksum) == (17, GUE_PORT, 0)
    assert out[UDP].sport == 49152 + (bits & 0x3fff) and out[UDP].len == 8 + len(inner6)
    assert bytes(out[UDP].payload) == bytes(inner6)

    # 4in4 (IPIP), the outer source's low 4 bits from the flow.
    inner4 = IP(src=CLIENT, dst=TUN_VIP, tos=0x2e, ttl=7) / UDP(sport=40003, dport=53) / b"q"
    out = wire.exchange(bytes(Ether(src=CLIENT_MAC, dst=port_mac) / inner4))
    bits = flow_bits(CLIENT, 40003)
    assert (out.dst, out.src) == (BACKEND_MAC, port_mac)
    o4 = out[IP]
    assert (o4.dst, o4.proto, o4.ttl, o4.tos, o4.flags, o4.id) == (BACKEND, 4, 64, 0x2e, "DF", 0)
    assert o4.src == str(ipaddress.IPv4Address(TUN_SRC4) + (bits & 0xf))
    assert o4.len == 20 + len(inner4) and checksum_of_ip_ok(out)
    assert bytes(o4.payload) == bytes(inner4)

    # GUE over IPv4.
    inner4 = IP(src=CLIENT, dst=TUN_VIP) / UDP(sport=40004, dport=54) / b"q"
    out = wire.exchange(bytes(Ether(src=CLIENT_MAC, dst=port_mac) / inner4))
    assert (out[IP].proto, out[IP].src, out[UDP].dport, out[UDP].chksum) == (
        17, TUN_SRC4, GUE_PORT, 0)
    assert bytes(out[UDP].payload) == bytes(inner4) and checksum_of_ip_ok(out)

    # 4in6: an IPv4 packet inside IPv6, next header 4.
    inner4 = IP(src=CLIENT, dst=TUN_VIP) / UDP(sport=40005, dport=55) / b"q"
    out = wire.exchange(bytes(Ether(src=CLIENT_MAC, dst=port_mac) / inner4), kind=0x86DD)
    assert (out.dst, out[IPv6].nh, out[IPv6].src, out[IPv6].dst) == (
        BACKEND6_MAC, 4, TUN_SRC6, BACKEND6)
    assert bytes(out[IPv6].payload) == bytes(inner4)

    # The pinned flow is encapsulated the same way the second time.
    again = wire.exchange(bytes(Ether(src=CLIENT_MAC, dst=port_mac) / inner4), kind=0x86DD)
    assert bytes(again) == bytes(out)

    # An IPv4 tunnel source for an IPv6 backend: dropped, counted.
    bad = Ether(src=CLIENT_MAC, dst=port_mac) / IP(src=CLIENT, dst=TUN_VIP) / UDP(
        sport=40006, dport=56)
    wire.sock.send(bytes(bad))
    deadline = time.monotonic() + 3
    while dp.client.stats()["counters"]["drop_encap"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    counters = dp.client.stats()["counters"]
    assert counters["tunnel_encap"] == 6 and counters["fwd_tx"] == 7
    assert (counters["flow_new"], counters["flow_hit"]) == (7, 1)


def checksum_of_ip_ok(pkt: Ether) -> bool:
    """The outer IPv4 header checksum equals scapy's recomputation."""
    again = Ether(bytes(pkt))
    del again[IP].chksum
    return Ether(bytes(again))[IP].chksum == pkt[IP].chksum


def test_neighbor_solicitations_for_vips_are_answered(
        v6_forwarder: tuple[DataplaneProcess, str, Wire]) -> None:
    dp, port_mac, wire = v6_forwarder
    solicited = "ff02::1:ff00:10"
    ns = (Ether(src=CLIENT_MAC, dst="33:33:ff:00:00:10") / IPv6(src=CLIENT6, dst=solicited)
          / ICMPv6ND_NS(tgt=VIP6) / ICMPv6NDOptSrcLLAddr(lladdr=CLIENT_MAC))
    na = wire.exchange(bytes(ns))
    assert (na.dst, na.src) == (CLIENT_MAC, port_mac) and len(bytes(na)) == 14 + 40 + 32
    assert (na[IPv6].src, na[IPv6].dst, na[IPv6].hlim, na[IPv6].plen) == (VIP6, CLIENT6, 255, 32)
    adv = na[ICMPv6ND_NA]
    assert (adv.tgt, adv.R, adv.S, adv.O) == (VIP6, 0, 1, 1)
    assert na[ICMPv6NDOptDstLLAddr].lladdr == port_mac
    again = IPv6(bytes(na[IPv6]))
    del again[ICMPv6ND_NA].cksum
    assert IPv6(bytes(again))[ICMPv6ND_NA].cksum == adv.cksum

    # Duplicate address detection (from ::): to all-nodes, S clear (RFC 4861 7.2.4).
    dad = (Ether(src=CLIENT_MAC, dst="33:33:ff:00:00:10") / IPv6(src="::", dst=solicited)
           / ICMPv6ND_NS(tgt=VIP6))
    na = wire.exchange(bytes(dad))
    assert (na.dst, na[IPv6].dst, na[ICMPv6ND_NA].S, na[ICMPv6ND_NA].O) == (
        "33:33:00:00:00:01", "ff02::1", 0, 1)

    # Not answered (to the kernel): another target, a hop limit below 255, a
    # bad checksum, a truncated solicitation, a DAD probe with a source
    # link-layer option, an option of length 0.
    truncated = bytes(ICMPv6ND_NS(tgt=VIP6))[:20]
    eth = Ether(src=CLIENT_MAC, dst="33:33:ff:00:00:10")
    slla = ICMPv6NDOptSrcLLAddr(lladdr=CLIENT_MAC)
    for frame in (
            eth / IPv6(src=CLIENT6, dst=solicited) / ICMPv6ND_NS(tgt="fd00::99"),
            eth / IPv6(src=CLIENT6, dst=solicited, hlim=64) / ICMPv6ND_NS(tgt=VIP6),
            eth / IPv6(src=CLIENT6, dst=solicited) / ICMPv6ND_NS(tgt=VIP6, cksum=0x1234),
            eth / IPv6(src=CLIENT6, dst=solicited, nh=58) / truncated,
            eth / IPv6(src="::", dst=solicited) / ICMPv6ND_NS(tgt=VIP6) / slla,
            eth / IPv6(src=CLIENT6, dst=solicited) / ICMPv6ND_NS(tgt=VIP6)
            / ICMPv6NDOptSrcLLAddr(len=0, lladdr=CLIENT_MAC)):
        before = dp.client.stats()["counters"]["pass_not_vip"]
        wire.sock.send(bytes(frame))
        deadline = time.monotonic() + 3
        while dp.client.stats()["counters"]["pass_not_vip"] != before + 1:
            assert time.monotonic() < deadline, frame.summary()
            time.sleep(0.01)
    assert dp.client.stats()["counters"]["ndp_reply"] == 2


# --- NAT mode over IPv6 -------------------------------------------------------

NAT6_VIP = "fd00::20"      # TCP 80 -> 8080 with a source from the IPv6 pool; UDP 53 -> 5353
SNAT6_ADDR = "fd00:a::1"


def _nat6_tables() -> TableSet:
    t = TableSet(hash_key=bytes(range(16)), ring_size=65537)
    t.backends[1] = Backend(1, ipaddress.IPv6Address(BACKEND6), BACKEND6_MAC, BackendState.UP)
    ring = maglev.build_table([(1, "b1", 1.0)], 65537)
    t.vips[8] = Vip(8, ipaddress.IPv6Address(NAT6_VIP), 80, 6, mode=VipMode.NAT, nat_port=8080,
                    snat=True)
    t.vips[9] = Vip(9, ipaddress.IPv6Address(NAT6_VIP), 53, 17, mode=VipMode.NAT,
                    nat_port=5353)
    t.rings = {8: ring, 9: ring}
    t.nat = NatConfig(snat_addrs=(ipaddress.IPv4Address(SNAT_ADDR),
                                  ipaddress.IPv6Address(SNAT6_ADDR)),
                      snat_port_min=20000, snat_port_max=20999)
    return t


def checksums6_ok(pkt: Ether) -> bool:
    """The checksum of what follows the IPv6 header (TCP, UDP: chksum;
    ICMPv6: cksum) equals scapy's recomputation."""
    payload = pkt[IPv6].payload
    field = next(f for f in ("chksum", "cksum") if f in payload.fields)
    again = Ether(bytes(pkt))
    delattr(again[IPv6].payload, field)
    return bool(getattr(Ether(bytes(again))[IPv6].payload, field) == getattr(payload, field))


def test_nat6_snat_ndp_udp_and_icmpv6(netns: str, tmp_path: Path) -> None:
    """NAT mode over IPv6 on the wire: the IPv6 pool address is resolved
    (Neighbor Advertisement), a TCP connection goes out from a pool pair and
    its reply comes back from the VIP, UDP keeps the client's source, and the
    backend's port unreachable reaches the client about the packet it sent."""
    with nat_forwarder_in(netns, tmp_path, tables=_nat6_tables()) as (dp, port_mac, wire):
        assert "nat6" in dp.client.hello()["capabilities"]
        solicited = "ff02::1:ff00:1"
        ns = (Ether(src=BACKEND6_MAC, dst="33:33:ff:00:00:01")
              / IPv6(src=BACKEND6, dst=solicited) / ICMPv6ND_NS(tgt=SNAT6_ADDR)
              / ICMPv6NDOptSrcLLAddr(lladdr=BACKEND6_MAC))
        na = wire.exchange(bytes(ns))
        assert (na.dst, na[IPv6].src, na[ICMPv6ND_NA].tgt) == (BACKEND6_MAC, SNAT6_ADDR,
                                                               SNAT6_ADDR)
        assert na[ICMPv6NDOptDstLLAddr].lladdr == port_mac

        syn = Ether(src=CLIENT_MAC, dst=port_mac) / IPv6(src=CLIENT6, dst=NAT6_VIP) / TCP(
            sport=40000, dport=80, flags="S", seq=1000)
        out = wire.exchange(bytes(syn))
        assert (out.dst, out.src) == (BACKEND6_MAC, port_mac)
        assert (out[IPv6].src, out[IPv6].dst, out[TCP].dport) == (SNAT6_ADDR, BACKEND6, 8080)
        snat_port = out[TCP].sport
        assert 20000 <= snat_port <= 20999 and out[TCP].seq == 1000 and checksums6_ok(out)
        syn_ack = Ether(src=BACKEND6_MAC, dst=port_mac) / IPv6(src=BACKEND6, dst=SNAT6_ADDR) / TCP(
            sport=8080, dport=snat_port, flags="SA", seq=5000, ack=1001)
        back = wire.exchange(bytes(syn_ack))
        assert (back.dst, back[IPv6].src, back[IPv6].dst, back[TCP].sport,
                back[TCP].dport) == (CLIENT_MAC, NAT6_VIP, CLIENT6, 80, 40000)
        assert back[TCP].flags == "SA" and checksums6_ok(back)

        query = Ether(src=CLIENT_MAC, dst=port_mac) / IPv6(src=CLIENT6, dst=NAT6_VIP) / UDP(
            sport=41000, dport=53) / b"query"
        sent = wire.exchange(bytes(query))
        assert (sent[IPv6].src, sent[IPv6].dst, sent[UDP].sport, sent[UDP].dport) == (
            CLIENT6, BACKEND6, 41000, 5353)
        assert checksums6_ok(sent)
        unreach = (Ether(src=BACKEND6_MAC, dst=port_mac) / IPv6(src=BACKEND6, dst=CLIENT6)
                   / ICMPv6DestUnreach(code=4) / bytes(sent[IPv6]))
        err = wire.exchange(bytes(unreach))
        assert (err.dst, err[IPv6].src, err[IPv6].dst) == (CLIENT_MAC, NAT6_VIP, CLIENT6)
        assert (err[IPerror6].src, err[IPerror6].dst) == (CLIENT6, NAT6_VIP)
        assert (err[UDPerror].sport, err[UDPerror].dport) == (41000, 53)
        assert checksums6_ok(err)
        assert bytes(err[IPerror6]) == bytes(query[IPv6])  # the client's packet, whole

        stats = dp.client.stats()
        counters, conns = stats["counters"], stats["conns"]
        assert (counters["conn_new"], counters["conn_reply"], counters["nat_icmp"],
                counters["ndp_reply"]) == (2, 1, 1, 1)
        assert conns["capacity"] == 128 and conns["entries"] == 4
        assert conns["snat_ports_in_use"] == 1 and conns["by_state"]["syn_recv"] == 1
