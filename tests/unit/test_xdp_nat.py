"""hpclb-xdp's NAT gateway mode (dataplane/common/lb_conn.h), driven through
the real daemon and the real program: tables pushed with the table protocol,
frames run with BPF_PROG_TEST_RUN as if they had arrived on a given port.

The test runs pass an XDP context whose ingress_ifindex names one of the
daemon's ports (the veths of its namespace): the kernel looks that device up
in the namespace of the calling thread, so each such run enters the
daemon's namespace for the duration of the syscall."""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import json
import os
import platform
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from scapy.layers.inet import ICMP, IP, TCP, UDP, IPerror, TCPerror, UDPerror
from scapy.layers.inet6 import ICMPv6PacketTooBig, IPerror6, IPv6, IPv6ExtHdrDestOpt, PadN
from scapy.layers.l2 import Ether

from hpclb.contract.tables import (
    CONN6_DTYPE,
    CONN_DTYPE,
    CONN_TIMEOUTS_DEFAULT,
    FLOW_KEY_DTYPE,
    FLOW_KEY_V4_DTYPE,
    IPPROTO_TCP,
    IPPROTO_UDP,
    Backend,
    BackendState,
    NatConfig,
    NatDown,
    TableSet,
    Vip,
    VipMode,
    mac_str,
)
from hpclb.dataplane.client import DataplaneClient
from hpclb.dataplane.push import fetch_tables, push_tables
from hpclb.dataplane.supervisor import DataplaneProcess, find_xdp_daemon
from hpclb.host import netns as netns_mod

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: network namespaces and BPF")

RING_SIZE = 13  # a small prime: rings are pushed whole, and every test is one-backend
HASH_KEY = bytes(range(16))
CLIENT = "10.9.0.1"
CLIENT_MAC = "02:aa:00:00:00:01"
VIP_ADDR = ipaddress.IPv4Address("198.18.1.20")
SNAT_ADDR = ipaddress.IPv4Address("198.18.0.250")
BACKEND_MACS = {3: "02:bb:00:00:00:13", 4: "02:bb:00:00:00:14", 5: "02:bb:00:00:00:15"}


# ---- BPF_PROG_TEST_RUN with an XDP context -----------------------------------

_BPF_SYSCALL = {"x86_64": 321, "aarch64": 280}
BPF_OBJ_GET = 7
BPF_PROG_TEST_RUN = 10
XDP_ACTIONS = {0: "aborted", 1: "drop", 2: "pass", 3: "tx", 4: "redirect"}


class _ObjGetAttr(ctypes.Structure):
    _fields_ = (("pathname", ctypes.c_uint64), ("bpf_fd", ctypes.c_uint32),
                ("file_flags", ctypes.c_uint32), ("path_fd", ctypes.c_int32),
                ("_pad", ctypes.c_uint8 * 108))


class _TestRunAttr(ctypes.Structure):
    _fields_ = (("prog_fd", ctypes.c_uint32), ("retval", ctypes.c_uint32),
                ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
                ("data_in", ctypes.c_uint64), ("data_out", ctypes.c_uint64),
                ("repeat", ctypes.c_uint32), ("duration", ctypes.c_uint32),
                ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
                ("ctx_in", ctypes.c_uint64), ("ctx_out", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32),
                ("batch_size", ctypes.c_uint32), ("_pad", ctypes.c_uint8 * 60))


class _XdpMd(ctypes.Structure):
    """struct xdp_md: data and data_end are offsets in a test run's context."""

    _fields_ = (("data", ctypes.c_uint32), ("data_end", ctypes.c_uint32),
                ("data_meta", ctypes.c_uint32), ("ingress_ifindex", ctypes.c_uint32),
                ("rx_queue_index", ctypes.c_uint32), ("egress_ifindex", ctypes.c_uint32))


class XdpRunner:
    """The pinned lb_xdp, run on one frame as if it had arrived on a port.

    ``run(frame, ifindex, netns)``: with an ifindex, the context's
    ingress_ifindex is that device of ``netns`` (the call enters it: the
    kernel resolves the index in the caller's namespace); without one, the
    run happens "on" the loopback device, which is no port: the program then
    takes the frame as arriving on port 0."""

    def __init__(self, pin_path: str) -> None:
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._nr = _BPF_SYSCALL[platform.machine()]
        path = ctypes.create_string_buffer(pin_path.encode())
        self.fd = self._bpf(BPF_OBJ_GET, _ObjGetAttr(pathname=ctypes.addressof(path)))

    def _bpf(self, cmd: int, attr: ctypes.Structure) -> int:
        ret = self._libc.syscall(self._nr, ctypes.c_int(cmd), ctypes.byref(attr),
                                 ctypes.c_uint(ctypes.sizeof(attr)))
        if ret < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"bpf(cmd={cmd}): {os.strerror(err)}")
        return int(ret)

    def run(self, frame: bytes, ifindex: int = 0, netns: str | None = None) -> tuple[str, bytes]:
        data_in = ctypes.create_string_buffer(frame, len(frame))
        data_out = ctypes.create_string_buffer(len(frame) + 256)
        attr = _TestRunAttr(prog_fd=self.fd, data_size_in=len(frame),
                            data_size_out=len(frame) + 256,
                            data_in=ctypes.addressof(data_in),
                            data_out=ctypes.addressof(data_out), repeat=1)
        md = _XdpMd(data=0, data_end=len(frame), ingress_ifindex=ifindex)
        if ifindex:
            attr.ctx_in = ctypes.addressof(md)
            attr.ctx_size_in = ctypes.sizeof(md)
            assert netns is not None
            with netns_mod.inside(netns):
                self._bpf(BPF_PROG_TEST_RUN, attr)
        else:
            self._bpf(BPF_PROG_TEST_RUN, attr)
        return XDP_ACTIONS[attr.retval], data_out.raw[: attr.data_size_out]

    def close(self) -> None:
        os.close(self.fd)


