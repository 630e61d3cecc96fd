"""Lockstep runner: every frame goes to the model and to the data plane under
test, and both must do the same thing to it, byte for byte."""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

from hpclb.balancing import maglev
from hpclb.contract.model import Model, Verdict
from hpclb.contract.tables import (
    CONN_STATE_NAMES,
    CONN_TABLE_DEFAULT,
    IPPROTO_TCP,
    IPPROTO_UDP,
    STAT_NAMES,
    Backend,
    BackendState,
    Encap,
    NatConfig,
    NatDown,
    TableSet,
    Vip,
    VipMode,
)

from .targets import FrameRefused, Target

HASH_KEY = bytes(range(16))
RING_SIZE = 65537
CLIENT_MAC = "02:aa:00:00:00:01"
VIP_TCP = Vip(0, ipaddress.IPv4Address("198.18.1.10"), 80, IPPROTO_TCP)
VIP_UDP = Vip(1, ipaddress.IPv4Address("198.18.1.10"), 53, IPPROTO_UDP)
VIP_TWO_ARM = Vip(2, ipaddress.IPv4Address("198.18.1.11"), 80, IPPROTO_TCP)
BACKEND_MACS = {0: "02:bb:00:00:00:10", 1: "02:bb:00:00:00:11", 2: "02:bb:00:00:00:12",
                3: "02:bb:00:00:00:13"}


@functools.cache
def _ring(weights: tuple[tuple[int, float], ...]) -> np.ndarray:
    table = maglev.build_table([(bid, f"b{bid}", w) for bid, w in weights], RING_SIZE)
    table.setflags(write=False)  # shared between cases: nobody may change it
    return table


def ring(weights: dict[int, float]) -> np.ndarray:
    return _ring(tuple(sorted(weights.items())))


# Idle timeouts of every table set the suite pushes: nothing a case leaves in
# a data plane's connection table expires while the session runs, so every
# case's connection figures (compared as differences) are its own.
CONFORMANCE_TIMEOUTS_S = (86400,) * len(CONN_STATE_NAMES)


def v6(addr: str) -> str:
    """The IPv6 twin of one of the suite's IPv4 addresses: 198.B.C.D ->
    fd00:B:C::D (a ULA, the digits kept as they read), so that an IPv6 case
    uses the same numbers as its IPv4 original."""
    a, b, c, d = addr.split(".")
    assert a == "198", addr
    return f"fd00:{b}:{c}::{d}"


def addr_of(family: int, addr: str) -> str:
    """``addr`` (an IPv4 address of the suite) in ``family``."""
    return addr if family == 4 else v6(addr)


def base_tables(weights: dict[int, float] | None = None,
                states: dict[int, BackendState] | None = None, family: int = 4) -> TableSet:
    """Three one-arm backends behind a TCP and a UDP VIP; a fourth, two-arm,
    backend (egress port 1) alone behind a second address. ``family`` 6:
    the same VIP ids, backend ids and rings, every address its v6 twin
    (VIPs fd00:18:1::10 and ::11, backends fd00:18:0::10..13)."""
    weights = weights or {0: 1.0, 1: 1.0, 2: 1.0}
    states = states or {}
    t = TableSet(hash_key=HASH_KEY, ring_size=RING_SIZE,
                 nat=NatConfig(timeouts_s=CONFORMANCE_TIMEOUTS_S))
    for bid, mac in BACKEND_MACS.items():
        t.backends[bid] = Backend(
            bid, ipaddress.ip_address(addr_of(family, f"198.18.0.{10 + bid}")), mac,
            states.get(bid, BackendState.UP), port=1 if bid == 3 else 0,
        )
    shared = ring(weights)
    vips = (VIP_TCP, VIP_UDP, VIP_TWO_ARM)
    if family == 6:
        vips = tuple(dataclasses.replace(vip, addr=ipaddress.IPv6Address(v6(str(vip.addr))))
                     for vip in vips)
    t.vips = {vip.vip_id: vip for vip in vips}
    t.rings = {0: shared, 1: shared, 2: ring({3: 1.0})}
    return t


