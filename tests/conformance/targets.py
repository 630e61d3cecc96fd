"""The data planes the conformance suite runs against.

Every target takes tables (pushed through the real table protocol where the
target is a real data plane) and answers ``run(frame) -> (action, frame_out)``.
The model itself (``hpclb.contract.model``) is the oracle every target is compared
with, and the model-only run of the suite checks the cases' own expectations
against it. The XDP target is the real ``lb_xdp``
program loaded and fed by the real ``hpclb-xdp`` daemon, run on each frame
with BPF_PROG_TEST_RUN. The DPDK target is the real ``hpclb-dpdk`` on
net_af_xdp ports over veth: each frame is written into the ingress veth and
read back where it comes out (the ingress veth, the egress veth, or the
kernel's exception TAP), and the forwarder's own counters say which.

Both have two ports: 0 (in0, the clients' side) and 1 (out0, the backends'
side of a two-arm setup). A frame may arrive on either (``run(frame,
in_port)``): NAT mode's replies and ICMP errors come in on port 1. The XDP
target runs it as if it arrived on that port's interface (a test run whose
context names the ingress ifindex, inside the target's namespace); the DPDK
target writes it into that port's wire end (in1 or out1).

NAT mode (``nat``: the hello's "nat" capability) needs a connection table
(``conn_table_size``, entries) and the NAT settings (``set_nat``), pushed
with the tables. Tunnel VIPs need the hello's "tunnel" capability
(``tunnel``); NAT VIPs of IPv6 and an IPv6 SNAT pool need "nat6"
(``nat6``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import select
import socket
import struct
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from hpclb.contract.tables import NatConfig, TableSet, mac_str
from hpclb.dataplane.client import DataplaneClient
from hpclb.dataplane.dpdk import DpdkLaunch, DpdkPort, forwarder_argv, reserve_hugepages
from hpclb.dataplane.push import push_tables
from hpclb.dataplane.supervisor import DataplaneProcess, find_xdp_daemon
from hpclb.host import netns
from hpclb.lab.bpf_testrun import BpfError, PinnedXdpProgram


class FrameRefused(Exception):
    """The frame cannot even be put in front of the data plane (too short)."""


class Target(Protocol):
    name: str
    port_macs: list[str]
    min_frame: int
    answers_arp: bool
    #: The hello's "nat" capability: NAT VIPs, set_nat, the connection table.
    nat: bool
    #: The hello's conn_table_size (entries; 0 without NAT mode).
    conn_table_size: int
    #: The hello's "tunnel" capability: tunnel VIPs (mode 2).
    tunnel: bool
    #: The hello's "nat6" capability: NAT VIPs of IPv6, an IPv6 SNAT pool.
    nat6: bool
    #: The data plane's table-protocol client (for cases about a refusal).
    client: DataplaneClient

    def load(self, current: TableSet | None, desired: TableSet) -> None: ...

    def run(self, frame: bytes, in_port: int = 0) -> tuple[str, bytes]: ...

    def counters(self) -> dict[str, int]: ...

    def conns(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def _push(client: DataplaneClient, nat: bool, current: TableSet | None,
          desired: TableSet) -> None:
    """push_tables (which places set_nat among the VIP operations). A data
    plane without NAT mode takes no set_nat and holds the default settings:
    the tables are pushed to it with those."""
    if not nat:
        desired = dataclasses.replace(desired, nat=NatConfig())
        if current is not None:
            current = dataclasses.replace(current, nat=NatConfig())
    push_tables(client, current, desired)


def _hello_nat(hello: dict[str, Any]) -> tuple[bool, int]:
    return "nat" in hello.get("capabilities", ()), int(hello.get("conn_table_size", 0))


def _hello_tunnel(hello: dict[str, Any]) -> bool:
    return "tunnel" in hello.get("capabilities", ())


def _hello_nat6(hello: dict[str, Any]) -> bool:
    return "nat6" in hello.get("capabilities", ())


def _conns(client: DataplaneClient) -> dict[str, Any]:
    """The stats reply's "conns" ({} from a data plane without NAT mode)."""
    return dict(client.stats().get("conns", {}))


@functools.cache
def _xdp_daemon_takes(option: str) -> bool:
    """Whether hpclb-xdp's usage names ``option`` (a plane from before it
    does not, and must still start)."""
    usage = subprocess.run([find_xdp_daemon(), "--help"], capture_output=True, text=True,
                           check=False)
    return option in usage.stdout + usage.stderr


