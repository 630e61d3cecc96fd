"""The reference model of the data-plane semantics: frame in, verdict out.

This is the oracle of the conformance suite: the XDP program and the DPDK
forwarder must give, for every case, the verdict, the output frame and the
backend this model gives. It follows ``dataplane/xdp/lb.bpf.c`` step by step
and is written for clarity, not speed.

What is balanced: untagged IPv4 and untagged IPv6 (``lb_parse_untagged``;
IPv6's parse, the bounded extension-header walk, is ``parse.py``). A tagged
or non-IP frame passes as ``pass_not_ipv4``; an IPv6 packet with more than
eight extension headers passes unparsed as ``pass_ext_headers``; fragments of
either family pass as ``pass_fragment``; ICMP, ICMPv6 (NDP included) and
other protocols as ``pass_not_vip``, like TCP/UDP to no VIP. The DPDK
forwarder (``answers_arp``) answers ARP requests and Neighbor Solicitations
for VIP addresses itself (``arp_reply``, ``ndp_reply``).

DSR mode forwards either family the same way: the flow (the 5-tuple; an IPv4
flow hashes as protocol 1's tuple, an IPv6 one its 40-byte key, both in
``flowhash.py``) is pinned to a backend picked on the VIP's ring, and only
the MACs change. Tunnel mode (``VipMode.TUNNEL``) picks and pins exactly as
DSR, then puts outer IPIP or GUE headers in front of the untouched IP
packet (``encap.py``, the port of ``lb_encap.h``), counted ``tunnel_encap``;
a pair it cannot encapsulate (IPv6 in IPv4, a tunnel source of another
family than the backend's) is dropped as ``drop_encap``.

NAT mode (a VIP with ``VipMode.NAT``, of either family) is the stateful
gateway of ``dataplane/common/lb_conn.h``, whose header comment is its
specification; the packet rewrites are ``lb_nat.h``'s and ``lb_nat6.h``'s,
ported operation for operation in ``nat.py`` and ``nat6.py`` (RFC 1624
incremental checksum updates, never a recomputation: a wrong incoming
checksum stays exactly as wrong, a UDP checksum of 0 stays 0, in IPv6 too).
Each family has a connection table of its own, a dict of entries keyed by
5-tuple (two per connection; IPv4 addresses as host ints, IPv6 ones as
their packed bytes), with the capacity a data plane's ``--conn-table-size``
gives each table and an embryonic FIFO of its own. An IPv6 NAT VIP takes
IPv6 backends and the IPv6 SNAT pool only (no NAT64); a NAT packet whose
L4 header starts more than 256 bytes of extension headers into the packet
(``nat6.NAT6_MAX_L4_OFF``) passes as ``pass_ext_headers``. Time plays no
part: the idle timeouts are a sweep outside the fast path, which the model
does not run (``expire`` removes a connection as the sweep would).
"""

from __future__ import annotations

import collections
import ipaddress
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpclb.contract.encap import encap_headers, encap_prepare, inner_tos
from hpclb.contract.flowhash import flow_hash, probe_slot
from hpclb.contract.nat import (
    CONN_ORIG,
    CONN_REPLY,
    EMBRYONIC,
    IP_MF,
    IP_OFFSET,
    ConnEntry,
    ConnKey,
    FlowKey6,
    FlowTuple,
    IcmpQuote,
    conn_icmp_key,
    conn_icmp_translate,
    conn_next_state,
    conn_open_state,
    conn_translate,
    csum_fold,
    icmp_parse,
    snat_addr_index,
    snat_candidate,
    tcp_flags_of,
)
from hpclb.contract.nat6 import (
    NAT6_MAX_L4_OFF,
    Icmp6Quote,
    conn6_icmp_key,
    conn6_icmp_translate,
    conn6_translate,
    icmp6_parse,
    tcp_flags6,
)
from hpclb.contract.parse import Parsed6, ParseVerdict, parse_ipv6
from hpclb.contract.tables import (
    CONN_EVICT_TRIES,
    CONN_F_SNAT,
    CONN_STATE_NAMES,
    CONN_TABLE_DEFAULT,
    IPPROTO_TCP,
    IPPROTO_UDP,
    NO_BACKEND,
    RING_PROBES,
    SNAT_PROBES,
    Backend,
    BackendState,
    ConnState,
    NatDown,
    TableSet,
    Vip,
    VipMode,
    mac_bytes,
)

