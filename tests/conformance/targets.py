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
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Protocol

from hpclb.contract.tables import TableSet, mac_str
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

    def load(self, current: TableSet | None, desired: TableSet) -> None: ...

    def run(self, frame: bytes) -> tuple[str, bytes]: ...

    def counters(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


class XdpTarget:
    """hpclb-xdp --no-attach in a scratch namespace; frames via BPF_PROG_TEST_RUN."""

    name = "xdp"
    # The kernel refuses test runs of frames shorter than an Ethernet header.
    min_frame = 14
    answers_arp = False

    def __init__(self, workdir: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        self.netns = f"hlbc-{tag}"
        self.pin_dir = f"/sys/fs/bpf/hpclb/conf-{tag}"
        endpoint = f"ipc://{workdir}/dp.sock"
        self.dataplane = DataplaneProcess(
            argv=[find_xdp_daemon(), "--netns", self.netns, "--iface", "in0", "--egress",
                  "out0", "--no-attach", "--pin-dir", self.pin_dir, "--socket", endpoint],
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
            self.prog = PinnedXdpProgram(f"{self.pin_dir}/lb_xdp")
            self._affinity = os.sched_getaffinity(0)
        except BaseException:
            self.close()
            raise

    def set_cpu(self, cpu: int) -> None:
        """Run the next frames on ``cpu`` (as RSS would steer another queue)."""
        os.sched_setaffinity(0, {cpu})

    def load(self, current: TableSet | None, desired: TableSet) -> None:
        push_tables(self.client, current, desired)

    def run(self, frame: bytes) -> tuple[str, bytes]:
        try:
            return self.prog.run(frame)
        except BpfError as exc:
            if len(frame) < self.min_frame:
                raise FrameRefused(str(exc)) from exc
            raise

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.client.stats()["counters"].items()}

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
FRAME_TIMEOUT_S = 3.0
# Which port's far end a frame comes out of, by the counter that moved.
_ACTIONS = {"fwd_tx": "tx", "arp_reply": "tx", "fwd_redirect": "redirect"}


class DpdkTarget:
    """hpclb-dpdk on net_af_xdp over two veth pairs in a scratch namespace.

    in0/out0 are the forwarder's ports 0 and 1, exc0/exc1 their exception
    TAPs; in1 and out1 are the wire. Frames go in at in1. IPv6 is off in the
    namespace so that no kernel chatter reaches the forwarder between frames:
    every frame's effect on the counters is its own.
    """

    name = "dpdk"
    min_frame = 14  # AF_PACKET refuses to send less than an Ethernet header
    answers_arp = True

    def __init__(self, workdir: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        self.netns = f"hlbd-{tag}"
        endpoint = f"ipc://{workdir}/dp.sock"
        launch = DpdkLaunch(
            ports=(DpdkPort(0, "af_xdp", iface="in0", tap="exc0"),
                   DpdkPort(1, "af_xdp", iface="out0", tap="exc1")),
            socket=endpoint, netns=self.netns, flow_table_size=65536, idle_sleep_us=20,
            socket_mem_mb=256, file_prefix=f"hpclb-conf-{tag}",
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
            with netns.inside(self.netns):
                for ifname in ("in1", "out1", "exc0"):
                    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
                    s.bind((ifname, 0))
                    s.setblocking(False)
                    self._socks[ifname] = s
            self._last = self.counters()
        except BaseException:
            self.close()
            raise

    def load(self, current: TableSet | None, desired: TableSet) -> None:
        push_tables(self.client, current, desired)

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
            data, addr = s.recvfrom(65536)
            if addr[2] != PACKET_OUTGOING:
                return data
        raise AssertionError(f"{self.name}: counted a frame out of {ifname}, none arrived")

    def run(self, frame: bytes) -> tuple[str, bytes]:
        if len(frame) < self.min_frame:
            raise FrameRefused(f"{len(frame)}-byte frame: shorter than an Ethernet header")
        self._drain()
        before = self._last
        self._socks["in1"].send(frame)
        deadline = time.monotonic() + FRAME_TIMEOUT_S
        while True:
            # rx is counted before the verdict: wait for both.
            now = self.counters()
            moved = [k for k in now if now[k] != before.get(k, 0)
                     and k.startswith(("fwd_", "pass_", "drop_", "arp_"))]
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
            return "pass", self._receive("exc0")
        action = _ACTIONS[reason]
        return action, self._receive("in1" if action == "tx" else "out1")

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.client.stats()["counters"].items()}

    def close(self) -> None:
        for s in self._socks.values():
            s.close()
        self.dataplane.stop()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