class XdpTarget:
    """hpclb-xdp --no-attach in a scratch namespace; frames via BPF_PROG_TEST_RUN."""

    name = "xdp"
    # The kernel refuses test runs of frames shorter than an Ethernet header.
    min_frame = 14
    answers_arp = False

    def __init__(self, workdir: Path, conn_table_size: int | None = None) -> None:
        tag = uuid.uuid4().hex[:8]
        self.netns = f"hlbc-{tag}"
        self.pin_dir = f"/sys/fs/bpf/hpclb/conf-{tag}"
        endpoint = f"ipc://{workdir}/dp.sock"
        argv = [find_xdp_daemon(), "--netns", self.netns, "--iface", "in0", "--egress",
                "out0", "--no-attach", "--pin-dir", self.pin_dir, "--socket", endpoint]
        if conn_table_size is not None and _xdp_daemon_takes("--conn-table-size"):
            argv += ["--conn-table-size", str(conn_table_size)]
        self.dataplane = DataplaneProcess(
            argv=argv,
            endpoint=endpoint,
            pidfile=workdir / "hpclb-xdp.pid",
            log_path=workdir / "hpclb-xdp.log",
        )
        self.client = self.dataplane.client
        _sh("ip", "netns", "add", self.netns)
        try:
            for a, b in (("in0", "in1"), ("out0", "out1")):
                _sh("ip", "-n", self.netns, "link", "add", a, "type", "veth", "peer", "name", b)
                _sh("ip", "-n", self.netns, "link", "set", a, "up")
                _sh("ip", "-n", self.netns, "link", "set", b, "up")
            self.dataplane.start()  # returns once the daemon answers hello
            hello = self.client.hello()
            self.port_macs = [mac_str(bytes(p["mac"])) for p in hello["ports"]]
            self.ifindexes = [int(p["ifindex"]) for p in hello["ports"]]
            self.nat, self.conn_table_size = _hello_nat(hello)
            self.tunnel = _hello_tunnel(hello)
            self.nat6 = _hello_nat6(hello)
            self.prog = PinnedXdpProgram(f"{self.pin_dir}/lb_xdp")
            self._affinity = os.sched_getaffinity(0)
        except BaseException:
            self.close()
            raise

    def set_cpu(self, cpu: int) -> None:
        """Run the next frames on ``cpu`` (as RSS would steer another queue)."""
        os.sched_setaffinity(0, {cpu})

    def load(self, current: TableSet | None, desired: TableSet) -> None:
        _push(self.client, self.nat, current, desired)

    def run(self, frame: bytes, in_port: int = 0) -> tuple[str, bytes]:
        """Port 0 runs as before (no context: the program sees no ingress
        device, which lb.bpf.c takes as port 0); another port runs with that
        port's ifindex as ctx->ingress_ifindex, inside the namespace that
        holds it."""
        try:
            if in_port == 0:
                return self.prog.run(frame)
            with netns.inside(self.netns):
                return self.prog.run(frame, ingress_ifindex=self.ifindexes[in_port])
        except BpfError as exc:
            if len(frame) < self.min_frame:
                raise FrameRefused(str(exc)) from exc
            raise

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.client.stats()["counters"].items()}

    def conns(self) -> dict[str, Any]:
        return _conns(self.client)

    def close(self) -> None:
        if hasattr(self, "prog"):
            self.prog.close()
        self.dataplane.stop()
        if hasattr(self, "_affinity"):
            os.sched_setaffinity(0, self._affinity)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
        subprocess.run(["rm", "-rf", self.pin_dir], capture_output=True, check=False)


ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
# The kernel takes a received frame's 802.1Q tag out of its bytes (VLAN
# acceleration) and reports it in struct tpacket_auxdata: a frame is
# compared as it was on the wire, the tag put back.
SOL_PACKET = 263
PACKET_AUXDATA = 8
TP_STATUS_VLAN_VALID = 1 << 4
TP_STATUS_VLAN_TPID_VALID = 1 << 6
_AUXDATA = struct.Struct("=IIIHHHH")  # status, len, snaplen, mac, net, vlan_tci, vlan_tpid
FRAME_TIMEOUT_S = 3.0
# Which port's far end a frame comes out of, by the counter that moved.
_ACTIONS = {"fwd_tx": "tx", "arp_reply": "tx", "ndp_reply": "tx", "fwd_redirect": "redirect"}
#: The counters of a frame's verdict (exactly one moves per frame; events
#: such as tunnel_encap or conn_new move beside it).
_VERDICTS = ("fwd_", "pass_", "drop_", "arp_", "ndp_")


def _with_vlan_tag(data: bytes, ancillary: list[tuple[int, int, bytes]]) -> bytes:
    """The frame as it was on the wire: the 802.1Q tag the kernel took out
    (PACKET_AUXDATA) put back after the MACs."""
    for level, kind, raw in ancillary:
        if level != SOL_PACKET or kind != PACKET_AUXDATA or len(raw) < _AUXDATA.size:
            continue
        status, _, _, _, _, tci, tpid = _AUXDATA.unpack_from(raw)
        if status & TP_STATUS_VLAN_VALID:
            if not status & TP_STATUS_VLAN_TPID_VALID:
                tpid = 0x8100
            return data[:12] + struct.pack("!HH", tpid, tci) + data[12:]
    return data


