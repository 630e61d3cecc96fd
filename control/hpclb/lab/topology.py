"""The network-namespace lab: client, appliance and backends on one bridge.

Topology (``p`` is the prefix, default ``hlb``)::

    {p}-cli  eth0 198.18.0.2/24 ─┐                   route 198.18.1.0/24 via 198.18.0.3
    {p}-lb   eth0 198.18.0.3/24 ─┤  {p}-br: br0      VIPs on lo (the appliance)
    {p}-b1   eth0 198.18.0.11/24 ┤  ports v-cli,     VIPs on lo, arp_ignore=1,
    ...                          │  v-lb, v-b1 ...   arp_announce=2, rp_filter off (DSR)
    {p}-bN   eth0 198.18.0.1N/24 ┘

Dual stack (``ipv6=True``): every ``eth0`` also gets an IPv6 ULA address (nodad, no
DAD wait and no autoconfiguration), ``fd48:4c00::2`` for the client, ``::3`` for the
appliance, ``fd48:4c00::(10+i)`` for backend i (``/64``); IPv6 VIPs lie in
``fd48:4c01::/64`` (default ``fd48:4c01::10``, added when ``vips`` names none), are held
on ``lo`` by the appliance and the backends as the IPv4 ones are, and the client routes
that prefix via the appliance's IPv6 address, resolved by NDP like any neighbour (in
DPDK mode the exception path moves the appliance's IPv6 address to the forwarder's
TAP, whose kernel answers the client's solicitation). Backends answer from the
VIP (DSR); an IPv6 address on ``lo`` is never announced by NDP on ``eth0`` (Linux
answers a solicitation only for an address of the interface it came in on), which is
what ``arp_ignore`` does for IPv4. Bridge multicast snooping is off, so that NDP's
solicited-node multicast is flooded like ARP broadcasts.

Every non-bridge namespace has ``eth0``, a veth whose peer (``v-<role>``) sits in the
bridge namespace, enslaved to ``br0``. All lab traffic stays inside these namespaces and
inside 198.18.0.0/15, the benchmarking range. The veths are listed by ``ports()``: the
two-network variant (the appliance as a NAT gateway between a client and a cluster
network, ``hpclb.lab.gateway.GatewayLab``) adds a second bridge and a second appliance
interface by returning more of them, and shares everything else.

How XDP_TX from the appliance reaches the backends (measured here, Linux 6.18; the
test is ``tests/lab/test_topology.py::test_xdp_tx_reaches_backend``): a frame that an
XDP program on the appliance's ``eth0`` bounces with XDP_TX is put on the ptr_ring of
the veth *peer* (``v-lb`` in ``{p}-br``), which only exists while that peer runs NAPI.

* Neither GRO nor XDP on ``v-lb``: no ring, the frames are dropped (TX dropped on the
  appliance's eth0).
* GRO on ``v-lb`` (``ethtool -K v-lb gro on``): NAPI exists, the frames are queued
  without error, but nothing schedules that NAPI: veth_xdp_flush() only kicks the
  peer's NAPI when the peer has an XDP program. The frames sit in the ring until an
  ordinary skb crosses the pair (a ping from the appliance flushed 20 stuck datagrams
  at once). GRO alone is therefore NOT enough: traffic stalls.
* An XDP_PASS program on ``v-lb`` (``attach_xdp_pass``, or ``peer_xdp_pass=`` at
  construction): frames are delivered at once. This is the one to use.

The lab still turns GRO on for ``v-lb`` by default (``peer_gro``): harmless, and it keeps
the ring in place across an XDP_PASS detach/attach. The testbed's known trap that GRO
alone suffices does not hold on this kernel.

TX checksum offload is off on every sender's ``eth0``: a veth hands partial checksums
up the stack, and a frame that XDP forwarded leaves with the partial checksum still in
it, which the backend then drops as corrupt.

Load per backend (optional): ``create_cgroup(name)`` makes a cgroup v1 of that name in
the cpu, cpuacct and memory hierarchies (``/hpclb-lab-{p}-{name}``, the same path in
each, which is what ``hpclb-agent --cgroup`` takes), with an optional CPU quota and
memory limit; ``start_backend(..., cgroup=)``, ``start_in_cgroup`` and ``start_agent``
put a backend's server, a busy loop and the node agent where a job container would
have them. The lab's cgroups go with the lab: their processes are killed (those in
the lab's namespaces) or moved back to the lab owner's cgroups, then the directories
are removed, on ``down()`` and by ``cleanup_stale(prefix)``.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from pyroute2 import NetNS, netns

import hpclb
from hpclb.agent.cgroup import parse_mountinfo
from hpclb.dataplane.supervisor import stop_child
from hpclb.host import install

LAN_PREFIXLEN = 24
CLIENT_IP = "198.18.0.2"
LB_IP = "198.18.0.3"
VIP_NET = "198.18.1.0/24"
DEFAULT_VIPS: tuple[str, ...] = ("198.18.1.10",)
# Dual stack (ipv6=True): ULA addresses beside the IPv4 ones.
LAN6_PREFIXLEN = 64
LAN6_NET = "fd48:4c00::/64"
CLIENT_IP6 = "fd48:4c00::2"
LB_IP6 = "fd48:4c00::3"
VIP6_NET = "fd48:4c01::/64"
DEFAULT_VIP6 = "fd48:4c01::10"
DEFAULT_PORT = 8080
BRIDGE = "br0"
ETH = "eth0"
MAX_BACKENDS = 200  # backend i is 198.18.0.(10+i): keep it inside the /24
IFNAMSIZ = 15
IFA_F_NODAD = 0x02  # <linux/if_addr.h>: no duplicate address detection
NUD_PERMANENT = 0x80  # <linux/neighbour.h>
# Locally administered, fixed MACs make captures and XDP tests predictable; two labs
# never share a bridge, so they can reuse them.
MAC_FMT = "02:48:4c:00:00:{:02x}"


_ROLE_RE = r"(br|cli|lb|rt|b[0-9]+)"  # rt: the tunnel lab's router
# Lab cgroups (v1): the controllers a backend's load is measured with, and the name
# of each lab's cgroups, unique per lab prefix (which has no '-').
CGROUP_CONTROLLERS: tuple[str, ...] = ("cpu", "cpuacct", "memory")
CGROUP_PERIOD_US = 100_000
# Source ports: tests and benchmarks pick fixed ones below 50000 (UDP flows at
# 20000-29999, TCP connections at 41000-43999, trafgen from 1024); the client
# namespace's own ephemeral ports stay above.
EPHEMERAL_PORTS = (50000, 60999)
_CGROUP_NAME_RE = r"[a-z0-9][a-z0-9_]{0,30}"
# Where the hpclb package is imported from, so the lab nodes' interpreters
# (python -m hpclb.lab.node) find the same code as this one.
_PYTHONPATH = str(Path(hpclb.__file__).resolve().parent.parent)


class LabError(RuntimeError):
    """The lab could not be built or a lab operation failed."""


@dataclass(frozen=True)
class Port:
    """One veth of the lab: ``ifname`` in ``role``'s namespace, its ``peer`` in the
    bridge namespace enslaved to ``bridge``."""

    role: str
    ifname: str
    peer: str
    bridge: str
    address: str
    prefixlen: int
    mac: str
    address6: str | None = None  # dual stack: the IPv6 address (LAN6_PREFIXLEN unless told)
    prefixlen6: int = LAN6_PREFIXLEN
    mtu: int | None = None  # both ends of the veth; None: the kernel's 1500


def default_pass_obj() -> Path:
    """The data plane's build of the XDP_PASS program (``pass.bpf.o``, found
    through install.py); pass it as ``peer_xdp_pass=`` or to ``attach_xdp_pass()``."""
    return install.find("pass.bpf.o")


def backend_ip(i: int) -> str:
    """Address of backend ``i`` (1-based) on the lab LAN."""
    return f"198.18.0.{10 + i}"


def backend_ip6(i: int) -> str:
    """IPv6 address of backend ``i`` (1-based) on the dual-stack lab LAN."""
    return f"fd48:4c00::{10 + i}"


def _last_octet(ip: str) -> int:
    return int(ip.rsplit(".", 1)[1])


class Lab:
    """Builds the lab on ``up()``/``__enter__`` and removes every trace on ``down()``.

    Teardown also runs on an exception inside the ``with`` block, on SIGINT/SIGTERM
    (when entered from the main thread) and at interpreter exit. A crashed run's leftovers
    are removed with ``Lab.cleanup_stale(prefix)`` (or ``replace_stale=True``).
    """

    def __init__(
        self,
        prefix: str = "hlb",
        backends: int = 3,
        vips: Sequence[str] = DEFAULT_VIPS,
        *,
        peer_gro: bool = True,
        peer_xdp_pass: str | os.PathLike[str] | None = None,
        ipv6: bool = False,
        replace_stale: bool = False,
    ) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", prefix):
            raise ValueError("prefix: 1-10 lowercase letters/digits, starting with a letter")
        if not 1 <= backends <= MAX_BACKENDS:
            raise ValueError(f"backends must be in 1..{MAX_BACKENDS}")
        net, net6 = ipaddress.ip_network(VIP_NET), ipaddress.ip_network(VIP6_NET)
        # The client routes only VIP_NET (and VIP6_NET) via the appliance; a VIP
        # elsewhere is unreachable.
        addrs = [ipaddress.ip_address(v) for v in vips]
        if not addrs or any(a not in (net6 if a.version == 6 else net) for a in addrs):
            raise ValueError(f"vips must be non-empty and inside {VIP_NET} or {VIP6_NET}")
        if any(a.version == 6 for a in addrs) and not ipv6:
            raise ValueError("IPv6 VIPs need a dual-stack lab (ipv6=True)")
        if ipv6 and not any(a.version == 6 for a in addrs):
            vips = (*vips, DEFAULT_VIP6)
        self.prefix = prefix
        self.backends = backends
        self.vips = tuple(vips)
        self.peer_gro = peer_gro
        self.peer_xdp_pass = peer_xdp_pass
        self.ipv6 = ipv6
        self.replace_stale = replace_stale
        self._procs: list[tuple[str, subprocess.Popen[str]]] = []
        self._servers: dict[tuple[int, int], subprocess.Popen[str]] = {}
        self._cgroups: dict[str, list[Path]] = {}  # name -> its directory per controller
        self._lock = threading.RLock()
        self._is_up = False
        self._prev_handlers: dict[int, Any] = {}
        self._owner_pid = os.getpid()
        # The signal that tore the lab down (SIGINT, SIGTERM), None while none did: a
        # step that ran into that teardown failed because of it, not on its own.
        self.interrupted_by: int | None = None

    # ------------------------------------------------------------------ naming

    def ns(self, role: str) -> str:
        """Full namespace name for a role (``br``, ``cli``, ``lb``, ``b1``...) or a full name."""
        return role if role.startswith(self.prefix + "-") else f"{self.prefix}-{role}"

    @property
    def bridge_ns(self) -> str:
        return self.ns("br")

    @property
    def lb_ns(self) -> str:
        return self.ns("lb")

    def backend_ns(self, i: int) -> str:
        self._check_backend(i)
        return self.ns(f"b{i}")

    @staticmethod
    def peer(role: str) -> str:
        """Name of the bridge-side veth of a role's ``eth0`` (lives in the bridge namespace)."""
        name = f"v-{role.rsplit('-', 1)[-1]}"
        assert len(name) <= IFNAMSIZ
        return name

    def roles(self) -> list[str]:
        """Roles that have an ``eth0`` on the bridge, client first."""
        return ["cli", "lb", *(f"b{i}" for i in range(1, self.backends + 1))]

    def namespaces(self) -> list[str]:
        return [self.bridge_ns, *(self.ns(r) for r in self.roles())]

    def backend_ip(self, i: int) -> str:
        self._check_backend(i)
        return backend_ip(i)

    @property
    def vips4(self) -> tuple[str, ...]:
        return tuple(v for v in self.vips if ":" not in v)

    @property
    def vips6(self) -> tuple[str, ...]:
        return tuple(v for v in self.vips if ":" in v)

    def ip6_of(self, role: str) -> str:
        """``role``'s IPv6 address on the lab LAN (dual-stack labs only)."""
        if not self.ipv6:
            raise LabError("this lab has no IPv6 addresses (ipv6=False)")
        role = role.rsplit("-", 1)[-1]
        if role == "cli":
            return CLIENT_IP6
        if role == "lb":
            return LB_IP6
        return backend_ip6(int(role[1:]))

    def address_of(self, role: str, family: int = 4) -> str:
        """``role``'s address of IP version ``family`` (4 or 6)."""
        return self.ip6_of(role) if family == 6 else self.ip_of(role)

    def backend_mac(self, role: str) -> str:
        """The MAC the appliance sends ``role``'s frames to: its own on this LAN (a
        lab with distant backends returns the next hop's)."""
        return self.mac(role)

    def ip_of(self, role: str) -> str:
        role = role.rsplit("-", 1)[-1]
        if role == "cli":
            return CLIENT_IP
        if role == "lb":
            return LB_IP
        return backend_ip(int(role[1:]))

    def _check_backend(self, i: int) -> None:
        if not 1 <= i <= self.backends:
            raise ValueError(f"backend index {i} not in 1..{self.backends}")

    def cgroup_path(self, name: str) -> str:
        """The cgroup path (as ``/proc/PID/cgroup`` shows it) of this lab's cgroup
        ``name``; the same in every controller's hierarchy."""
        if not re.fullmatch(_CGROUP_NAME_RE, name):
            raise ValueError(f"cgroup name {name!r}: lowercase letters, digits, '_'")
        return f"/{_cgroup_stem(self.prefix)}{name}"

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Lab:
        self._install_signal_handlers()
        try:
            return self.up()
        except BaseException:
            self._restore_signal_handlers()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.down()
        finally:
            self._restore_signal_handlers()

    def up(self) -> Lab:
        """Build the topology. On any failure, remove what was built and re-raise."""
        with self._lock:
            if self._is_up:
                return self
            existing = self.existing_namespaces(self.prefix)
            if existing:
                if not self.replace_stale:
                    raise LabError(f"namespaces already exist: {existing}; another run "
                                   f"uses prefix {self.prefix!r}, or call Lab.cleanup_stale")
                self.cleanup_stale(self.prefix)
            self._is_up = True  # from here on, down() has something to remove
            atexit.register(self.down)
            try:
                self._build()
            except BaseException:
                self.down()
                raise
            return self

    def down(self) -> None:
        """Stop every lab process and remove every lab namespace. Idempotent."""
        with self._lock:
            if not self._is_up:
                return
            self._is_up = False
            atexit.unregister(self.down)
            self._stop_procs()
            self._servers.clear()
            self.cleanup_stale(self.prefix)
            self._cgroups.clear()

    @staticmethod
    def existing_namespaces(prefix: str) -> list[str]:
        """Namespaces that a lab with this prefix would own (and no others)."""
        pattern = re.compile(re.escape(prefix) + "-" + _ROLE_RE)
        return sorted(n for n in netns.listnetns() if pattern.fullmatch(n))

    @classmethod
    def cleanup_stale(cls, prefix: str = "hlb") -> list[str]:
        """Remove the namespaces of a lab with ``prefix`` (e.g. after a crash). Returns them.

        Processes still inside them are killed first: a process pins its namespace, and
        with it the veths, after the name is gone.
        """
        names = cls.existing_namespaces(prefix)
        for name in names:
            _kill_ns_pids(name)
        # After the namespaces' processes are gone: what is left in a lab cgroup
        # (a program started outside the lab namespaces) is moved out, not killed.
        _remove_cgroups(_cgroup_stem(prefix))
        # Deleting the bridge-side veths first removes every pair deterministically even
        # if some other namespace stays pinned by a process we could not kill.
        br = f"{prefix}-br"
        if br in names:
            with contextlib.suppress(Exception), NetNS(br) as ipr:
                for link in ipr.get_links():
                    if link.get("ifname", "").startswith("v-"):
                        ipr.link("del", index=link["index"])
        for name in names:
            with contextlib.suppress(OSError):
                netns.remove(name)
        return names

    # ------------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._prev_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._prev_handlers.items():
            signal.signal(sig, handler)
        self._prev_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Tear down first, then let the previous disposition act (KeyboardInterrupt for
        # SIGINT, death for SIGTERM): a killed test run must not leave namespaces behind.
        # Only in the process that built the lab: pyroute2's NetNS forks a helper that
        # inherits this handler and is stopped with SIGTERM; in that child a teardown
        # killed a backend server on every NetNS call.
        if os.getpid() != self._owner_pid:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.interrupted_by = signum
        self.down()
        self._restore_signal_handlers()
        signal.raise_signal(signum)

    # ------------------------------------------------------------------ building

    def _build(self) -> None:
        for name in self.namespaces():
            netns.create(name)
        with NetNS(self.bridge_ns) as br:
            self._build_bridge(br)
        for role in self.roles():
            self._configure_host(role)
        self._configure_bridge_ns()
        self._wait_carrier()

    def ports(self) -> list[Port]:
        """Every veth of the lab: ``eth0`` of each role on ``br0`` (one LAN).

        A lab with more segments (``hpclb.lab.gateway``) returns more ports; the
        building, the carrier wait and the teardown go by this list.
        """
        return [Port(role, ETH, self.peer(role), BRIDGE, self.ip_of(role), LAN_PREFIXLEN,
                     MAC_FMT.format(_last_octet(self.ip_of(role))),
                     self.ip6_of(role) if self.ipv6 else None)
                for role in self.roles()]

    def appliance_peers(self) -> list[str]:
        """The bridge-side veths of the appliance's interfaces (GRO, XDP_PASS)."""
        return [port.peer for port in self.ports() if port.role == "lb"]

    def _build_bridge(self, br: NetNS) -> None:
        br.link("set", index=br.link_lookup(ifname="lo")[0], state="up")
        ports = self.ports()
        bridges = list(dict.fromkeys(port.bridge for port in ports))
        for bridge in bridges:
            # STP off (the default) puts ports into forwarding at once: no 15 s wait.
            # Multicast snooping off: NDP's solicited-node multicast floods like ARP.
            br.link("add", ifname=bridge, kind="bridge", br_stp_state=0, br_forward_delay=0,
                    br_mcast_snooping=0)
        for port in ports:
            bridge_idx = br.link_lookup(ifname=port.bridge)[0]
            mtu = {"mtu": port.mtu} if port.mtu else {}
            br.link("add", ifname=port.peer, kind="veth", **mtu,
                    peer={"ifname": port.ifname, "net_ns_fd": self.ns(port.role),
                          "address": port.mac, **mtu})
            idx = br.link_lookup(ifname=port.peer)[0]
            br.link("set", index=idx, master=bridge_idx, state="up")
        for bridge in bridges:
            br.link("set", index=br.link_lookup(ifname=bridge)[0], state="up")

    def _configure_host(self, role: str) -> None:
        ns = self.ns(role)
        self.sysctl(ns, self._host_sysctls(role))
        ports = [port for port in self.ports() if port.role == role]
        with NetNS(ns) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            for port in ports:
                idx = ipr.link_lookup(ifname=port.ifname)[0]
                ipr.link("set", index=idx, state="up")
                ipr.addr("add", index=idx, address=port.address, prefixlen=port.prefixlen)
                if port.address6 is not None:
                    ipr.addr("add", index=idx, address=port.address6,
                             prefixlen=port.prefixlen6, flags=IFA_F_NODAD)
            self._configure_routes(role, ipr)
        for port in ports:
            # Partial checksums would survive XDP forwarding and be dropped by the receiver.
            self.ethtool(ns, port.ifname, tx="off")

    def _configure_routes(self, role: str, ipr: NetNS) -> None:
        """Routes and loopback addresses of ``role``, once its interfaces are up."""
        lo = ipr.link_lookup(ifname="lo")[0]
        if role == "cli":
            # VIP traffic goes to the appliance's MAC, as on a real routed network.
            net, plen = VIP_NET.split("/")
            ipr.route("add", dst=net, dst_len=int(plen), gateway=LB_IP)
            if self.ipv6:
                self._client_route6(ipr)
        else:
            # Appliance: accepts what XDP passes. Backends: answer from the VIP (DSR).
            self._vips_on_lo(ipr, lo)

    def _vips_on_lo(self, ipr: NetNS, lo: int) -> None:
        for vip in self.vips:
            v6 = ":" in vip
            ipr.addr("add", index=lo, address=vip, prefixlen=128 if v6 else 32,
                     **({"flags": IFA_F_NODAD} if v6 else {}))

    def _client_route6(self, ipr: NetNS) -> None:
        """The client's route to the IPv6 VIPs via the appliance (resolved by NDP)."""
        net6, plen6 = VIP6_NET.split("/")
        ipr.route("add", dst=net6, dst_len=int(plen6), gateway=LB_IP6)

    def _host_sysctls(self, role: str) -> dict[str, str]:
        values: dict[str, str] = {}
        if not self.ipv6:
            # No IPv6 autoconf chatter (RS, MLD, DAD) on the lab LAN: XDP tests count
            # packets and captures stay readable.
            values |= {"net.ipv6.conf.all.disable_ipv6": "1",
                       "net.ipv6.conf.default.disable_ipv6": "1"}
        else:
            # Static addresses only: no router solicitations, no autoconf, no DAD.
            for dev in ("all", "default", *{p.ifname for p in self.ports() if p.role == role}):
                values |= {f"net.ipv6.conf.{dev}.accept_ra": "0",
                           f"net.ipv6.conf.{dev}.autoconf": "0",
                           f"net.ipv6.conf.{dev}.accept_dad": "0"}
        if role == "cli":
            # The lab's clients bind fixed source ports (below EPHEMERAL_PORTS) so that
            # flows are reproducible; the kernel's own ephemeral ports (an earlier
            # connection still in TIME_WAIT) must never take one of them (EADDRINUSE).
            values["net.ipv4.ip_local_port_range"] = f"{EPHEMERAL_PORTS[0]} {EPHEMERAL_PORTS[1]}"
        if role.startswith("b") or role == "lb":
            # Replies from the VIP and packets to the VIP arrive on an interface that
            # does not hold it: reverse-path filtering must not judge them.
            for dev in ("all", "default", "lo", ETH):
                values[f"net.ipv4.conf.{dev}.rp_filter"] = "0"
        if role.startswith("b"):
            # DSR: never answer ARP for the VIP on eth0 (only the appliance may draw VIP
            # traffic), and never use the VIP as the source of our own ARP requests.
            values |= {"net.ipv4.conf.all.arp_ignore": "1",
                       "net.ipv4.conf.all.arp_announce": "2"}
        return values

    def _configure_bridge_ns(self) -> None:
        ns = self.bridge_ns
        values = {f"net.bridge.bridge-nf-call-{t}": "0"
                  for t in ("iptables", "ip6tables", "arptables")}
        # The bridge forwards IPv6 at L2 without an IPv6 stack of its own; with one,
        # its ports would send router solicitations and MLD reports into the lab.
        values |= {"net.ipv6.conf.all.disable_ipv6": "1",
                   "net.ipv6.conf.default.disable_ipv6": "1"}
        self.sysctl(ns, values, ignore_missing=True)  # bridge-nf-* only with br_netfilter
        for peer in self.appliance_peers():
            if self.peer_gro:
                self.ethtool(self.bridge_ns, peer, gro="on")
            if self.peer_xdp_pass is not None:
                self.attach_xdp_pass(peer, self.peer_xdp_pass)

    def _wait_carrier(self, timeout: float = 5.0) -> None:
        """Wait until every lab interface reports carrier (operstate UP)."""
        deadline = time.monotonic() + timeout
        pending = {(port.role, port.ifname) for port in self.ports()}
        while pending:
            pending = {(r, i) for r, i in pending if self.operstate(self.ns(r), i) != "UP"}
            if not pending:
                return
            if time.monotonic() > deadline:
                raise LabError(f"no carrier on {sorted(pending)}")
            time.sleep(0.02)

    # ------------------------------------------------------------------ commands

    def exec(
        self, ns: str, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in namespace ``ns`` (role or full name) to completion; text output."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("env", self._env())
        res = subprocess.run(self._wrap(ns, argv), check=False, timeout=timeout, **kwargs)
        if check and res.returncode != 0:
            raise LabError(f"in {self.ns(ns)}: {' '.join(argv)} exited {res.returncode}: "
                           f"{(res.stderr or '').strip()}")
        return res

    def popen(self, ns: str, argv: Sequence[str], *, cgroup: str | None = None,
              keep_mounts: bool = False, **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``argv`` in namespace ``ns``; the lab stops it on teardown at the latest.

        ``cgroup``: inside this lab's cgroup of that name (``create_cgroup``).
        ``keep_mounts``: enter the network namespace only (``nsenter --net``), so the
        program sees the host's /sys, cgroup mounts included: ``ip netns exec``
        mounts a fresh sysfs over /sys, which hides /sys/fs/cgroup.
        """
        kwargs.setdefault("text", True)
        kwargs.setdefault("env", self._env())
        full = self._wrap_net(ns, argv) if keep_mounts else self._wrap(ns, argv)
        if cgroup is not None:
            # Joined before entering the namespace: cgroupfs is not visible in there.
            full = self.in_cgroup(cgroup, full)
        # ip netns exec, nsenter and the cgroup shell exec the program in place: the
        # Popen pid is the program's pid.
        proc = subprocess.Popen(full, **kwargs)
        with self._lock:
            # Forget what has exited so that a long test does not grow the list.
            self._procs = [(n, p) for n, p in self._procs if p.poll() is None]
            self._procs.append((self.ns(ns), proc))
        return proc

    def _wrap(self, ns: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(ns), *argv]

    def _wrap_net(self, ns: str, argv: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.ns(ns)}", "--", *argv]

    @staticmethod
    def _env() -> dict[str, str]:
        # The lab's Python programs must import hpclb even when it is not installed.
        path = os.environ.get("PYTHONPATH")
        return {**os.environ, "PYTHONPATH": f"{_PYTHONPATH}:{path}" if path else _PYTHONPATH}

    def sysctl(self, ns: str, values: Mapping[str, str], *, ignore_missing: bool = False) -> None:
        """Set sysctls inside a namespace (one process for all of them)."""
        if values:
            flags = ["-q", "-e"] if ignore_missing else ["-q"]
            self.exec(ns, ["sysctl", *flags, "-w", *(f"{k}={v}" for k, v in values.items())])

    def ethtool(self, ns: str, ifname: str, **features: str) -> None:
        """``ethtool -K ifname feature on|off ...`` inside a namespace."""
        args = [x for kv in features.items() for x in kv]
        self.exec(ns, ["ethtool", "-K", ifname, *args])

    def stop_process(self, proc: subprocess.Popen[str], grace: float = 3.0) -> None:
        """SIGTERM (then SIGKILL after ``grace``) a process started with ``popen``."""
        _terminate(proc, grace)

    def _stop_procs(self) -> None:
        with self._lock:
            procs, self._procs = self._procs, []
        for _, proc in procs:
            _terminate(proc)

    # ------------------------------------------------------------------ links

    def mac(self, ns: str, ifname: str = ETH) -> str:
        """MAC address of ``ifname`` in namespace ``ns`` (role or full name)."""
        return str(self._link(ns, ifname).get("address"))

    def operstate(self, ns: str, ifname: str = ETH) -> str:
        return str(self._link(ns, ifname).get("operstate"))

    def ifindex(self, ns: str, ifname: str = ETH) -> int:
        return int(self._link(ns, ifname)["index"])

    def _link(self, ns: str, ifname: str) -> Any:
        with NetNS(self.ns(ns)) as ipr:
            idx = ipr.link_lookup(ifname=ifname)
            if not idx:
                raise LabError(f"no interface {ifname} in {self.ns(ns)}")
            return ipr.get_links(idx[0])[0]

    def set_link(self, ns: str, ifname: str, up: bool) -> None:
        with NetNS(self.ns(ns)) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname=ifname)[0],
                     state="up" if up else "down")

    def set_backend_link(self, i: int, up: bool) -> None:
        """Take backend ``i``'s eth0 down or up (a node that drops off the network).

        Done inside the backend: both veth ends lose carrier, so the bridge stops
        forwarding to it as a pulled cable would. Its address survives a down/up.
        """
        self.set_link(self.backend_ns(i), ETH, up)

    def set_peer_gro(self, role: str, on: bool) -> None:
        """GRO on the bridge-side peer of ``role``'s eth0; it gives the peer NAPI, which
        is what lets XDP_TX/REDIRECT out of ``role``'s eth0 be received (module doc)."""
        self.ethtool(self.bridge_ns, self.peer(role), gro="on" if on else "off")

    def attach_xdp(self, ns: str, ifname: str, obj_path: str | os.PathLike[str],
                   sec: str = "xdp") -> None:
        """Attach section ``sec`` of a BPF object to ``ifname`` in ``ns`` (native XDP)."""
        if not Path(obj_path).is_file():
            raise LabError(f"no BPF object at {obj_path}")
        self.exec(ns, ["ip", "link", "set", "dev", ifname, "xdpdrv", "obj", str(obj_path),
                       "sec", sec])

    def attach_xdp_pass(self, iface_in_bridge_ns: str,
                        obj_path: str | os.PathLike[str], sec: str = "xdp") -> None:
        """Attach an XDP_PASS program to a bridge-side veth (``peer("lb")`` = ``v-lb``).

        What makes XDP_TX from the appliance's eth0 reach the bridge (module doc);
        ``default_pass_obj()`` is the data plane's build of it.
        """
        if not Path(obj_path).is_file():
            raise LabError(f"no BPF object at {obj_path}")
        # ip -n NS link set dev X xdpdrv obj OBJ sec xdp; xdpdrv (not xdp) so that a
        # silent fall back to generic XDP, which would not give the peer NAPI, fails loudly.
        argv = ["ip", "-n", self.bridge_ns, "link", "set", "dev", iface_in_bridge_ns,
                "xdpdrv", "obj", str(obj_path), "sec", sec]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if res.returncode != 0:
            raise LabError(f"{' '.join(argv)} exited {res.returncode}: {res.stderr.strip()}")

    def detach_xdp(self, ns: str, ifname: str) -> None:
        self.exec(ns, ["ip", "link", "set", "dev", ifname, "xdp", "off"])

    # ------------------------------------------------------------------ cgroups

    def create_cgroup(self, name: str, *, cpu_quota: float | None = None,
                      memory_limit: int | None = None) -> str:
        """Create this lab's cgroup ``name`` in the v1 cpu, cpuacct and memory
        hierarchies; returns its path for ``hpclb-agent --cgroup``.

        ``cpu_quota``: CPUs it may use (CFS quota over a 100 ms period), so that a
        busy loop inside measures a load of 1 whatever the host's CPU count;
        ``memory_limit``: bytes. Removed with the lab (``down``).
        """
        path = self.cgroup_path(name)
        if name in self._cgroups:
            raise LabError(f"cgroup {name} already exists")
        dirs = _cgroup_dirs(path.lstrip("/"))
        created: list[Path] = []
        try:
            for d in dict.fromkeys(dirs):  # cpu,cpuacct may be one hierarchy
                d.mkdir()
                created.append(d)
            by_ctl = dict(zip(CGROUP_CONTROLLERS, dirs, strict=True))
            if cpu_quota is not None:
                if not cpu_quota > 0:
                    raise ValueError(f"cpu_quota must be positive, got {cpu_quota}")
                (by_ctl["cpu"] / "cpu.cfs_period_us").write_text(str(CGROUP_PERIOD_US))
                (by_ctl["cpu"] / "cpu.cfs_quota_us").write_text(
                    str(max(1000, round(cpu_quota * CGROUP_PERIOD_US))))
            if memory_limit is not None:
                (by_ctl["memory"] / "memory.limit_in_bytes").write_text(str(memory_limit))
        except BaseException:
            for d in reversed(created):
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
        self._cgroups[name] = list(dict.fromkeys(dirs))
        return path

    def cgroup_dirs(self, name: str) -> list[Path]:
        """The directories of cgroup ``name``, one per hierarchy (joined ones once)."""
        if name not in self._cgroups:
            raise LabError(f"no lab cgroup {name!r} (create_cgroup first)")
        return list(self._cgroups[name])

    def in_cgroup(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped so that it runs inside cgroup ``name`` from its first
        instruction (a shell joins the cgroup, then execs it: same pid). Wrap the
        namespace entry, not the program in it (``popen(cgroup=)`` does)."""
        files = " ".join(shlex.quote(str(d / "cgroup.procs")) for d in self.cgroup_dirs(name))
        script = f'for f in {files}; do echo $$ > "$f" || exit 125; done; exec "$@"'
        return ["sh", "-c", script, "hpclb-lab-cgroup", *argv]

    def start_in_cgroup(self, ns: str, name: str, argv: Sequence[str],
                        **kwargs: Any) -> subprocess.Popen[str]:
        """``popen`` in namespace ``ns`` and cgroup ``name``."""
        return self.popen(ns, argv, cgroup=name, **kwargs)

    def start_busy_loop(self, ns: str, cgroup: str) -> subprocess.Popen[str]:
        """A shell spinning on one CPU in cgroup ``cgroup`` (stop with stop_process)."""
        return self.start_in_cgroup(ns, cgroup, ["sh", "-c", "while :; do :; done"],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)

    # ------------------------------------------------------------------ agents

    def start_agent(
        self, ns: str, *, connect: str, server_key: str | os.PathLike[str],
        key: str | os.PathLike[str], node_id: str | None = None, cgroup: str | None = None,
        base_interval: float = 0.5, log: str | os.PathLike[str] | None = None,
        extra: Sequence[str] = (),
    ) -> subprocess.Popen[str]:
        """Start ``hpclb-agent run`` in namespace ``ns`` (a role: its node id by
        default), reporting this lab's cgroup ``cgroup`` when given (the agent itself
        stays outside it, as a node's agent runs outside its job container); its
        output goes to ``log`` (appended), or nowhere. Only the network namespace is
        entered, so that the agent sees the cgroup mounts."""
        role = self.ns(ns).rsplit("-", 1)[-1]
        argv = [sys.executable, "-m", "hpclb.agent.main", "run", "--connect", connect,
                "--node-id", node_id or role, "--server-key", str(server_key),
                "--key", str(key), "--base-interval", str(base_interval),
                *(["--cgroup", self.cgroup_path(cgroup)] if cgroup is not None else []),
                *extra]
        if log is None:
            return self.popen(ns, argv, keep_mounts=True, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(log, "a") as out:
            return self.popen(ns, argv, keep_mounts=True, stdin=subprocess.DEVNULL,
                              stdout=out, stderr=subprocess.STDOUT)

    # ------------------------------------------------------------------ backends

    def start_backend(self, i: int, port: int = DEFAULT_PORT, *, udp: bool = False,
                      ready_timeout: float = 10.0,
                      cgroup: str | None = None) -> subprocess.Popen[str]:
        """Start backend ``i``'s name server on ``port`` (TCP, plus UDP with ``udp``),
        inside this lab's cgroup ``cgroup`` when given.

        Returns once it listens. Its name is ``b<i>``, what the client counts.
        """
        self._check_backend(i)
        if (i, port) in self._servers:
            raise LabError(f"backend {i} already serves port {port}")
        argv = [sys.executable, "-m", "hpclb.lab.node", "server", "--name", f"b{i}",
                "--port", str(port), *(["--udp"] if udp else []),
                *(["--bind6", "::"] if self.ipv6 else [])]
        # stderr goes to an anonymous file, not a pipe: nobody drains a pipe after
        # startup, and a full one would freeze the server mid-test.
        with tempfile.TemporaryFile(mode="w+") as errfile:
            proc = self.popen(self.backend_ns(i), argv, cgroup=cgroup, stdout=subprocess.PIPE,
                              stderr=errfile)
            try:
                _wait_ready(proc, ready_timeout, errfile)
            except BaseException:
                _terminate(proc)
                raise
        self._servers[(i, port)] = proc
        return proc

    def start_backends(self, port: int = DEFAULT_PORT, *, udp: bool = False) -> None:
        for i in range(1, self.backends + 1):
            self.start_backend(i, port, udp=udp)

    def stop_backend(self, i: int, port: int | None = None) -> None:
        """Stop backend ``i``'s server on ``port`` (every port when None)."""
        for key in [k for k in self._servers if k[0] == i and port in (None, k[1])]:
            _terminate(self._servers.pop(key))

    # ------------------------------------------------------------------ client

    def run_client(
        self, vip: str | None = None, port: int = DEFAULT_PORT, *, connections: int = 100,
        concurrency: int = 50, udp: bool = False, timeout: float = 2.0,
        deadline: float = 60.0, sport_first: int | None = None,
    ) -> dict[str, Any]:
        """Run ``hpclb.lab.node client`` in the client namespace; returns its JSON report.

        Keys: connections, ok, failures, counts (per backend name), errors,
        distinct_source_ports, elapsed_s.
        """
        argv = [sys.executable, "-m", "hpclb.lab.node", "client", "--vip",
                vip or self.vips[0], "--port", str(port), "--connections", str(connections),
                "--concurrency", str(concurrency), "--timeout", str(timeout),
                "--deadline", str(deadline), "--json", *(["--udp"] if udp else []),
                *(["--sport-first", str(sport_first)] if sport_first is not None else [])]
        res = self.exec("cli", argv, check=False, timeout=deadline + 30)
        return _parse_report(res.stdout, res.stderr)

    def udp_flows(self, vip: str, port: int, sports: str) -> dict[str, str]:
        """One datagram from each source port of ``sports`` ("FIRST-LAST") to
        ``vip``: which backend answered each flow (``hpclb.lab.node udpflows``)."""
        res = self.exec("cli", [sys.executable, "-m", "hpclb.lab.node", "udpflows", "--vip", vip,
                                "--port", str(port), "--sports", sports, "--json"])
        report = _parse_report(res.stdout, res.stderr)
        if report["errors"]:
            raise LabError(f"udpflows {sports}: {report['errors']}")
        return dict(report["flows"])

    def start_stream(
        self, vip: str | None = None, port: int = DEFAULT_PORT, *, interval_ms: float = 100,
        duration: float = 5.0, timeout: float = 2.0,
    ) -> subprocess.Popen[str]:
        """Start ``hpclb.lab.node stream`` in the client namespace; collect it with
        ``wait_json``."""
        argv = [sys.executable, "-m", "hpclb.lab.node", "stream", "--vip", vip or self.vips[0],
                "--port", str(port), "--interval-ms", str(interval_ms), "--duration",
                str(duration), "--timeout", str(timeout), "--json"]
        return self.popen("cli", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    @staticmethod
    def wait_json(proc: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, Any]:
        """Wait for a lab program and parse the JSON report it printed."""
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _terminate(proc)
            raise
        return _parse_report(out, err)

    def ping(self, ns: str, dst: str, *, count: int = 1, timeout: float = 2.0) -> bool:
        """True when ``dst`` answers an ICMP echo from namespace ``ns``."""
        res = self.exec(ns, ["ping", "-n", "-q", "-c", str(count), "-W", str(timeout), dst],
                        check=False, timeout=count * timeout + 5)
        return res.returncode == 0


# ---------------------------------------------------------------------- helpers


def _terminate(proc: subprocess.Popen[str], grace: float = 3.0) -> None:
    stop_child(proc, timeout_s=grace)
    for stream in (proc.stdout, proc.stderr, proc.stdin):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _v1_mounts() -> dict[str, Path]:
    """{controller: mount point} of the v1 cpu, cpuacct and memory hierarchies."""
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    found: dict[str, Path] = {}
    for c in CGROUP_CONTROLLERS:
        m = next((m for m in mounts if m.version == 1 and c in m.controllers), None)
        if m is not None:
            found[c] = m.mount_point
    return found


def cgroup_controllers_missing() -> list[str]:
    """The v1 controllers lab cgroups need that this host does not mount (a test
    skips on a non-empty answer)."""
    try:
        mounts = _v1_mounts()
    except OSError:
        return list(CGROUP_CONTROLLERS)
    return [c for c in CGROUP_CONTROLLERS if c not in mounts]


def _cgroup_dirs(rel: str) -> list[Path]:
    """The directory of cgroup ``rel`` in each controller's hierarchy, in
    CGROUP_CONTROLLERS order (LabError when one is not mounted as v1)."""
    mounts = _v1_mounts()
    missing = [c for c in CGROUP_CONTROLLERS if c not in mounts]
    if missing:
        raise LabError(f"lab cgroups need the v1 {', '.join(missing)} controller(s) mounted")
    return [mounts[c] / rel for c in CGROUP_CONTROLLERS]


def _cgroup_stem(prefix: str) -> str:
    return f"hpclb-lab-{prefix}-"


def _cgroup_procs(directory: Path) -> list[int]:
    try:
        return [int(p) for p in (directory / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _own_cgroup(mount: Path, controller: str) -> Path:
    """This process's cgroup directory in a v1 hierarchy (where strays go back)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                own = mount / path.lstrip("/")
                if own.is_dir():
                    return own
    return mount


def _remove_cgroups(stem: str, timeout: float = 5.0) -> list[Path]:
    """Remove every lab cgroup named ``stem*``: processes still inside are moved
    to this process's own cgroup first (an rmdir of a cgroup with tasks fails).
    Returns the directories that could not be removed."""
    left: list[Path] = []
    try:
        mounts = _v1_mounts()
    except OSError:
        return left
    for controller, mount in mounts.items():
        for d in sorted(mount.glob(f"{stem}*")):
            if not d.is_dir():
                continue
            deadline = time.monotonic() + timeout
            while True:
                for pid in _cgroup_procs(d):
                    with contextlib.suppress(OSError):  # gone meanwhile
                        (_own_cgroup(mount, controller) / "cgroup.procs").write_text(str(pid))
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:  # joined hierarchies: already removed
                    break
                except OSError:
                    # EBUSY while a killed task is still exiting.
                    if time.monotonic() > deadline:
                        left.append(d)
                        break
                    time.sleep(0.05)
    return left


def _kill_ns_pids(name: str) -> None:
    """Kill what still runs inside a lab namespace (only lab programs run there)."""
    res = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                         timeout=10, check=False)
    pids = [int(p) for p in res.stdout.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(pids)


def _wait_gone(pids: Iterable[int], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)


def _wait_ready(proc: subprocess.Popen[str], timeout: float, errfile: IO[str]) -> None:
    """Block until a hpclb.lab.node server prints its ready line (or fail with its stderr)."""
    assert proc.stdout is not None
    done = threading.Event()
    line: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        line.append(proc.stdout.readline())
        done.set()

    # readline() has no timeout of its own; a thread keeps the wait bounded.
    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout) or line[0].strip() != "ready":
        errfile.seek(0)
        err = errfile.read(4096)
        raise LabError(f"backend server not ready after {timeout}s: {err.strip()}")


def _parse_report(out: str, err: str) -> dict[str, Any]:
    try:
        report: dict[str, Any] = json.loads(out)
    except json.JSONDecodeError as exc:
        raise LabError(f"lab program printed no JSON: {out!r} {err.strip()!r}") from exc
    return report