VIP6_TCP = Vip(3, ipaddress.IPv6Address("fd00:18::10"), 80, IPPROTO_TCP)
VIP6_UDP = Vip(4, ipaddress.IPv6Address("fd00:18::10"), 53, IPPROTO_UDP)
BACKEND6_MACS = {4: "02:bb:00:00:00:14", 5: "02:bb:00:00:00:15"}


def dual_tables(weights: dict[int, float] | None = None) -> TableSet:
    """base_tables plus an IPv6 TCP and UDP VIP (fd00:18::10) on IPv6
    backends 4 and 5: both families side by side in one table set."""
    t = base_tables(weights)
    for bid, mac in BACKEND6_MACS.items():
        t.backends[bid] = Backend(bid, ipaddress.IPv6Address(f"fd00:18::{bid}"), mac)
    six = ring({4: 1.0, 5: 1.0})
    t.vips = {**t.vips, 3: VIP6_TCP, 4: VIP6_UDP}
    t.rings = {**t.rings, 3: six, 4: six}
    return t


# ---- NAT mode ---------------------------------------------------------------
# A two-arm gateway: clients on port 0, backends 10..12 behind port 1; backend
# 13 one-arm (port 0). The DSR VIPs of base_tables stay, next to these.
NAT_BACKEND_MACS = {10: "02:bb:00:00:00:20", 11: "02:bb:00:00:00:21", 12: "02:bb:00:00:00:22",
                    13: "02:bb:00:00:00:23"}
#: Backends 14..16, behind port 1: the IPv6 NAT VIPs' of nat_dual_tables.
NAT6_BACKEND_MACS = {14: "02:bb:00:00:00:24", 15: "02:bb:00:00:00:25", 16: "02:bb:00:00:00:26"}
VIP_NAT_TCP = Vip(5, ipaddress.IPv4Address("198.18.2.10"), 80, IPPROTO_TCP, VipMode.NAT,
                  nat_port=8080)
VIP_NAT_UDP = Vip(6, ipaddress.IPv4Address("198.18.2.10"), 53, IPPROTO_UDP, VipMode.NAT)
VIP_SNAT_TCP = Vip(7, ipaddress.IPv4Address("198.18.2.11"), 80, IPPROTO_TCP, VipMode.NAT,
                   nat_port=8080, snat=True)
VIP_SNAT_UDP = Vip(8, ipaddress.IPv4Address("198.18.2.11"), 53, IPPROTO_UDP, VipMode.NAT,
                   snat=True)
VIP_NAT_ONE_ARM = Vip(9, ipaddress.IPv4Address("198.18.2.12"), 80, IPPROTO_TCP, VipMode.NAT)
# Another address and port onto VIP_NAT_TCP's backends and backend port.
VIP_NAT_TWIN = Vip(10, ipaddress.IPv4Address("198.18.2.13"), 443, IPPROTO_TCP, VipMode.NAT,
                   nat_port=8080)


def nat_vip(vip: Vip, family: int = 4) -> Vip:
    """A NAT VIP of the suite in ``family``: the same id, port and settings,
    the address its v6 twin for 6 (198.18.2.10 -> fd00:18:2::10)."""
    if family == 4:
        return vip
    return dataclasses.replace(vip, addr=ipaddress.IPv6Address(v6(str(vip.addr))))


def nat_backend_addr(bid: int, family: int = 4) -> str:
    """NAT backend ``bid``'s address: 198.18.0.(10 + bid) or its v6 twin."""
    return addr_of(family, f"198.18.0.{10 + bid}")