ETH_HLEN = 14
ETH_P_IP = 0x0800
ETH_P_ARP = 0x0806
ETH_P_IPV6 = 0x86DD
ARP_REQUEST_HEAD = bytes.fromhex("0001080006040001")  # Ethernet/IPv4, hlen 6, plen 4, request
ARP_LEN = 28
IPPROTO_ICMP = 1
IPPROTO_ICMPV6 = 58

#: A DSR/tunnel flow-table key: an IPv4 flow's addresses as host ints (a
#: FlowTuple), an IPv6 flow's as their 16 packed bytes.
FlowKey = tuple[int | bytes, int | bytes, int, int, int]

# NDP (RFC 4861): the Neighbor Solicitation the DPDK forwarder answers for a
# VIP address, and its Neighbor Advertisement.
ND_NEIGHBOR_SOLICIT = 135
ND_NEIGHBOR_ADVERT = 136
ND_NS_MIN_LEN = 24  # type, code, checksum, reserved, target
ND_HOP_LIMIT = 255
ND_NA_S = 0x40000000  # Solicited
ND_NA_O = 0x20000000  # Override
ND_OPT_SOURCE_LLADDR = 1
ND_OPT_TARGET_LLADDR = 2
ND_MAX_OPTS = 64  # options a solicitation may carry and still be answered
ALL_NODES = ipaddress.IPv6Address("ff02::1")
ALL_NODES_MAC = bytes.fromhex("333300000001")


@dataclass(frozen=True)
class Verdict:
    """What a data plane does with one frame."""

    action: str  # "tx" | "redirect" | "pass" | "drop"
    reason: str  # the lb_stat counter this frame is accounted to (LB_STAT_NAMES)
    frame: bytes  # the frame as it leaves (unchanged for pass/drop)
    backend_id: int | None = None
    port: int = 0  # the egress port (tx and redirect)
    #: The other counters this frame moved besides rx and ``reason``: NAT
    #: mode's conn_* and nat_icmp, tunnel mode's tunnel_encap (flow_* are
    #: not modelled).
    events: tuple[str, ...] = ()



def icmpv6_csum(src: ipaddress.IPv6Address, dst: ipaddress.IPv6Address, msg: bytes) -> int:
    """RFC 4443's ICMPv6 checksum of ``msg`` (its checksum field 0): the
    one's-complement sum over the RFC 8200 pseudo-header and the message."""
    data = src.packed + dst.packed + struct.pack("!IxxxB", len(msg), IPPROTO_ICMPV6) + msg
    if len(data) % 2:
        data += b"\0"
    s = sum(w for (w,) in struct.iter_unpack("!H", data))
    return ~csum_fold(s) & 0xFFFF


def nd_options(opts: bytes) -> int | None:
    """fwd_packet.c's nd_opts: how many source link-layer address options
    a solicitation's options hold, None when they are invalid (RFC 4861
    7.1.1: one of length 0 or past the message; or more than 64)."""
    slla = 0
    for _ in range(ND_MAX_OPTS):
        if not opts:
            break
        if len(opts) < 2 or opts[1] == 0 or opts[1] * 8 > len(opts):
            return None
        slla += opts[0] == ND_OPT_SOURCE_LLADDR
        opts = opts[opts[1] * 8 :]
    return None if opts else slla