class DpdkTarget:
    """hpclb-dpdk on net_af_xdp over two veth pairs in a scratch namespace.

    in0/out0 are the forwarder's ports 0 and 1, exc0/exc1 their exception
    TAPs; in1 and out1 are the wire. A frame for port 0 goes in at in1, one
    for port 1 at out1. IPv6 is off in the namespace so that no kernel
    chatter reaches the forwarder between frames: every frame's effect on the
    counters is its own.
    """

    name = "dpdk"
    min_frame = 14  # AF_PACKET refuses to send less than an Ethernet header
    answers_arp = True

    #: The wire end of each port (frames in, forwarded frames out) and its
    #: exception TAP (frames passed to the kernel).
    WIRE = ("in1", "out1")
    EXCEPTION = ("exc0", "exc1")

    def __init__(self, workdir: Path, conn_table_size: int | None = None) -> None:
        tag = uuid.uuid4().hex[:8]
        self.netns = f"hlbd-{tag}"
        endpoint = f"ipc://{workdir}/dp.sock"
        launch = DpdkLaunch(
            ports=(DpdkPort(0, "af_xdp", iface="in0", tap="exc0"),
                   DpdkPort(1, "af_xdp", iface="out0", tap="exc1")),
            socket=endpoint, netns=self.netns, flow_table_size=65536, idle_sleep_us=20,
            socket_mem_mb=256, file_prefix=f"hpclb-conf-{tag}",
            conn_table_size=conn_table_size,
        )
        self.dataplane = DataplaneProcess(
            argv=forwarder_argv(launch), endpoint=endpoint,
            pidfile=workdir / "hpclb-dpdk.pid", log_path=workdir / "hpclb-dpdk.log",
        )
        self.client = self.dataplane.client
        self._socks: dict[str, socket.socket] = {}
        _sh("ip", "netns", "add", self.netns)
        try:
            for knob in ("all", "default"):
                _sh("ip", "netns", "exec", self.netns, "sysctl", "-qw",
                    f"net.ipv6.conf.{knob}.disable_ipv6=1")
            for a, b in (("in0", "in1"), ("out0", "out1")):
                _sh("ip", "-n", self.netns, "link", "add", a, "type", "veth", "peer", "name", b)
                _sh("ip", "-n", self.netns, "link", "set", a, "up")
                _sh("ip", "-n", self.netns, "link", "set", b, "up")
            if reserve_hugepages(launch.socket_mem_mb) < launch.socket_mem_mb:
                raise RuntimeError(f"cannot reserve {launch.socket_mem_mb} MB of hugepages")
            self.dataplane.start()
            hello = self.client.hello()
            self.port_macs = [mac_str(bytes(p["mac"])) for p in hello["ports"]]
            self.nat, self.conn_table_size = _hello_nat(hello)
            self.tunnel = _hello_tunnel(hello)
            self.nat6 = _hello_nat6(hello)
            with netns.inside(self.netns):
                for ifname in (*self.WIRE, *self.EXCEPTION):
                    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
                    s.bind((ifname, 0))
                    s.setsockopt(SOL_PACKET, PACKET_AUXDATA, 1)
                    s.setblocking(False)
                    self._socks[ifname] = s
            self._last = self.counters()
        except BaseException:
            self.close()
            raise

    def load(self, current: TableSet | None, desired: TableSet) -> None:
        _push(self.client, self.nat, current, desired)

    def _drain(self) -> None:
        for s in self._socks.values():
            while select.select([s], [], [], 0)[0]:
                s.recv(65536)

    def _receive(self, ifname: str) -> bytes:
        s = self._socks[ifname]
        deadline = time.monotonic() + FRAME_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([s], [], [], left)[0]:
                break
            data, ancillary, _, addr = s.recvmsg(65536, socket.CMSG_SPACE(_AUXDATA.size))
            if addr[2] != PACKET_OUTGOING:
                return _with_vlan_tag(data, ancillary)
        raise AssertionError(f"{self.name}: counted a frame out of {ifname}, none arrived")

    def run(self, frame: bytes, in_port: int = 0) -> tuple[str, bytes]:
        if len(frame) < self.min_frame:
            raise FrameRefused(f"{len(frame)}-byte frame: shorter than an Ethernet header")
        self._drain()
        before = self._last
        self._socks[self.WIRE[in_port]].send(frame)
        deadline = time.monotonic() + FRAME_TIMEOUT_S
        while True:
            # rx is counted before the verdict: wait for both.
            now = self.counters()
            moved = [k for k in now if now[k] != before.get(k, 0)
                     and k.startswith(_VERDICTS)]
            if moved:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: the frame never reached the forwarder")
            time.sleep(0.001)
        self._last = now
        assert now["rx"] - before["rx"] == 1 and len(moved) == 1, (before, now)
        reason = moved[0]
        if reason.startswith("drop_"):
            return "drop", frame
        if reason.startswith("pass_"):
            return "pass", self._receive(self.EXCEPTION[in_port])
        action = _ACTIONS[reason]
        # tx: back out of the port it came in on; redirect: the other port.
        egress = in_port if action == "tx" else 1 - in_port
        return action, self._receive(self.WIRE[egress])

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.client.stats()["counters"].items()}

    def conns(self) -> dict[str, Any]:
        return _conns(self.client)

    def close(self) -> None:
        for s in self._socks.values():
            s.close()
        self.dataplane.stop()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