def nat_tables(pool: tuple[str, ...] = ("198.18.3.1",), port_range: tuple[int, int] = (1024, 65535),
               down: NatDown = NatDown.RESCHEDULE,
               states: dict[int, BackendState] | None = None,
               weights: dict[int, float] | None = None,
               snat_weights: dict[int, float] | None = None,
               without: tuple[int, ...] = (), family: int = 4,
               pool6: tuple[str, ...] = ()) -> TableSet:
    """base_tables plus the NAT VIPs: VIP_NAT_TCP/UDP, VIP_NAT_TWIN and
    VIP_SNAT_TCP/UDP on backends 10..12 (``weights``, ``snat_weights``),
    VIP_NAT_ONE_ARM on 13;
    the SNAT pool ``pool`` with ``port_range``; VIP ids in ``without`` left out.
    Every case that opens SNAT connections on a shared data plane takes a
    pool address of its own (the reply keys it allocates are then free).
    ``family`` 6: the NAT VIPs, their backends and ``pool`` are the v6
    twins (same ids and rings; the DSR VIPs stay IPv4). ``pool6``: IPv6
    pool addresses besides (as written), for tables of both families."""
    states = states or {}
    t = base_tables()
    for bid, mac in NAT_BACKEND_MACS.items():
        t.backends[bid] = Backend(bid, ipaddress.ip_address(nat_backend_addr(bid, family)), mac,
                                  states.get(bid, BackendState.UP), port=0 if bid == 13 else 1)
    nat_ring = ring(weights or {10: 1.0, 11: 1.0, 12: 1.0})
    snat_ring = ring(snat_weights) if snat_weights else nat_ring
    for vip, r in ((VIP_NAT_TCP, nat_ring), (VIP_NAT_UDP, nat_ring), (VIP_SNAT_TCP, snat_ring),
                   (VIP_SNAT_UDP, snat_ring), (VIP_NAT_ONE_ARM, ring({13: 1.0})),
                   (VIP_NAT_TWIN, nat_ring)):
        if vip.vip_id not in without:
            t.vips[vip.vip_id] = nat_vip(vip, family)
            t.rings[vip.vip_id] = r
    addrs = [ipaddress.ip_address(addr_of(family, a)) for a in pool]
    addrs += [ipaddress.IPv6Address(a) for a in pool6]
    # The control plane's normal form (spec 8.): IPv4 first, then IPv6.
    addrs.sort(key=lambda a: a.version)
    t.nat = NatConfig(snat_addrs=tuple(addrs),  # type: ignore[arg-type]
                      snat_port_min=port_range[0], snat_port_max=port_range[1],
                      on_backend_down=down, timeouts_s=CONFORMANCE_TIMEOUTS_S)
    return t


#: nat_dual_tables' IPv6 NAT VIPs take the ids of their IPv4 twins plus this.
NAT6_VIP_ID_OFFSET = 20


def nat_dual_tables(pool: tuple[str, ...], pool6: tuple[str, ...],
                    weights6: dict[int, float] | None = None) -> TableSet:
    """NAT VIPs of both families side by side: nat_tables (IPv4, ``pool``),
    plus the IPv6 twins of VIP_NAT_TCP/UDP and VIP_SNAT_TCP/UDP with their
    ids + NAT6_VIP_ID_OFFSET on the IPv6 backends 14..16 (``weights6``), and
    the IPv6 pool ``pool6`` (as written)."""
    t = nat_tables(pool, pool6=pool6)
    for bid, mac in NAT6_BACKEND_MACS.items():
        t.backends[bid] = Backend(bid, ipaddress.IPv6Address(nat_backend_addr(bid, 6)), mac,
                                  port=1)
    six = ring(weights6 or dict.fromkeys(NAT6_BACKEND_MACS, 1.0))
    for vip in (VIP_NAT_TCP, VIP_NAT_UDP, VIP_SNAT_TCP, VIP_SNAT_UDP):
        twin = dataclasses.replace(nat_vip(vip, 6), vip_id=vip.vip_id + NAT6_VIP_ID_OFFSET)
        t.vips[twin.vip_id] = twin
        t.rings[twin.vip_id] = six
    return t