@dataclass
class Model:
    """Tables plus the flow-affinity memory and NAT mode's connection table,
    like one data-plane instance."""

    tables: TableSet
    port_macs: list[str]  # index 0 = the ingress port
    flows: dict[FlowKey, int] = field(default_factory=dict)
    # The DPDK forwarder owns the port, so it answers ARP for VIP addresses
    # (and SNAT pool addresses) itself; XDP leaves ARP to the kernel, which
    # holds them.
    answers_arp: bool = False
    #: NAT connection-table entries (two per connection) of EACH family's
    #: table: the planes' --conn-table-size / DpdkLaunch.conn_table_size.
    conn_capacity: int = CONN_TABLE_DEFAULT
    #: The IPv4 connection table (keys: FlowTuple) and the IPv6 one (keys:
    #: FlowKey6), each with conn_capacity entries and an embryonic FIFO of
    #: its own (original keys in creation order, at most conn_capacity of
    #: them: a push onto a full FIFO drops the oldest).
    conns: dict[FlowTuple, ConnEntry] = field(default_factory=dict)
    conn_fifo: collections.deque[FlowTuple] = field(default_factory=collections.deque)
    conns6: dict[FlowKey6, ConnEntry] = field(default_factory=dict)
    conn_fifo6: collections.deque[FlowKey6] = field(default_factory=collections.deque)
    #: Every lb_stat counter this model moved (rx, the verdict reasons, events).
    counters: Counter[str] = field(default_factory=Counter)
    conns_expired: int = 0

    # ---- ARP (DPDK) ----------------------------------------------------------

    def _arp_reply(self, frame: bytes, in_port: int) -> bytes | None:
        """The reply to an ARP request for a VIP or SNAT pool address, or None."""
        arp = frame[ETH_HLEN : ETH_HLEN + ARP_LEN]
        if len(arp) < ARP_LEN or arp[:8] != ARP_REQUEST_HEAD:
            return None
        sender_mac, sender_ip, target_ip = arp[8:14], arp[14:18], arp[24:28]
        addrs = {vip.addr.packed for vip in self.tables.vips.values() if vip.addr.version == 4}
        addrs |= {a.packed for a in self.tables.nat.snat_addrs}
        if target_ip not in addrs or in_port >= len(self.port_macs):
            return None
        mac = mac_bytes(self.port_macs[in_port])
        reply = (bytes.fromhex("0001080006040002") + mac + target_ip + sender_mac + sender_ip)
        return sender_mac + mac + frame[12:14] + reply + frame[ETH_HLEN + ARP_LEN :]

    def _ndp_reply(self, frame: bytes, ip_len: int, in_port: int) -> bytes | None:
        """The Neighbor Advertisement answering a Neighbor Solicitation for an
        IPv6 VIP address (RFC 4861 7.2.4), as the DPDK forwarder builds it
        (fwd_packet.c's ndp), or None (the kernel's: pass_not_vip).

        Answered: ICMPv6 right after the IPv6 header (no extension header),
        the ``ip_len``-byte packet holding a whole solicitation (24 bytes),
        hop limit 255, type 135 code 0, a right checksum, a VIP's address
        (or an IPv6 SNAT pool address: the backends' replies come to it) as
        the target, valid options (none of length 0, none past the
        message, at most 64), no source link-layer option from the
        unspecified address. The answer replaces the frame (86 bytes, any
        trailer gone): from the port's MAC and the target, with the target
        link-layer option; to the solicitation's source and its MAC, flags
        Solicited|Override; duplicate address detection (source ::) is
        answered to all-nodes (ff02::1, 33:33:00:00:00:01), Override only."""
        ip = frame[ETH_HLEN:]
        if ip[6] != IPPROTO_ICMPV6 or ip_len < 40 + ND_NS_MIN_LEN:
            return None
        src = ipaddress.IPv6Address(ip[8:24])
        dst = ipaddress.IPv6Address(ip[24:40])
        icmp = ip[40:ip_len]
        target = ipaddress.IPv6Address(icmp[8:24])
        vip_addrs = {vip.addr for vip in self.tables.vips.values() if vip.addr.version == 6}
        vip_addrs |= {a for a in self.tables.nat.snat_addrs if a.version == 6}
        if (ip[7] != ND_HOP_LIMIT or icmp[0] != ND_NEIGHBOR_SOLICIT or icmp[1] != 0
                or icmpv6_csum(src, dst, icmp) != 0 or target not in vip_addrs):
            return None
        slla = nd_options(icmp[ND_NS_MIN_LEN:])
        dad = src.is_unspecified
        if slla is None or (dad and slla) or in_port >= len(self.port_macs):
            return None
        mac = mac_bytes(self.port_macs[in_port])
        to = ALL_NODES if dad else src
        flags = ND_NA_O if dad else ND_NA_S | ND_NA_O
        na = bytearray(struct.pack("!BBHI16sBB6s", ND_NEIGHBOR_ADVERT, 0, 0, flags,
                                   target.packed, ND_OPT_TARGET_LLADDR, 1, mac))
        struct.pack_into("!H", na, 2, icmpv6_csum(target, to, bytes(na)))
        ip6 = struct.pack("!IHBB16s16s", 6 << 28, len(na), IPPROTO_ICMPV6, ND_HOP_LIMIT,
                          target.packed, to.packed)
        eth_dst = ALL_NODES_MAC if dad else frame[6:12]
        return eth_dst + mac + struct.pack("!H", ETH_P_IPV6) + ip6 + bytes(na)

    # ---- backends --------------------------------------------------------------

    def _backend_state(self, backend_id: int) -> BackendState:
        backend = self.tables.backends.get(backend_id)
        return backend.state if backend else BackendState.UNUSED

    def _serving(self, backend_id: int) -> bool:
        return self._backend_state(backend_id) in (BackendState.UP, BackendState.DRAINING)

    def _pick_hashed(self, vip_id: int, h: int) -> int:
        ring = self.tables.rings.get(vip_id)
        size = self.tables.ring_size
        if ring is None:
            return NO_BACKEND
        for n in range(RING_PROBES):
            backend_id = int(ring[probe_slot(h, size, n)])
            if backend_id == NO_BACKEND:
                continue
            if self._backend_state(backend_id) == BackendState.UP:
                return backend_id
        return NO_BACKEND

    def _pick(self, vip_id: int, flow: FlowKey) -> int:
        return self._pick_hashed(vip_id, flow_hash(self.tables.hash_key, *flow))

    # ---- the frame ---------------------------------------------------------------

    def process(self, frame: bytes, in_port: int = 0) -> Verdict:
        """One frame arriving on port ``in_port`` (0 = the ingress port)."""
        v = self._process(frame, in_port)
        self.counters["rx"] += 1
        self.counters[v.reason] += 1
        self.counters.update(v.events)
        return v

    def _process(self, frame: bytes, in_port: int) -> Verdict:
        def verdict(action: str, reason: str, *events: str) -> Verdict:
            return Verdict(action, reason, frame, events=events)

        if len(frame) < ETH_HLEN:
            return verdict("drop", "drop_malformed")
        (ethertype,) = struct.unpack_from("!H", frame, 12)
        if ethertype == ETH_P_ARP and self.answers_arp:
            reply = self._arp_reply(frame, in_port)
            if reply is not None:
                return Verdict("tx", "arp_reply", reply, port=in_port)
        if ethertype == ETH_P_IPV6:
            return self._ipv6(frame, in_port)
        if ethertype != ETH_P_IP:  # ARP, a VLAN tag, ...
            return verdict("pass", "pass_not_ipv4")
        ip = frame[ETH_HLEN:]
        if len(ip) < 20:
            return verdict("drop", "drop_malformed")
        version, ihl = ip[0] >> 4, ip[0] & 0xF
        if ihl < 5 or version != 4:
            return verdict("drop", "drop_malformed")
        # The total length covers the header and fits in the frame; what follows
        # it is Ethernet padding (a 60-byte minimum frame around a 40-byte
        # packet), no part of the packet: the L4 header must fit in the packet.
        (total_length,) = struct.unpack_from("!H", ip, 2)
        if total_length < ihl * 4 or total_length > len(ip):
            return verdict("drop", "drop_malformed")
        ip = ip[:total_length]
        proto = ip[9]
        (frag,) = struct.unpack_from("!H", ip, 6)
        if proto not in (IPPROTO_TCP, IPPROTO_UDP):
            # lb_conn.h 3.: an ICMP error quoting a connection's packet.
            if proto == IPPROTO_ICMP and not frag & (IP_MF | IP_OFFSET):
                translated = self._nat_icmp(frame, total_length, in_port)
                if translated is not None:
                    return translated
            return verdict("pass", "pass_not_vip")
        if frag & (IP_MF | IP_OFFSET):
            return verdict("pass", "pass_fragment")
        l4 = ip[ihl * 4 :]
        if len(l4) < (20 if proto == IPPROTO_TCP else 8):
            return verdict("drop", "drop_malformed")
        sport, dport = struct.unpack_from("!HH", l4, 0)
        saddr, daddr = struct.unpack_from("!II", ip, 12)
        flow: FlowTuple = (saddr, daddr, sport, dport, proto)
        vip = self.tables.vip_for(ipaddress.IPv4Address(daddr), dport, proto)
        if vip is None:
            # lb_conn.h 2.: a reply of a known connection, or the kernel's.
            return self._nat_reply(frame, flow, tcp_flags_of(ip, ihl, proto), in_port)
        if vip.mode == VipMode.NAT:
            return self._nat_orig(frame, flow, vip, tcp_flags_of(ip, ihl, proto), in_port)
        return self._dsr(frame, flow, vip, in_port, total_length)

    def _ipv6(self, frame: bytes, in_port: int) -> Verdict:
        """An untagged IPv6 frame: lb_parse_ipv6's verdict, then DSR, tunnel
        or NAT mode for TCP/UDP to an IPv6 VIP; while NAT mode is active, a
        reply of an IPv6 connection or an ICMPv6 error quoting one. A NAT
        packet whose L4 header starts past NAT6_MAX_L4_OFF (more than 256
        bytes of extension headers) passes as pass_ext_headers."""
        p = parse_ipv6(frame[ETH_HLEN:])
        if p.verdict == ParseVerdict.MALFORMED:
            return Verdict("drop", "drop_malformed", frame)
        if p.verdict == ParseVerdict.EXT_TOO_LONG:
            return Verdict("pass", "pass_ext_headers", frame)
        if p.verdict == ParseVerdict.FRAGMENT:
            return Verdict("pass", "pass_fragment", frame)
        beyond = ETH_HLEN + p.l4 > NAT6_MAX_L4_OFF
        if p.verdict == ParseVerdict.UNSUPPORTED_L4:
            if p.proto == IPPROTO_ICMPV6 and self.answers_arp:
                reply = self._ndp_reply(frame, p.length, in_port)
                if reply is not None:
                    return Verdict("tx", "ndp_reply", reply, port=in_port)
            if p.proto == IPPROTO_ICMPV6 and self.nat_active():
                # lb_conn.h 3. for IPv6 (spec 4.(c), 6.).
                if beyond:
                    return Verdict("pass", "pass_ext_headers", frame)
                if not p.fragment:
                    translated = self._nat6_icmp(frame, p, in_port)
                    if translated is not None:
                        return translated
            return Verdict("pass", "pass_not_vip", frame)
        assert p.src is not None and p.dst is not None
        vip = self.tables.vip_for(p.dst, p.dport, p.proto)
        key: FlowKey6 = (p.src.packed, p.dst.packed, p.sport, p.dport, p.proto)
        if vip is None:
            if not self.nat_active():
                return Verdict("pass", "pass_not_vip", frame)
            if beyond:  # spec 4.(b): before the reply lookup
                return Verdict("pass", "pass_ext_headers", frame)
            return self._nat_reply(frame, key, tcp_flags6(frame, p), in_port, ETH_HLEN + p.l4)
        if vip.mode == VipMode.NAT:
            if beyond:  # spec 4.(a): before the connection lookup
                return Verdict("pass", "pass_ext_headers", frame)
            return self._nat_orig(frame, key, vip, tcp_flags6(frame, p), in_port,
                                  ETH_HLEN + p.l4)
        return self._dsr(frame, key, vip, in_port, p.length)

    def _dsr(self, frame: bytes, flow: FlowKey, vip: Vip, in_port: int,
             ip_len: int) -> Verdict:
        """DSR and tunnel mode: the flow's pinned backend, or one picked on
        the ring and pinned; then the MACs rewritten (DSR) or the outer
        headers put in front (tunnel). ``ip_len``: the IP packet's length."""
        backend_id = self.flows.get(flow)
        if backend_id is not None and not self._serving(backend_id):
            backend_id = None  # pinned to a down backend: re-hash (task migration)
        if backend_id is None:
            backend_id = self._pick(vip.vip_id, flow)
            if backend_id == NO_BACKEND:
                return Verdict("drop", "drop_no_backend", frame)
            self.flows[flow] = backend_id

        backend = self.tables.backends[backend_id]
        # Port 0 means "back out of the port it came in on" (lb_tables.h).
        port = backend.port or in_port
        if port >= len(self.port_macs):
            return Verdict("drop", "drop_tx_error", frame)
        events: tuple[str, ...] = ()
        if vip.mode == VipMode.TUNNEL:
            head = self._encap(frame, flow, vip, backend, port, ip_len)
            if head is None:
                return Verdict("drop", "drop_encap", frame)
            out = head + frame[ETH_HLEN:]  # the IP packet as it came, padding and all
            events = ("tunnel_encap",)
        else:
            out = mac_bytes(backend.mac) + mac_bytes(self.port_macs[port]) + frame[12:]
        if backend.port == 0:
            return Verdict("tx", "fwd_tx", out, backend_id, port, events)
        return Verdict("redirect", "fwd_redirect", out, backend_id, port, events)

    def _encap(self, frame: bytes, flow: FlowKey, vip: Vip, backend: Backend, port: int,
               ip_len: int) -> bytes | None:
        """lb_encap_prepare + lb_encap_write: the Ethernet and outer headers
        for this frame to ``backend``, or None (drop_encap)."""
        saddr = flow[0]
        src = (ipaddress.IPv4Address(saddr) if isinstance(saddr, int)
               else ipaddress.IPv6Address(saddr))
        plan = encap_prepare(src, flow[2], ip_len, inner_tos(frame[ETH_HLEN:]), vip, backend)
        if plan is None:
            return None
        return encap_headers(plan, mac_bytes(backend.mac), mac_bytes(self.port_macs[port]))

    # ---- NAT mode ------------------------------------------------------------------
    #
    # One connection table per family (spec 1.), each with conn_capacity
    # entries and a FIFO of its own; a key's family picks its table (an IPv6
    # key's addresses are bytes). Everything else is the same code for both.

    def _table(self, key: ConnKey) -> tuple[dict[Any, ConnEntry], collections.deque[Any]]:
        if isinstance(key[0], bytes):
            return self.conns6, self.conn_fifo6
        return self.conns, self.conn_fifo

    def nat_active(self) -> bool:
        """XDP's nat_active: a NAT VIP is configured, or a table still holds
        connections. Only then are frames for no VIP and ICMP errors looked
        up, which only the IPv6 bound makes visible (pass_ext_headers rather
        than pass_not_vip). The DPDK forwarder looks while its IPv6 table
        holds any: the same verdicts whenever an IPv6 connection is open."""
        return bool(self.conns or self.conns6) or any(
            vip.mode == VipMode.NAT for vip in self.tables.vips.values())

    @staticmethod
    def _translate(buf: bytearray, key: ConnKey, peer: ConnKey, l4: int) -> None:
        """lb_conn_translate or lb_conn6_translate, by the key's family."""
        if isinstance(key[0], bytes):
            conn6_translate(buf, l4, key, peer)  # type: ignore[arg-type]
        else:
            conn_translate(buf, ETH_HLEN, key, peer)  # type: ignore[arg-type]

    def _send(self, frame: bytes, dst_mac: bytes, port: int, in_port: int,
              backend_id: int, events: tuple[str, ...],
              rewrite: Callable[[bytearray], None]) -> Verdict:
        """Rewrite the MACs and translate (``rewrite``), then send out of
        ``port``: XDP_TX (fwd_tx) when that is the port the frame came in
        on, else a redirect (fwd_redirect)."""
        if port >= len(self.port_macs):
            return Verdict("drop", "drop_tx_error", frame, events=events)
        buf = bytearray(frame)
        buf[0:6] = dst_mac
        buf[6:12] = mac_bytes(self.port_macs[port])
        rewrite(buf)
        action, reason = ("tx", "fwd_tx") if port == in_port else ("redirect", "fwd_redirect")
        return Verdict(action, reason, bytes(buf), backend_id, port, events)

    def _nat_orig(self, frame: bytes, key: ConnKey, vip: Vip, tcp_flags: int,
                  in_port: int, l4: int = 0) -> Verdict:
        """lb_conn.h 1.: a frame to a NAT VIP (``l4``: an IPv6 frame's L4
        header offset)."""
        conns, fifo = self._table(key)
        six = isinstance(key[0], bytes)
        proto = key[4]
        events: tuple[str, ...] = ()
        entry = conns.get(key)
        if entry is not None and entry.dir == CONN_ORIG:
            if self._serving(entry.backend_id):
                entry.state, entry.fin_dirs = conn_next_state(
                    entry.state, entry.fin_dirs, CONN_ORIG, proto, tcp_flags)
                backend = self.tables.backends[entry.backend_id]
                peer = entry.peer
                return self._send(frame, mac_bytes(backend.mac), backend.port or in_port,
                                  in_port, entry.backend_id, ("conn_hit",),
                                  lambda buf: self._translate(buf, key, peer, l4))
            if self.tables.nat.on_backend_down == NatDown.DROP:
                return Verdict("drop", "drop_backend_down", frame)
            self._delete(key)
            events = ("conn_reschedule",)
        elif entry is not None:
            # A VIP's 5-tuple that is some connection's reply key: lb_conn.h
            # names only original entries here; taken as that reply.
            return self._nat_reply(frame, key, tcp_flags, in_port, l4)

        state = conn_open_state(proto, tcp_flags)
        if state is None:
            return Verdict("drop", "drop_conn_invalid", frame, events=events)
        h = flow_hash(self.tables.hash_key, *key)
        backend_id = self._pick_hashed(vip.vip_id, h)
        backend = self.tables.backends.get(backend_id)
        # No NAT64: a backend of the other family is no backend (spec 3.).
        if backend is None or backend.addr.version != (6 if six else 4):
            return Verdict("drop", "drop_no_backend", frame, events=events)
        baddr: int | bytes = backend.addr.packed if six else int(backend.addr)
        bport = vip.nat_port or vip.port
        saddr, _, sport, _, _ = key
        # The reply key: it must be free (another connection's replies would
        # be told apart from this one's by nothing). Without SNAT there is one
        # candidate; taken (the same client address and port through two VIPs
        # to one backend port), the connection is refused like an exhausted
        # SNAT range: no reply key.
        def free(candidate: ConnKey) -> bool:
            return candidate != key and candidate not in conns

        flags = 0
        reply: ConnKey | None = None
        if vip.snat:
            pool = self._snat_pool(six)
            if pool:
                snat_addr = pool[snat_addr_index(h, len(pool))]
                for n in range(SNAT_PROBES):
                    port_n = snat_candidate(h, n, self.tables.nat.snat_port_min,
                                            self.tables.nat.snat_port_max)
                    if free(candidate := (baddr, snat_addr, bport, port_n, proto)):
                        reply = candidate
                        break
            flags = CONN_F_SNAT
        elif free(candidate := (baddr, saddr, bport, sport, proto)):
            reply = candidate
        if reply is None:
            return Verdict("drop", "drop_snat_exhausted", frame, events=events)
        if len(conns) + 2 > self.conn_capacity:
            if not self._evict_one(conns, fifo):
                return Verdict("drop", "drop_conn_full", frame, events=events)
            events += ("conn_evict",)
        client_mac = frame[6:12]
        conns[key] = ConnEntry(reply, CONN_ORIG, backend_id, vip.vip_id, state, 0,
                               client_mac, in_port, flags)
        conns[reply] = ConnEntry(key, CONN_REPLY, backend_id, vip.vip_id, state, 0,
                                 client_mac, in_port, flags)
        if state in EMBRYONIC:
            if len(fifo) >= self.conn_capacity:
                fifo.popleft()
            fifo.append(key)
        events += ("conn_new",)
        peer = reply
        return self._send(frame, mac_bytes(backend.mac), backend.port or in_port, in_port,
                          backend_id, events, lambda buf: self._translate(buf, key, peer, l4))

    def _snat_pool(self, six: bool) -> list[int | bytes]:
        """The SNAT pool of a family (NatConfig.snat_addrs' members of that
        family, in order): IPv4 as host ints, IPv6 as packed bytes."""
        addrs = self.tables.nat.snat_addrs
        if six:
            return [a.packed for a in addrs if a.version == 6]
        return [int(a) for a in addrs if a.version == 4]

    def _evict_one(self, conns: dict[Any, ConnEntry], fifo: collections.deque[Any]) -> bool:
        """lb_conn.h "Full table": up to CONN_EVICT_TRIES keys off the FIFO's
        head, the first still an embryonic connection evicted (both entries)."""
        for _ in range(CONN_EVICT_TRIES):
            if not fifo:
                return False
            key = fifo.popleft()
            entry = conns.get(key)
            if entry is not None and entry.dir == CONN_ORIG and entry.state in EMBRYONIC:
                self._delete(key)
                return True
        return False

    def _delete(self, orig_key: ConnKey) -> None:
        """Both entries of the connection whose original key is ``orig_key``."""
        conns, _ = self._table(orig_key)
        entry = conns.pop(orig_key)
        conns.pop(entry.peer, None)

    def _nat_reply(self, frame: bytes, key: ConnKey, tcp_flags: int, in_port: int,
                   l4: int = 0) -> Verdict:
        """lb_conn.h 2.: not to a VIP; a reply entry is translated back."""
        conns, _ = self._table(key)
        entry = conns.get(key)
        if entry is None or entry.dir != CONN_REPLY:
            return Verdict("pass", "pass_not_vip", frame)
        orig = conns[entry.peer]
        orig.state, orig.fin_dirs = conn_next_state(orig.state, orig.fin_dirs, CONN_REPLY,
                                                    key[4], tcp_flags)
        peer = entry.peer
        return self._send(frame, orig.client_mac, orig.client_port, in_port, orig.backend_id,
                          ("conn_reply",), lambda buf: self._translate(buf, key, peer, l4))

    def _nat_icmp(self, frame: bytes, ip_len: int, in_port: int) -> Verdict | None:
        """lb_conn.h 3.: an ICMP error quoting a connection's packet, sent
        where the found entry's peer came from; None: pass it."""
        ic = icmp_parse(frame, ETH_HLEN, ip_len)
        if ic is None:
            return None
        return self._icmp_error(frame, conn_icmp_key(ic), ic, in_port)

    def _nat6_icmp(self, frame: bytes, p: Parsed6, in_port: int) -> Verdict | None:
        """lb_conn.h 3. for ICMPv6 (spec 6.): the same, in the IPv6 table."""
        ic = icmp6_parse(frame, p)
        if ic is None:
            return None
        return self._icmp_error(frame, conn6_icmp_key(ic), ic, in_port)

    def _icmp_error(self, frame: bytes, key: ConnKey, ic: IcmpQuote | Icmp6Quote,
                    in_port: int) -> Verdict | None:
        """An error whose quote reversed is ``key``: to the client (a reply
        entry's) or the backend (an original entry's), the quote restored."""
        conns, _ = self._table(key)
        entry = conns.get(key)
        if entry is None:
            return None
        events = ("nat_icmp",)
        orig_key = entry.peer

        def restore(buf: bytearray) -> None:
            if isinstance(ic, Icmp6Quote):
                conn6_icmp_translate(buf, ic, orig_key)  # type: ignore[arg-type]
            else:
                conn_icmp_translate(buf, ic, orig_key)  # type: ignore[arg-type]

        if entry.dir == CONN_REPLY:  # about a packet sent towards the backend
            orig = conns[entry.peer]
            return self._send(frame, orig.client_mac, orig.client_port, in_port,
                              orig.backend_id, events, restore)
        backend = self.tables.backends.get(entry.backend_id)
        if backend is None:
            return Verdict("drop", "drop_tx_error", frame, events=events)
        return self._send(frame, mac_bytes(backend.mac), backend.port or in_port, in_port,
                          entry.backend_id, events, restore)

    # ---- the connection tables' figures --------------------------------------------

    def conn_stats(self) -> dict[str, object]:
        """struct lb_conn_stats as the stats reply's "conns" carries it: the
        sums over both families' tables (capacity: both tables')."""
        by_state = dict.fromkeys(CONN_STATE_NAMES, 0)
        snat = 0
        for entry in (*self.conns.values(), *self.conns6.values()):
            if entry.dir == CONN_ORIG:
                by_state[CONN_STATE_NAMES[entry.state]] += 1
                snat += bool(entry.flags & CONN_F_SNAT)
        return {"capacity": 2 * self.conn_capacity,
                "entries": len(self.conns) + len(self.conns6),
                "by_state": by_state, "snat_ports_in_use": snat, "expired": self.conns_expired}

    def conn_state(self, key: ConnKey) -> ConnState | None:
        """The state of the connection whose original key is ``key`` (an
        IPv4 FlowTuple or an IPv6 FlowKey6)."""
        entry = self._table(key)[0].get(key)
        return entry.state if entry is not None and entry.dir == CONN_ORIG else None

    def expire(self, key: ConnKey) -> None:
        """What the idle sweep does to the connection whose original key is
        ``key``: both entries removed, counted as expired."""
        self._delete(key)
        self.conns_expired += 1