# ---- the daemon ----------------------------------------------------------------

@dataclass
class Gateway:
    """hpclb-xdp --no-attach on port 0 = va (clients), port 1 = wa (backends)."""

    netns: str
    pins: Path
    dataplane: DataplaneProcess
    prog: XdpRunner
    ifindex: list[int]
    port_macs: list[str]

    @property
    def client(self) -> DataplaneClient:
        return self.dataplane.client

    def run(self, frame: bytes, port: int | None = 0) -> tuple[str, bytes]:
        """The frame as if it arrived on ``port`` (None: no context at all)."""
        if port is None:
            return self.prog.run(frame)
        return self.prog.run(frame, self.ifindex[port], self.netns)

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.client.stats()["counters"].items()}

    def conns(self) -> dict:
        return self.client.stats()["conns"]

    def entries(self) -> dict[tuple, np.void]:
        """conn_map as bpftool dumps it: {(saddr, daddr, sport, dport, proto): entry}."""
        out = subprocess.run(["bpftool", "-j", "map", "dump", "pinned",
                              str(self.pins / "conn_map")], check=True,
                             capture_output=True, text=True).stdout
        table = {}
        for e in json.loads(out):
            key = np.frombuffer(bytes(int(b, 16) for b in e["key"]), FLOW_KEY_V4_DTYPE)[0]
            val = np.frombuffer(bytes(int(b, 16) for b in e["value"]), CONN_DTYPE)[0]
            table[(str(ipaddress.IPv4Address(bytes(key["saddr"]))),
                   str(ipaddress.IPv4Address(bytes(key["daddr"]))),
                   int(key["sport"]), int(key["dport"]), int(key["proto"]))] = val
        return table


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"hlbn-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for a, b in (("va", "vb"), ("wa", "wb")):
            subprocess.run(["ip", "-n", name, "link", "add", a, "type", "veth", "peer", "name",
                            b], check=True)
            for dev in (a, b):
                subprocess.run(["ip", "-n", name, "link", "set", dev, "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
        shutil.rmtree(f"/sys/fs/bpf/hpclb/nat-{name}", ignore_errors=True)


def start(netns: str, tmp: Path, *extra: str, attach: bool = False) -> Gateway:
    tmp.mkdir(parents=True, exist_ok=True)
    endpoint = f"ipc://{tmp}/dp.sock"
    pins = Path(f"/sys/fs/bpf/hpclb/nat-{netns}")
    dataplane = DataplaneProcess(
        argv=[find_xdp_daemon(), "--netns", netns, "--iface", "va", "--egress", "wa",
              "--socket", endpoint, "--pin-dir", str(pins), "--ring-size", str(RING_SIZE),
              *([] if attach else ["--no-attach"]), *extra],
        endpoint=endpoint, pidfile=tmp / "hpclb-xdp.pid", log_path=tmp / "hpclb-xdp.log",
    )
    dataplane.start()
    try:
        hello = dataplane.client.hello()
        return Gateway(netns, pins, dataplane, XdpRunner(str(pins / "lb_xdp")),
                       [int(p["ifindex"]) for p in hello["ports"]],
                       [mac_str(bytes(p["mac"])) for p in hello["ports"]])
    except BaseException:
        dataplane.stop()
        raise


def stop(gw: Gateway) -> str:
    gw.prog.close()
    gw.dataplane.stop()
    log = gw.dataplane.log_path.read_text() if gw.dataplane.log_path else ""
    assert gw.dataplane.returncode == 0, log
    return log


def kill_hard(gw: Gateway) -> None:
    """SIGKILL: the pins stay, as after a crash."""
    gw.prog.close()
    assert gw.dataplane.pid is not None
    os.kill(gw.dataplane.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{gw.dataplane.pid}") and time.monotonic() < deadline:
        try:
            os.waitpid(gw.dataplane.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    gw.dataplane.stop()


def nat_tables(*, snat: bool = False, nat: NatConfig | None = None,
               backends: tuple[int, ...] = (3,), nat_port: int = 8080) -> TableSet:
    """A TCP and a UDP NAT VIP on backends behind port 1 (the cluster side)."""
    t = TableSet(hash_key=HASH_KEY, ring_size=RING_SIZE)
    for bid, mac in BACKEND_MACS.items():
        # 3 and 4 behind the cluster-side port 1; 5 one-arm (port 0: the
        # port each frame came in on).
        t.backends[bid] = Backend(bid, ipaddress.IPv4Address(f"198.18.0.{10 + bid}"), mac,
                                  port=0 if bid == 5 else 1)
    ring = np.array([backends[i % len(backends)] for i in range(RING_SIZE)], dtype=np.uint32)
    t.vips[0] = Vip(0, VIP_ADDR, 80, IPPROTO_TCP, mode=VipMode.NAT, nat_port=nat_port, snat=snat)
    t.vips[1] = Vip(1, VIP_ADDR, 53, IPPROTO_UDP, mode=VipMode.NAT, snat=snat)
    t.rings = {0: ring, 1: ring.copy()}
    t.nat = nat or NatConfig(snat_addrs=(SNAT_ADDR,) if snat else ())
    return t


def from_client(sport: int, flags: str = "S", client: str = CLIENT, dport: int = 80) -> bytes:
    return bytes(Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01") / IP(src=client, dst=str(VIP_ADDR))
                 / TCP(sport=sport, dport=dport, flags=flags, seq=1000) / b"hello")


def from_backend(bid: int, dst: str, dport: int, flags: str = "SA", sport: int = 8080) -> bytes:
    return bytes(Ether(src=BACKEND_MACS[bid], dst="02:00:00:00:00:02")
                 / IP(src=f"198.18.0.{10 + bid}", dst=dst)
                 / TCP(sport=sport, dport=dport, flags=flags, seq=5000, ack=1001) / b"world")


def assert_checksums(frame: bytes) -> Ether:
    """The IPv4 and L4 checksums of a TCP/UDP frame, or of an ICMP error and
    of the packet it quotes (whole), are right: scapy recomputes them."""
    pkt = Ether(frame)
    fixed = pkt.copy()
    del fixed[IP].chksum
    l4 = fixed[IP].payload
    del l4.chksum
    assert bytes(Ether(bytes(fixed))) == frame, "checksums recomputed differ"
    if pkt[IP].proto == 1:
        quote = bytes(pkt[ICMP].payload)
        inner = IP(quote)
        del inner.chksum
        del inner.payload.chksum
        assert bytes(IP(bytes(inner))) == quote, "quoted checksums recomputed differ"
    return pkt


def conn_key(pkt: Ether) -> tuple:
    return (pkt[IP].src, pkt[IP].dst, pkt[IP].sport, pkt[IP].dport, pkt[IP].proto)


def counter_moves(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that changed between two readings, by how much."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


# ---- tests ---------------------------------------------------------------------

def test_syn_opens_a_connection_and_the_reply_comes_back(netns: str, tmp_path: Path) -> None:
    gw = start(netns, tmp_path, "--conn-table-size", "64")
    try:
        hello = gw.client.hello()
        assert "nat" in hello["capabilities"] and hello["conn_table_size"] == 64
        push_tables(gw.client, None, nat_tables())
        before = gw.counters()

        # The client's SYN, on port 0: DNATed to backend 3:8080, out of port 1.
        action, out = gw.run(from_client(40000))
        assert action == "redirect"
        pkt = assert_checksums(out)
        assert (pkt.dst, pkt.src) == (BACKEND_MACS[3], gw.port_macs[1])
        assert conn_key(pkt) == (CLIENT, "198.18.0.13", 40000, 8080, IPPROTO_TCP)
        assert pkt[TCP].flags == "S" and bytes(pkt[TCP].payload) == b"hello"
        table = gw.entries()
        orig = table[(CLIENT, str(VIP_ADDR), 40000, 80, IPPROTO_TCP)]
        reply = table[("198.18.0.13", CLIENT, 8080, 40000, IPPROTO_TCP)]
        assert len(table) == 2
        assert (orig["dir"], orig["state"], orig["backend_id"], orig["client_port"]) == (0, 0, 3, 0)
        assert mac_str(bytes(orig["client_mac"])) == CLIENT_MAC
        assert reply["dir"] == 1
        conns = gw.conns()
        # Capacity: both families' tables, --conn-table-size entries each.
        assert conns["entries"] == 2 and conns["capacity"] == 2 * 64
        assert conns["by_state"]["syn_sent"] == 1

        # The backend's SYN-ACK arrives on port 1: back to the client on port 0.
        action, out = gw.run(from_backend(3, CLIENT, 40000), port=1)
        assert action == "redirect"
        pkt = assert_checksums(out)
        assert (pkt.dst, pkt.src) == (CLIENT_MAC, gw.port_macs[0])
        assert conn_key(pkt) == (str(VIP_ADDR), CLIENT, 80, 40000, IPPROTO_TCP)
        assert pkt[TCP].flags == "SA" and bytes(pkt[TCP].payload) == b"world"
        assert gw.conns()["by_state"]["syn_recv"] == 1

        # The client's ACK: established; the same connection (a hit).
        action, out = gw.run(from_client(40000, "A"))
        assert action == "redirect"
        assert conn_key(assert_checksums(out))[1:4] == ("198.18.0.13", 40000, 8080)
        assert gw.conns()["by_state"]["established"] == 1

        # A reply on the client's own port leaves by XDP_TX; a test run
        # without a context counts as arriving on port 0 too.
        assert gw.run(from_backend(3, CLIENT, 40000, "A"), port=0)[0] == "tx"
        assert gw.run(from_backend(3, CLIENT, 40000, "A"), port=None)[0] == "tx"

        after = gw.counters()
        moved = counter_moves(before, after)
        assert moved == {"rx": 5, "conn_new": 1, "conn_hit": 1, "conn_reply": 3,
                         "fwd_redirect": 3, "fwd_tx": 2}, moved
        vips = {row[0]: row[1] for row in gw.client.stats()["vips"]}
        assert vips[0] == 5
    finally:
        stop(gw)


def test_snat_udp_and_icmp_errors(netns: str, tmp_path: Path) -> None:
    gw = start(netns, tmp_path, "--conn-table-size", "64")
    try:
        push_tables(gw.client, None, nat_tables(snat=True))
        query = bytes(Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01")
                      / IP(src=CLIENT, dst=str(VIP_ADDR)) / UDP(sport=5353, dport=53) / b"q")
        action, out = gw.run(query)
        assert action == "redirect"
        pkt = assert_checksums(out)
        assert pkt[IP].src == str(SNAT_ADDR) and 1024 <= pkt[UDP].sport <= 65535
        assert (pkt[IP].dst, pkt[UDP].dport) == ("198.18.0.13", 53)
        sport = pkt[UDP].sport
        conns = gw.conns()
        assert conns["snat_ports_in_use"] == 1 and conns["by_state"]["udp_unreplied"] == 1

        # A router between says "fragmentation needed" about that datagram:
        # for the client, its quote translated back, from the VIP.
        quoted = bytes(pkt[IP])
        icmp = bytes(Ether(src="02:cc:00:00:00:01", dst=gw.port_macs[1])
                     / IP(src="198.18.0.1", dst=str(SNAT_ADDR))
                     / ICMP(type=3, code=4, nexthopmtu=1400) / quoted)
        action, out = gw.run(icmp, port=1)
        assert action == "redirect"
        err = assert_checksums(out)
        assert (err.dst, err.src) == (CLIENT_MAC, gw.port_macs[0])
        assert (err[IP].src, err[IP].dst) == (str(VIP_ADDR), CLIENT)
        assert (err[IPerror].src, err[IPerror].dst) == (CLIENT, str(VIP_ADDR))
        assert (err[UDPerror].sport, err[UDPerror].dport) == (5353, 53)

        # The answer, to the pool address: back to the client, from the VIP.
        answer = bytes(Ether(src=BACKEND_MACS[3], dst=gw.port_macs[1])
                       / IP(src="198.18.0.13", dst=str(SNAT_ADDR)) / UDP(sport=53, dport=sport)
                       / b"a")
        action, out = gw.run(answer, port=1)
        assert action == "redirect"
        pkt = assert_checksums(out)
        assert conn_key(pkt) == (str(VIP_ADDR), CLIENT, 53, 5353, IPPROTO_UDP)
        assert gw.conns()["by_state"]["udp_replied"] == 1
        counters = gw.counters()
        assert counters["nat_icmp"] == 1 and counters["conn_reply"] == 1

        # An ICMP error about nothing known, and a datagram for no VIP and
        # no connection, on either port: the kernel's.
        stray = bytes(Ether() / IP(src="198.18.0.1", dst=CLIENT) / ICMP(type=3, code=1)
                      / IPerror(src=CLIENT, dst="198.18.0.99") / TCPerror(sport=1, dport=2))
        assert gw.run(stray, port=1)[0] == "pass"
        other = bytes(Ether() / IP(src="198.18.0.13", dst="198.18.0.250") / UDP(sport=53,
                                                                               dport=9))
        assert gw.run(other, port=1)[0] == "pass"
        assert gw.run(other, port=0)[0] == "pass"
    finally:
        stop(gw)


def test_rst_backend_down_and_reschedule(netns: str, tmp_path: Path) -> None:
    gw = start(netns, tmp_path, "--conn-table-size", "64")
    try:
        tables = nat_tables(backends=(3,))
        push_tables(gw.client, None, tables)
        assert gw.run(from_client(41000, "R"))[0] == "drop"
        assert gw.counters()["drop_conn_invalid"] == 1
        assert gw.run(from_client(41000, "A"))[0] == "redirect"  # opens ESTABLISHED
        assert gw.conns()["by_state"]["established"] == 1

        # Backend 3 down, 4 takes the ring. DROP: the connection's packets drop.
        down = nat_tables(backends=(4,), nat=NatConfig(on_backend_down=NatDown.DROP))
        down.backends[3] = replace(down.backends[3], state=BackendState.DOWN)
        push_tables(gw.client, tables, down)
        assert gw.run(from_client(41000, "A"))[0] == "drop"
        assert gw.counters()["drop_backend_down"] == 1
        # RESCHEDULE: moved to backend 4, a new connection.
        resched = replace(down, nat=NatConfig())
        push_tables(gw.client, down, resched)
        action, out = gw.run(from_client(41000, "A"))
        assert action == "redirect" and Ether(out)[IP].dst == "198.18.0.14"
        counters = gw.counters()
        assert counters["conn_reschedule"] == 1 and counters["conn_new"] == 2
        assert set(gw.entries()) == {(CLIENT, str(VIP_ADDR), 41000, 80, IPPROTO_TCP),
                                     ("198.18.0.14", CLIENT, 8080, 41000, IPPROTO_TCP)}
    finally:
        stop(gw)


def test_full_table_evicts_the_oldest_embryonic_connection(netns: str, tmp_path: Path) -> None:
    # 4 entries: two connections (the FIFO holds 4 keys, more than this
    # sequence ever leaves in it).
    gw = start(netns, tmp_path, "--conn-table-size", "4")
    try:
        push_tables(gw.client, None, nat_tables(nat_port=0))

        def origs() -> set[int]:
            return {k[2] for k, v in gw.entries().items() if v["dir"] == 0}

        assert gw.run(from_client(1001))[0] == "redirect"  # A: SYN_SENT
        assert gw.run(from_client(1002))[0] == "redirect"  # B: SYN_SENT
        assert gw.run(from_client(1003))[0] == "redirect"  # C evicts A
        assert origs() == {1002, 1003}
        assert gw.run(from_client(1004, "A"))[0] == "redirect"  # D (established) evicts B
        assert origs() == {1003, 1004}
        assert gw.run(from_client(1005))[0] == "redirect"  # E evicts C
        assert origs() == {1004, 1005}
        # E established: nothing embryonic is left, the FIFO's key for E is
        # taken and found established; F is refused.
        assert gw.run(from_backend(3, CLIENT, 1005, sport=80), port=1)[0] == "redirect"
        assert gw.run(from_client(1005, "A"))[0] == "redirect"
        assert gw.run(from_client(1006))[0] == "drop"
        assert origs() == {1004, 1005}
        counters = gw.counters()
        assert counters["conn_evict"] == 3 and counters["drop_conn_full"] == 1
        assert counters["conn_new"] == 5
        conns = gw.conns()
        assert conns["entries"] == 4 and conns["by_state"]["established"] == 2
    finally:
        stop(gw)


def test_sweeper_expires_idle_connections(netns: str, tmp_path: Path) -> None:
    gw = start(netns, tmp_path, "--conn-table-size", "64")
    try:
        short = NatConfig(timeouts_s=(1, *CONN_TIMEOUTS_DEFAULT[1:]))  # syn_sent: 1 s
        push_tables(gw.client, None, nat_tables(nat=short))
        assert gw.run(from_client(42000))[0] == "redirect"  # SYN_SENT: 1 s
        assert gw.run(from_client(42001, "A"))[0] == "redirect"  # ESTABLISHED: 5 days
        assert gw.conns()["entries"] == 4
        # The sweeper thread alone (no stats request meanwhile) removes the
        # idle SYN_SENT connection, both entries, within its interval.
        deadline = time.monotonic() + 10
        while len(gw.entries()) > 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {k[2] for k in gw.entries()} == {42001, 8080}
        conns = gw.conns()
        assert conns["entries"] == 2 and conns["expired"] == 1
        assert conns["by_state"]["established"] == 1 and conns["by_state"]["syn_sent"] == 0
        # The connection is gone: its reply is the kernel's now.
        assert gw.run(from_backend(3, CLIENT, 42000), port=1)[0] == "pass"
    finally:
        stop(gw)


def test_connections_survive_a_daemon_restart(netns: str, tmp_path: Path) -> None:
    nat = NatConfig(snat_addrs=(SNAT_ADDR,), timeouts_s=(30, 60, 999, 120, 120, 10, 30, 120))
    tables = nat_tables(snat=True, nat=nat)
    first = start(netns, tmp_path / "1", "--conn-table-size", "64")
    try:
        push_tables(first.client, None, tables)
        action, out = first.run(from_client(43000))
        assert action == "redirect"
        sport = Ether(out)[TCP].sport
        entries = first.entries()
    finally:
        kill_hard(first)

    second = start(netns, tmp_path / "2", "--conn-table-size", "64")
    try:
        log = (tmp_path / "2" / "hpclb-xdp.log").read_text()
        assert "adopted the pinned tables" in log, log
        held = fetch_tables(second.client)
        assert held.vips == tables.vips and held.nat == nat
        assert set(second.entries()) == set(entries)
        assert second.conns()["by_state"]["syn_sent"] == 1
        # The new program instance looks replies up (its nat_active is set
        # from the adopted tables) and the connection carries on.
        action, out = second.run(from_backend(3, str(SNAT_ADDR), sport), port=1)
        assert action == "redirect"
        assert conn_key(assert_checksums(out)) == (str(VIP_ADDR), CLIENT, 80, 43000, IPPROTO_TCP)
        assert second.run(from_client(43000, "A"))[0] == "redirect"
        assert second.counters()["conn_hit"] >= 1
    finally:
        kill_hard(second)

    # Another --conn-table-size: the connection table is replaced, the rest
    # adopted.
    third = start(netns, tmp_path / "3", "--conn-table-size", "128")
    try:
        log = (tmp_path / "3" / "hpclb-xdp.log").read_text()
        assert "replacing the pinned NAT connection table" in log, log
        assert "adopted the pinned tables" in log, log
        held = fetch_tables(third.client)
        assert held.vips == tables.vips and held.nat == nat
        assert third.entries() == {}
        assert third.conns()["capacity"] == 2 * 128
    finally:
        stop(third)


def test_attached_to_every_port_and_dsr_unchanged(netns: str, tmp_path: Path) -> None:
    gw = start(netns, tmp_path, attach=True)
    try:
        for dev in ("va", "wa"):
            link = subprocess.run(["ip", "-n", netns, "link", "show", dev], check=True,
                                  capture_output=True, text=True).stdout
            assert "xdp" in link, link
        assert gw.client.hello()["attach_mode"] == "native"
        t = nat_tables()
        t.vips[0] = Vip(0, VIP_ADDR, 80, IPPROTO_TCP)  # DSR
        t.vips[1] = Vip(1, VIP_ADDR, 81, IPPROTO_TCP)  # DSR, one-arm backend 5
        t.rings[1] = np.full(RING_SIZE, 5, dtype=np.uint32)
        push_tables(gw.client, None, t)
        before = gw.counters()
        # DSR: only the MACs change; backend 3 is behind port 1.
        frame = from_client(44000)
        action, out = gw.run(frame)
        assert action == "redirect" and out[12:] == frame[12:]
        assert Ether(out).src == gw.port_macs[1]
        # Backend 5 (port 0): back out of the port the frame came in on,
        # with that port's MAC; a run without a context is port 0's.
        frame = from_client(44000, dport=81)
        for port, mac in ((0, 0), (1, 1), (None, 0)):
            action, out = gw.run(frame, port=port)
            assert action == "tx" and Ether(out).src == gw.port_macs[mac], port
            assert out[12:] == frame[12:]
        # No NAT VIP: frames for no VIP pass on either port, no lookup.
        stray = from_backend(3, CLIENT, 44000)
        assert gw.run(stray, port=1)[0] == "pass"
        assert gw.run(stray, port=0)[0] == "pass"
        after = gw.counters()
        assert after["pass_not_vip"] - before["pass_not_vip"] == 2
        assert after["fwd_tx"] - before["fwd_tx"] == 3
        assert after["conn_new"] == before["conn_new"] == 0
    finally:
        log = stop(gw)
    for dev in ("va", "wa"):
        link = subprocess.run(["ip", "-n", netns, "link", "show", dev], check=True,
                              capture_output=True, text=True).stdout
        assert "xdp" not in link, "detached on SIGTERM"
    assert "detached from wa" in log


def test_one_arm_backend_answers_through_the_port_it_came_in_on(netns: str,
                                                               tmp_path: Path) -> None:
    """Backend port 0 is "the port the frame came in on": a one-arm NAT
    gateway sends both directions back out of port 0 (XDP_TX)."""
    gw = start(netns, tmp_path, "--conn-table-size", "64")
    try:
        push_tables(gw.client, None, nat_tables(backends=(5,)))
        action, out = gw.run(from_client(45000))
        assert action == "tx"
        pkt = assert_checksums(out)
        assert (pkt.dst, pkt.src) == (BACKEND_MACS[5], gw.port_macs[0])
        assert conn_key(pkt) == (CLIENT, "198.18.0.15", 45000, 8080, IPPROTO_TCP)
        action, out = gw.run(from_backend(5, CLIENT, 45000), port=0)
        assert action == "tx"
        pkt = assert_checksums(out)
        assert (pkt.dst, pkt.src) == (CLIENT_MAC, gw.port_macs[0])
        assert conn_key(pkt) == (str(VIP_ADDR), CLIENT, 80, 45000, IPPROTO_TCP)
        assert gw.conns()["by_state"]["syn_recv"] == 1
    finally:
        stop(gw)


def test_sweeper_removes_orphan_reply_entries(netns: str, tmp_path: Path) -> None:
    """A reply entry whose original is gone (a daemon killed between two
    deletes, a race between CPUs) is found and removed; a whole connection
    written by hand is kept."""
    gw = start(netns, tmp_path, "--conn-table-size", "64")
    try:
        push_tables(gw.client, None, nat_tables())
        assert gw.run(from_client(46001))[0] == "redirect"

        def key(saddr: str, daddr: str, sport: int, dport: int) -> np.ndarray:
            k = np.zeros(1, FLOW_KEY_V4_DTYPE)
            k["saddr"] = list(ipaddress.IPv4Address(saddr).packed)
            k["daddr"] = list(ipaddress.IPv4Address(daddr).packed)
            k["sport"], k["dport"], k["proto"] = sport, dport, IPPROTO_TCP
            return k

        orphan = key("198.18.0.13", CLIENT, 8080, 46000)
        entry = np.zeros(1, CONN_DTYPE)
        entry["peer"] = key(CLIENT, str(VIP_ADDR), 46000, 80)
        entry["backend_id"], entry["dir"], entry["state"] = 3, 1, 2
        subprocess.run(["bpftool", "map", "update", "pinned", str(gw.pins / "conn_map"),
                        "key", "hex", *(f"{b:02x}" for b in orphan.tobytes()),
                        "value", "hex", *(f"{b:02x}" for b in entry.tobytes())], check=True)
        assert len(gw.entries()) == 3
        conns = gw.conns()  # a pass: the pair sums differ, the orphan is searched for
        assert conns["entries"] == 2 and conns["expired"] == 0
        assert ("198.18.0.13", CLIENT, 8080, 46000, IPPROTO_TCP) not in gw.entries()
        assert ("198.18.0.13", CLIENT, 8080, 46001, IPPROTO_TCP) in gw.entries()
    finally:
        log = stop(gw)
    assert "removed 1 orphan NAT reply entries" in log, log


# ---- IPv6 (conn6_map, lb_xdp_nat6) ---------------------------------------------

CLIENT6 = "fd00:9::1"
VIP6 = ipaddress.IPv6Address("fd00:18::20")
SNAT6 = ipaddress.IPv6Address("fd00:18::250")


def backend6(bid: int) -> str:
    return f"fd00::{10 + bid:x}"


def nat6_tables(*, snat: bool = False, nat: NatConfig | None = None) -> TableSet:
    """nat_tables' IPv6 twin: a TCP and a UDP NAT VIP on IPv6 backend 3
    (port 1), and an IPv4 backend 4 for the family rule."""
    t = TableSet(hash_key=HASH_KEY, ring_size=RING_SIZE)
    t.backends[3] = Backend(3, ipaddress.IPv6Address(backend6(3)), BACKEND_MACS[3], port=1)
    t.backends[4] = Backend(4, ipaddress.IPv4Address("198.18.0.14"), BACKEND_MACS[4], port=1)
    ring = np.full(RING_SIZE, 3, dtype=np.uint32)
    t.vips[0] = Vip(0, VIP6, 80, IPPROTO_TCP, mode=VipMode.NAT, nat_port=8080, snat=snat)
    t.vips[1] = Vip(1, VIP6, 53, IPPROTO_UDP, mode=VipMode.NAT, snat=snat)
    t.rings = {0: ring, 1: ring.copy()}
    t.nat = nat or NatConfig(snat_addrs=(SNAT6,) if snat else ())
    return t


def from_client6(sport: int, flags: str = "S", ext: tuple[int, ...] = ()) -> bytes:
    """ext: a destination-options header of PadN options of those lengths."""
    l3 = IPv6(src=CLIENT6, dst=str(VIP6))
    if ext:
        l3 = l3 / IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * n) for n in ext])
    return bytes(Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01") / l3
                 / TCP(sport=sport, dport=80, flags=flags, seq=1000) / b"hello")


def from_backend6(dst: str, dport: int, flags: str = "SA", sport: int = 8080) -> bytes:
    return bytes(Ether(src=BACKEND_MACS[3], dst="02:00:00:00:00:02")
                 / IPv6(src=backend6(3), dst=dst)
                 / TCP(sport=sport, dport=dport, flags=flags, seq=5000, ack=1001) / b"world")


def assert_checksums6(frame: bytes) -> Ether:
    """The L4 checksum of an IPv6 TCP/UDP frame, or the ICMPv6 checksum of
    an error and the L4 checksum of the packet it quotes (whole), are right."""
    pkt = Ether(frame)
    fixed = pkt.copy()
    l4 = fixed[IPv6].payload
    while isinstance(l4, IPv6ExtHdrDestOpt):
        l4 = l4.payload
    if isinstance(l4, ICMPv6PacketTooBig):
        del l4.cksum
    else:
        del l4.chksum
    assert bytes(Ether(bytes(fixed))) == frame, "checksums recomputed differ"
    if ICMPv6PacketTooBig in pkt:
        quote = bytes(pkt[ICMPv6PacketTooBig].payload)
        inner = IPv6(quote)
        del inner.payload.chksum
        assert bytes(IPv6(bytes(inner))) == quote, "quoted checksum recomputed differs"
    return pkt


def conn6_key(pkt: Ether) -> tuple:
    return (pkt[IPv6].src, pkt[IPv6].dst, pkt[IPv6].payload.sport, pkt[IPv6].payload.dport)


def entries6(gw: Gateway) -> dict[tuple, np.void]:
    """conn6_map as bpftool dumps it: {(saddr, daddr, sport, dport, proto): entry}."""
    out = subprocess.run(["bpftool", "-j", "map", "dump", "pinned", str(gw.pins / "conn6_map")],
                         check=True, capture_output=True, text=True).stdout
    table = {}
    for e in json.loads(out):
        key = np.frombuffer(bytes(int(b, 16) for b in e["key"]), FLOW_KEY_DTYPE)[0]
        val = np.frombuffer(bytes(int(b, 16) for b in e["value"]), CONN6_DTYPE)[0]
        assert (int(key["family"]), bytes(key["pad"])) == (6, b"\0\0")
        table[(str(ipaddress.IPv6Address(bytes(key["saddr"]))),
               str(ipaddress.IPv6Address(bytes(key["daddr"]))),
               int(key["sport"]), int(key["dport"]), int(key["proto"]))] = val
    return table


def test_ipv6_connection_both_ways_and_counted(netns: str, tmp_path: Path) -> None:
    gw = start(netns, tmp_path, "--conn-table-size", "64")
    try:
        hello = gw.client.hello()
        assert "nat6" in hello["capabilities"] and hello["conn_table_size"] == 64
        push_tables(gw.client, None, nat6_tables())
        before = gw.counters()

        action, out = gw.run(from_client6(40000))
        assert action == "redirect"
        pkt = assert_checksums6(out)
        assert (pkt.dst, pkt.src) == (BACKEND_MACS[3], gw.port_macs[1])
        assert conn6_key(pkt) == (CLIENT6, backend6(3), 40000, 8080)
        assert bytes(pkt[TCP].payload) == b"hello"
        table = entries6(gw)
        orig = table[(CLIENT6, str(VIP6), 40000, 80, IPPROTO_TCP)]
        reply = table[(backend6(3), CLIENT6, 8080, 40000, IPPROTO_TCP)]
        assert len(table) == 2 and gw.entries() == {}
        assert (orig["dir"], orig["state"], orig["backend_id"]) == (0, 0, 3)
        assert reply["dir"] == 1
        conns = gw.conns()
        assert conns["entries"] == 2 and conns["capacity"] == 2 * 64
        assert conns["by_state"]["syn_sent"] == 1

        # The SYN-ACK on port 1: back to the client, from the VIP.
        action, out = gw.run(from_backend6(CLIENT6, 40000), port=1)
        assert action == "redirect"
        pkt = assert_checksums6(out)
        assert (pkt.dst, pkt.src) == (CLIENT_MAC, gw.port_macs[0])
        assert conn6_key(pkt) == (str(VIP6), CLIENT6, 80, 40000)
        assert gw.conns()["by_state"]["syn_recv"] == 1
        # The ACK, with an extension header (8 bytes of destination
        # options): a hit, translated behind the header.
        action, out = gw.run(from_client6(40000, "A", ext=(4,)))
        assert action == "redirect"
        pkt = assert_checksums6(out)
        assert conn6_key(pkt) == (CLIENT6, backend6(3), 40000, 8080)
        assert gw.conns()["by_state"]["established"] == 1

        # Beyond LB_NAT6_MAX_L4_OFF (310: 256 bytes of extension headers):
        # the kernel's, untouched, before any lookup, to the VIP or not.
        long_ext = from_client6(40000, "A", ext=(200, 60))
        assert len(Ether(long_ext)[IPv6ExtHdrDestOpt]) - len(Ether(long_ext)[TCP]) == 272
        assert gw.run(long_ext) == ("pass", long_ext)
        after = gw.counters()
        moved = counter_moves(before, after)
        assert moved == {"rx": 4, "conn_new": 1, "conn_hit": 1, "conn_reply": 1,
                         "fwd_redirect": 3, "pass_ext_headers": 1}, moved

        # A frame for no VIP and no connection: the kernel's.
        stray = from_backend6(CLIENT6, 40001)
        assert gw.run(stray, port=1) == ("pass", stray)
        assert gw.counters()["pass_not_vip"] == after["pass_not_vip"] + 1
    finally:
        stop(gw)


def test_ipv6_snat_icmpv6_and_family_rule(netns: str, tmp_path: Path) -> None:
    gw = start(netns, tmp_path, "--conn-table-size", "64")
    try:
        push_tables(gw.client, None, nat6_tables(snat=True))
        query = bytes(Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01")
                      / IPv6(src=CLIENT6, dst=str(VIP6)) / UDP(sport=5353, dport=53) / b"q")
        action, out = gw.run(query)
        assert action == "redirect"
        pkt = assert_checksums6(out)
        assert pkt[IPv6].src == str(SNAT6) and 1024 <= pkt[UDP].sport <= 65535
        assert (pkt[IPv6].dst, pkt[UDP].dport) == (backend6(3), 53)
        sport = pkt[UDP].sport
        assert gw.conns()["snat_ports_in_use"] == 1

        # Packet too big about that datagram: for the client, from the VIP.
        icmp = bytes(Ether(src="02:cc:00:00:00:01", dst=gw.port_macs[1])
                     / IPv6(src="fd00::1", dst=str(SNAT6))
                     / ICMPv6PacketTooBig(mtu=1280) / bytes(pkt[IPv6]))
        action, out = gw.run(icmp, port=1)
        assert action == "redirect"
        err = assert_checksums6(out)
        assert (err.dst, err.src) == (CLIENT_MAC, gw.port_macs[0])
        assert (err[IPv6].src, err[IPv6].dst) == (str(VIP6), CLIENT6)
        assert (err[IPerror6].src, err[IPerror6].dst) == (CLIENT6, str(VIP6))
        assert (err[UDPerror].sport, err[UDPerror].dport) == (5353, 53)

        answer = bytes(Ether(src=BACKEND_MACS[3], dst=gw.port_macs[1])
                       / IPv6(src=backend6(3), dst=str(SNAT6)) / UDP(sport=53, dport=sport)
                       / b"a")
        action, out = gw.run(answer, port=1)
        assert action == "redirect"
        pkt = assert_checksums6(out)
        assert conn6_key(pkt) == (str(VIP6), CLIENT6, 53, 5353)
        counters = gw.counters()
        assert counters["nat_icmp"] == 1 and counters["conn_reply"] == 1
        assert gw.conns()["by_state"]["udp_replied"] == 1

        # An ICMPv6 error about nothing known, and an echo request: the
        # kernel's.
        stray = bytes(Ether() / IPv6(src="fd00::1", dst=CLIENT6) / ICMPv6PacketTooBig()
                      / IPerror6(src=CLIENT6, dst="fd00::99") / UDPerror(sport=1, dport=2))
        assert gw.run(stray, port=1)[0] == "pass"
        assert gw.counters()["pass_not_vip"] == counters["pass_not_vip"] + 1

        # The ring on the IPv4 backend: no NAT64, drop_no_backend.
        t = nat6_tables(snat=True)
        t.rings = {0: np.full(RING_SIZE, 4, dtype=np.uint32),
                   1: np.full(RING_SIZE, 4, dtype=np.uint32)}
        push_tables(gw.client, nat6_tables(snat=True), t)
        assert gw.run(from_client6(41000))[0] == "drop"
        assert gw.counters()["drop_no_backend"] == counters["drop_no_backend"] + 1
    finally:
        stop(gw)


def test_ipv6_sweeper_and_both_tables(netns: str, tmp_path: Path) -> None:
    """The sweeper expires IPv6 connections as IPv4 ones; "conns" sums both
    tables."""
    gw = start(netns, tmp_path, "--conn-table-size", "64")
    try:
        short = NatConfig(timeouts_s=(1, *CONN_TIMEOUTS_DEFAULT[1:]))  # syn_sent: 1 s
        t = nat6_tables(nat=short)
        v4 = nat_tables(nat=short)
        t.vips[2] = replace(v4.vips[0], vip_id=2)
        t.backends[5] = replace(v4.backends[3], backend_id=5)
        t.rings[2] = np.full(RING_SIZE, 5, dtype=np.uint32)
        push_tables(gw.client, None, t)
        assert gw.run(from_client6(42000))[0] == "redirect"  # SYN_SENT: 1 s
        assert gw.run(from_client6(42001, "A"))[0] == "redirect"  # ESTABLISHED
        assert gw.run(from_client(42002, "A"))[0] == "redirect"  # IPv4, ESTABLISHED
        conns = gw.conns()
        assert conns["entries"] == 6 and conns["by_state"]["established"] == 2
        deadline = time.monotonic() + 10
        while len(entries6(gw)) > 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {k[2] for k in entries6(gw)} == {42001, 8080}
        conns = gw.conns()
        assert conns["entries"] == 4 and conns["expired"] == 1
        assert gw.run(from_backend6(CLIENT6, 42000), port=1)[0] == "pass"
    finally:
        stop(gw)


def test_ipv6_connections_survive_a_daemon_restart(netns: str, tmp_path: Path) -> None:
    """conn6_map is pinned and adopted like conn_map, and the restarted
    daemon's lb_xdp reaches its own IPv6 NAT program (nat6_prog refilled)."""
    first = start(netns, tmp_path / "1", "--conn-table-size", "64")
    try:
        push_tables(first.client, None, nat6_tables())
        assert first.run(from_client6(43000))[0] == "redirect"
        entries = set(entries6(first))
    finally:
        kill_hard(first)
    second = start(netns, tmp_path / "2", "--conn-table-size", "64")
    try:
        log = (tmp_path / "2" / "hpclb-xdp.log").read_text()
        assert "adopted the pinned tables" in log, log
        assert set(entries6(second)) == entries and len(entries) == 2
        action, out = second.run(from_backend6(CLIENT6, 43000), port=1)
        assert action == "redirect"
        assert conn6_key(assert_checksums6(out)) == (str(VIP6), CLIENT6, 80, 43000)
        assert second.conns()["by_state"]["syn_recv"] == 1
    finally:
        stop(second)