def ip_layer(src: str, dst: str | None, **ip: object) -> IP | IPv6:
    """IPv4 or IPv6 by ``src``'s family; ``dst`` None: the TCP/UDP VIP of
    that family (198.18.1.10 or its twin)."""
    if ":" in src:
        return IPv6(src=src, dst=dst or v6("198.18.1.10"), **ip)
    return IP(src=src, dst=dst or "198.18.1.10", **ip)


def tcp(src: str, sport: int, dst: str | None = None, dport: int = 80, **ip: object) -> bytes:
    """A TCP SYN from ``src`` (IPv4 or IPv6) to ``dst``."""
    return bytes(Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01") / ip_layer(src, dst, **ip)
                 / TCP(sport=sport, dport=dport, flags="S"))


def udp(src: str, sport: int, dst: str | None = None, dport: int = 53, **ip: object) -> bytes:
    """A UDP query from ``src`` (IPv4 or IPv6) to ``dst``."""
    return bytes(Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01") / ip_layer(src, dst, **ip)
                 / UDP(sport=sport, dport=dport) / b"query")


# ---- tunnel mode ------------------------------------------------------------
# Backends in other networks, behind routers: the backend table holds the
# next hop's MAC (one router for the IPv4 backends, one for the IPv6 ones).
# 20..22 IPv4, each in a network of its own (10.20.0.1, 10.21.0.2,
# 10.22.0.3), 23 IPv4 behind port 1 (10.23.0.4); 24..26 IPv6 (fd00:20::1..3).
# The tunnel sources: 10.1.0.0 and fd00:1::ab00, 8 bits of each the flow's.
ROUTER4_MAC = "02:cc:00:00:00:04"
ROUTER6_MAC = "02:cc:00:00:00:06"
TUNNEL_SRC4 = ipaddress.IPv4Address("10.1.0.0")
TUNNEL_SRC6 = ipaddress.IPv6Address("fd00:1::ab00")
GUE_PORT = 6080
GUE_PORT_6 = 6081
TUNNEL_BACKENDS4 = (20, 21, 22)
TUNNEL_BACKENDS6 = (24, 25, 26)


def _tunnel_vip(vip_id: int, addr: str, port: int, proto: int, src: ipaddress.IPv4Address
                | ipaddress.IPv6Address, gue: int = 0, bits: int = 8) -> Vip:
    return Vip(vip_id, ipaddress.ip_address(addr), port, proto, VipMode.TUNNEL,
               tunnel_src=src, tunnel_encap=Encap.GUE if gue else Encap.IPIP, gue_port=gue,
               tunnel_src_bits=bits)


#: The pairs: name -> the VIP (inner family = the VIP's, outer = tunnel_src's).
TUNNEL_VIPS = {
    "4in4": _tunnel_vip(11, "198.18.5.10", 80, IPPROTO_TCP, TUNNEL_SRC4),
    "4in4-gue": _tunnel_vip(12, "198.18.5.10", 53, IPPROTO_UDP, TUNNEL_SRC4, GUE_PORT),
    "4in6": _tunnel_vip(13, "198.18.5.11", 80, IPPROTO_TCP, TUNNEL_SRC6),
    "4in6-gue": _tunnel_vip(14, "198.18.5.11", 53, IPPROTO_UDP, TUNNEL_SRC6, GUE_PORT_6),
    "6in6": _tunnel_vip(15, v6("198.18.5.10"), 80, IPPROTO_TCP, TUNNEL_SRC6),
    "6in6-gue": _tunnel_vip(16, v6("198.18.5.10"), 53, IPPROTO_UDP, TUNNEL_SRC6, GUE_PORT),
    # Refused pairs (drop_encap): a tunnel source of another family than
    # the backends' (IPv4 backends, an IPv6 source), for inner IPv6 (what
    # 6-in-4 becomes in the tables: the protocol refuses an IPv6 VIP an
    # IPv4 tunnel source, VIP_6IN4) and inner IPv4.
    "6in6-backends4": _tunnel_vip(17, v6("198.18.5.11"), 80, IPPROTO_TCP, TUNNEL_SRC6),
    "4in6-backends4": _tunnel_vip(18, "198.18.5.12", 80, IPPROTO_TCP, TUNNEL_SRC6),
    # The whole outer source fixed (bits 0), or its last 16 bits all the flow's.
    "4in4-bits0": _tunnel_vip(19, "198.18.5.13", 80, IPPROTO_TCP, TUNNEL_SRC4, bits=0),
    "6in6-bits16": _tunnel_vip(20, v6("198.18.5.13"), 80, IPPROTO_TCP, TUNNEL_SRC6, bits=16),
    # A two-arm backend (egress port 1).
    "4in4-two-arm": _tunnel_vip(21, "198.18.5.14", 80, IPPROTO_TCP, TUNNEL_SRC4),
}


#: IPv6 inside IPv4: refused by the table protocol (set_vip), and by
#: lb_encap_prepare were it there.
VIP_6IN4 = _tunnel_vip(22, v6("198.18.5.15"), 80, IPPROTO_TCP, TUNNEL_SRC4)


def tunnel_tables(weights4: dict[int, float] | None = None,
                  weights6: dict[int, float] | None = None,
                  states: dict[int, BackendState] | None = None) -> TableSet:
    """base_tables plus TUNNEL_VIPS: those with an IPv4 tunnel source on
    backends 20..22 (``weights4``), those with an IPv6 one on 24..26
    (``weights6``), "4in4-two-arm" on 23, the "-backends4" ones on
    20..22 (``weights4``)."""
    states = states or {}
    t = base_tables()
    for bid in (20, 21, 22, 23):
        t.backends[bid] = Backend(bid, ipaddress.IPv4Address(f"10.{bid}.0.{bid - 19}"),
                                  ROUTER4_MAC, states.get(bid, BackendState.UP),
                                  port=1 if bid == 23 else 0)
    for bid in TUNNEL_BACKENDS6:
        t.backends[bid] = Backend(bid, ipaddress.IPv6Address(f"fd00:20::{bid - 23}"),
                                  ROUTER6_MAC, states.get(bid, BackendState.UP))
    ring4 = ring(weights4 or dict.fromkeys(TUNNEL_BACKENDS4, 1.0))
    ring6 = ring(weights6 or dict.fromkeys(TUNNEL_BACKENDS6, 1.0))
    for name, vip in TUNNEL_VIPS.items():
        t.vips[vip.vip_id] = vip
        if name == "4in4-two-arm":
            t.rings[vip.vip_id] = ring({23: 1.0})
        elif name.endswith("-backends4"):
            t.rings[vip.vip_id] = ring4  # IPv4 backends, an IPv6 source
        else:
            t.rings[vip.vip_id] = ring4 if vip.tunnel_src == TUNNEL_SRC4 else ring6
    return t


# The NAT counters a frame moves besides its verdict's (lb_tables.h): the
# model counts them too, and every case compares them with the data plane's.
NAT_EVENTS = (*(name for name in STAT_NAMES if name.startswith("conn_")), "nat_icmp")
#: Every event counter compared (tunnel mode's with NAT mode's).
EVENTS = (*NAT_EVENTS, "tunnel_encap")
#: The verdict counters compared: forwarded, passed, dropped, answered.
REASON_PREFIXES = ("fwd_", "pass_", "drop_", "arp_", "ndp_")


def _conn_figures(conns: dict[str, Any]) -> dict[str, int]:
    """A "conns" map flattened: entries, snat_ports_in_use, expired, by_state.*."""
    flat = {k: int(conns.get(k, 0)) for k in ("entries", "snat_ports_in_use", "expired")}
    by_state = conns.get("by_state", {})
    for name in CONN_STATE_NAMES:
        flat[f"by_state.{name}"] = int(by_state.get(name, 0))
    return flat


@dataclass
class Harness:
    """One case's run: the model (oracle) and, unless None, a real data plane.

    ``conn_capacity`` is the model's connection table (entries): the data
    plane's conn_table_size. A target shared by the session keeps the
    connections of the cases before; the cases use addresses of their own,
    and the connection figures are compared as differences from the case's
    start (nothing expires: CONFORMANCE_TIMEOUTS_S)."""

    target: Target | None
    port_macs: list[str]
    conn_capacity: int = CONN_TABLE_DEFAULT
    tables: TableSet | None = None
    model: Model | None = None
    reasons: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)
    _start_counters: dict[str, int] = field(default_factory=dict)
    _start_conns: dict[str, int] | None = None

    def load(self, tables: TableSet) -> None:
        if self.target is not None:
            if not self._start_counters and self.tables is None:
                self._start_counters = self.target.counters()
                if self.target.nat:
                    self._start_conns = _conn_figures(self.target.conns())
            self.target.load(self.tables, tables)
        if self.model is None:
            answers_arp = self.target is not None and self.target.answers_arp
            self.model = Model(tables, self.port_macs, answers_arp=answers_arp,
                               conn_capacity=self.conn_capacity)
        self.model.tables = tables
        self.tables = tables

    def send(self, frame: bytes, in_port: int = 0) -> Verdict:
        """``frame`` arrives on port ``in_port`` (0: the clients' side)."""
        assert self.model is not None, "load tables first"
        verdict = self.model.process(frame, in_port)
        self.reasons[verdict.reason] += 1
        self.events.update(verdict.events)
        if self.target is None:
            return verdict
        if len(frame) < self.target.min_frame:
            # Cannot even reach this data plane (the kernel refuses it first).
            try:
                self.target.run(frame, in_port)
            except FrameRefused:
                self.reasons[verdict.reason] -= 1
                return verdict
            raise AssertionError(f"{self.target.name} accepted a {len(frame)}-byte frame")
        action, out = self.target.run(frame, in_port)
        assert (action, out.hex()) == (verdict.action, verdict.frame.hex()), (
            f"{self.target.name} disagrees with the model ({verdict.reason}, "
            f"{'+'.join(verdict.events) or 'no event'})"
        )
        return verdict

    def backend_of(self, frame: bytes) -> int | None:
        return self.send(frame).backend_id

    def conns(self) -> dict[str, int]:
        """The model's connection figures (entries, snat_ports_in_use,
        expired, by_state.NAME), after checking that the data plane's moved
        by exactly as much since the case began."""
        assert self.model is not None, "load tables first"
        want = _conn_figures(self.model.conn_stats())
        if self.target is not None and self._start_conns is not None:
            end = _conn_figures(self.target.conns())
            got = {k: end[k] - self._start_conns[k] for k in end}
            assert got == want, f"{self.target.name}'s connection table differs from the model's"
        return want

    def check_counters(self) -> None:
        """The data plane counted every frame under the model's reason, and
        the NAT events as the model did."""
        if self.target is None or self.model is None:
            return  # nothing was sent (the case skipped before loading tables)
        end = self.target.counters()
        for reason in STAT_NAMES:
            if reason.startswith(REASON_PREFIXES):
                got = end.get(reason, 0) - self._start_counters.get(reason, 0)
                n = self.reasons.get(reason, 0)
                assert got == n, f"{self.target.name} counted {got} {reason}, model {n}"
            elif reason in EVENTS:
                got = end.get(reason, 0) - self._start_counters.get(reason, 0)
                n = self.events.get(reason, 0)
                assert got == n, f"{self.target.name} counted {got} {reason}, model {n}"
        received = end.get("rx", 0) - self._start_counters.get("rx", 0)
        assert received == sum(self.reasons.values()), "every frame counted once as rx"
        if self._start_conns is not None:
            self.conns()
