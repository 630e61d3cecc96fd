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

NAT mode (a VIP with ``VipMode.NAT``, IPv4 only) is the stateful gateway of
``dataplane/common/lb_conn.h``, whose header comment is its specification;
the packet rewrites are ``lb_nat.h``'s, ported here byte for byte (RFC 1624
incremental checksum updates, never a recomputation: a wrong incoming
checksum stays exactly as wrong, a UDP checksum of 0 stays 0). The
connection table is a dict of entries keyed by 5-tuple, two per connection,
with the capacity a data plane's ``--conn-table-size`` gives it. Time plays
no part: the idle timeouts are a sweep outside the fast path, which the
model does not run (``expire`` removes a connection as the sweep would).
"""

from __future__ import annotations

import collections
import ipaddress
import struct
from collections import Counter
from dataclasses import dataclass, field

from hpclb.contract.encap import encap_headers, encap_prepare, inner_tos
from hpclb.contract.flowhash import flow_hash, probe_slot
from hpclb.contract.parse import ParseVerdict, parse_ipv6
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
IP_MF = 0x2000
IP_OFFSET = 0x1FFF
IPPROTO_ICMP = 1
IPPROTO_ICMPV6 = 58

FlowTuple = tuple[int, int, int, int, int]  # saddr, daddr, sport, dport, proto (host ints)
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


# ---- RFC 1624 arithmetic (lb_rewrite.h) ------------------------------------
#
# lb_rewrite.h works on 16-bit words as they lie in memory; a one's-complement
# sum commutes with swapping the bytes of every word, so the same arithmetic
# on big-endian words gives the same bytes. Ported operation for operation
# (eqn. 3, the two folds), so the model equals the planes even where an
# incremental update and a recomputation differ (a wrong incoming checksum).


def csum_fold(s: int) -> int:
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return s & 0xFFFF


def csum_replace2(check: int, old: int, new: int) -> int:
    """lb_csum_replace2: ``check`` after a 16-bit word goes from ``old`` to ``new``."""
    s = (~check & 0xFFFF) + (~old & 0xFFFF) + new
    return ~csum_fold(s) & 0xFFFF


def csum_replace4(check: int, old: int, new: int) -> int:
    """lb_csum_replace4: ``check`` after 4 bytes (an IPv4 address) change."""
    s = (~check & 0xFFFF) + (~(old >> 16) & 0xFFFF) + (~old & 0xFFFF)
    s += (new >> 16) + (new & 0xFFFF)
    return ~csum_fold(s) & 0xFFFF


def nat_l4_csum(check: int, proto: int, old_addr: int, new_addr: int, old_port: int,
                new_port: int) -> int:
    """lb_nat_l4_csum: UDP's 0 ("none") stays 0, a computed 0 is sent as 0xFFFF."""
    if proto == IPPROTO_UDP and check == 0:
        return 0
    check = csum_replace4(check, old_addr, new_addr)
    check = csum_replace2(check, old_port, new_port)
    if proto == IPPROTO_UDP and check == 0:
        return 0xFFFF
    return check


def _u16(buf: bytearray, off: int) -> int:
    return int.from_bytes(buf[off : off + 2], "big")


def _u32(buf: bytearray, off: int) -> int:
    return int.from_bytes(buf[off : off + 4], "big")


def _put16(buf: bytearray, off: int, v: int) -> None:
    buf[off : off + 2] = v.to_bytes(2, "big")


def _put32(buf: bytearray, off: int, v: int) -> None:
    buf[off : off + 4] = v.to_bytes(4, "big")


NAT_SRC = 1  # enum lb_nat_side
NAT_DST = 2
_L4_CSUM_OFF = {IPPROTO_TCP: 16, IPPROTO_UDP: 6}


def nat4_rewrite(buf: bytearray, l3: int, proto: int, side: int, addr: int, port: int) -> None:
    """lb_nat4_rewrite on a frame the parse accepted (IPv4 TCP/UDP, not a
    fragment, the L4 header within the packet): the ``side`` address and
    port become addr:port, the IPv4 and L4 checksums updated."""
    l4 = l3 + (buf[l3] & 0xF) * 4
    a_off = l3 + (12 if side == NAT_SRC else 16)
    p_off = l4 + (0 if side == NAT_SRC else 2)
    c_off = l4 + _L4_CSUM_OFF[proto]
    old_addr, old_port = _u32(buf, a_off), _u16(buf, p_off)
    _put16(buf, l3 + 10, csum_replace4(_u16(buf, l3 + 10), old_addr, addr))
    _put32(buf, a_off, addr)
    _put16(buf, c_off, nat_l4_csum(_u16(buf, c_off), proto, old_addr, addr, old_port, port))
    _put16(buf, p_off, port)


def conn_translate(buf: bytearray, l3: int, key: FlowTuple, peer: FlowTuple) -> None:
    """lb_conn_translate: the packet whose 5-tuple is ``key`` leaves as
    ``peer`` reversed; the destination first, each side only if it changes."""
    saddr, daddr, sport, dport, proto = key
    psaddr, pdaddr, psport, pdport, _ = peer
    if daddr != psaddr or dport != psport:
        nat4_rewrite(buf, l3, proto, NAT_DST, psaddr, psport)
    if saddr != pdaddr or sport != pdport:
        nat4_rewrite(buf, l3, proto, NAT_SRC, pdaddr, pdport)


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


# ---- ICMP errors (lb_nat.h) -------------------------------------------------

ICMP_ERRORS = (3, 11, 12)  # destination unreachable, time exceeded, parameter problem
ICMP_QUOTE_L4 = 8
TCP_CSUM_END = 18


@dataclass(frozen=True)
class IcmpQuote:
    """struct lb_nat4_icmp: where an ICMP error's quoted packet lies (frame offsets)."""

    l3_off: int
    icmp_off: int
    inner_l3_off: int
    inner_l4_off: int
    l4_quoted: int
    inner_proto: int
    inner_saddr: int
    inner_daddr: int
    inner_sport: int
    inner_dport: int


def icmp_parse(frame: bytes, l3: int, ip_len: int) -> IcmpQuote | None:
    """lb_nat4_icmp_parse for an unfragmented IPv4 ICMP packet whose header and
    total length the parse checked; None for LB_NAT_NOT_APPLICABLE and
    LB_NAT_MALFORMED alike (the data planes pass both to the kernel)."""
    ihl = (frame[l3] & 0xF) * 4
    icmp = l3 + ihl
    if ip_len < ihl + 8:
        return None  # malformed
    if frame[icmp] not in ICMP_ERRORS:
        return None  # not an error: none of NAT's business
    inner = icmp + 8
    if ip_len < ihl + 8 + 20:
        return None  # malformed
    if frame[inner] >> 4 != 4 or frame[inner] & 0xF < 5:
        return None  # malformed
    inner_proto = frame[inner + 9]
    if inner_proto not in (IPPROTO_TCP, IPPROTO_UDP):
        return None
    (frag,) = struct.unpack_from("!H", frame, inner + 6)
    if frag & IP_OFFSET:
        return None  # a later fragment quotes no ports
    inner_ihl = (frame[inner] & 0xF) * 4
    (inner_len,) = struct.unpack_from("!H", frame, inner + 2)
    if inner_len < inner_ihl + ICMP_QUOTE_L4:
        return None  # malformed
    inner_l4 = inner + inner_ihl
    quote_end = min(l3 + ip_len, inner + inner_len)
    if quote_end < inner_l4 + ICMP_QUOTE_L4:
        return None  # malformed
    saddr, daddr = struct.unpack_from("!II", frame, inner + 12)
    sport, dport = struct.unpack_from("!HH", frame, inner_l4)
    return IcmpQuote(l3, icmp, inner, inner_l4, quote_end - inner_l4, inner_proto,
                     saddr, daddr, sport, dport)


def icmp_rewrite(buf: bytearray, ic: IcmpQuote, side: int, addr: int, port: int,
                 outer_addr: int) -> None:
    """lb_nat4_icmp_rewrite: the quoted packet's ``side`` becomes addr:port
    (its IP checksum, its L4 checksum when quoted, the ICMP checksum updated);
    unless outer_addr is 0, the outer header's mirrored address becomes it."""
    inner, l4 = ic.inner_l3_off, ic.inner_l4_off
    a_off = inner + (12 if side == NAT_SRC else 16)
    p_off = l4 + (0 if side == NAT_SRC else 2)
    c_off: int | None = None
    if ic.inner_proto == IPPROTO_UDP or ic.l4_quoted >= TCP_CSUM_END:
        c_off = l4 + _L4_CSUM_OFF[ic.inner_proto]
    old_addr, old_port = _u32(buf, a_off), _u16(buf, p_off)
    old_ip_check = _u16(buf, inner + 10)
    new_ip_check = csum_replace4(old_ip_check, old_addr, addr)
    old_l4 = new_l4 = 0
    if c_off is not None:
        old_l4 = _u16(buf, c_off)
        new_l4 = nat_l4_csum(old_l4, ic.inner_proto, old_addr, addr, old_port, port)
    _put16(buf, inner + 10, new_ip_check)
    _put32(buf, a_off, addr)
    _put16(buf, p_off, port)
    if c_off is not None:
        _put16(buf, c_off, new_l4)
    check = _u16(buf, ic.icmp_off + 2)
    check = csum_replace4(check, old_addr, addr)
    check = csum_replace2(check, old_port, port)
    check = csum_replace2(check, old_ip_check, new_ip_check)
    if c_off is not None:
        check = csum_replace2(check, old_l4, new_l4)
    _put16(buf, ic.icmp_off + 2, check)
    if outer_addr:
        l3 = ic.l3_off
        o_off = l3 + (16 if side == NAT_SRC else 12)  # inner SRC -> outer DST, DST -> SRC
        _put16(buf, l3 + 10, csum_replace4(_u16(buf, l3 + 10), _u32(buf, o_off), outer_addr))
        _put32(buf, o_off, outer_addr)


def conn_icmp_key(ic: IcmpQuote) -> FlowTuple:
    """lb_conn_icmp_key: the quote reversed, the key of the other direction's entry."""
    return (ic.inner_daddr, ic.inner_saddr, ic.inner_dport, ic.inner_sport, ic.inner_proto)


def conn_icmp_translate(buf: bytearray, ic: IcmpQuote, orig: FlowTuple) -> None:
    """lb_conn_icmp_translate: the quote becomes ``orig``, the packet as it was
    sent before translation; each restored quoted field carries its mirrored
    outer field along."""
    osaddr, odaddr, osport, odport, _ = orig
    if ic.inner_daddr != odaddr or ic.inner_dport != odport:
        icmp_rewrite(buf, ic, NAT_DST, odaddr, odport, odaddr)
    if ic.inner_saddr != osaddr or ic.inner_sport != osport:
        icmp_rewrite(buf, ic, NAT_SRC, osaddr, osport, osaddr)


# ---- connection rules (lb_conn.h) --------------------------------------------

CONN_ORIG = 0  # enum lb_conn_dir
CONN_REPLY = 1
TCP_FIN = 0x01
TCP_SYN = 0x02
TCP_RST = 0x04
TCP_ACK = 0x10
EMBRYONIC = (ConnState.SYN_SENT, ConnState.SYN_RECV, ConnState.UDP_UNREPLIED)


def conn_open_state(proto: int, tcp_flags: int) -> ConnState | None:
    """lb_conn_open_state; None is LB_CONN_NO_STATE."""
    if proto == IPPROTO_UDP:
        return ConnState.UDP_UNREPLIED
    if tcp_flags & TCP_RST:
        return None
    if tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN:
        return ConnState.SYN_SENT
    return ConnState.ESTABLISHED


def conn_next_state(state: ConnState, fin_dirs: int, direction: int, proto: int,
                    tcp_flags: int) -> tuple[ConnState, int]:
    """lb_conn_next_state: (the new state, the new fin_dirs)."""
    if proto == IPPROTO_UDP:
        if state == ConnState.UDP_UNREPLIED and direction == CONN_REPLY:
            return ConnState.UDP_REPLIED, fin_dirs
        return state, fin_dirs
    if tcp_flags & TCP_RST:
        return ConnState.CLOSE, fin_dirs
    syn_ack = tcp_flags & (TCP_SYN | TCP_ACK)
    if (state in (ConnState.TIME_WAIT, ConnState.CLOSE) and direction == CONN_ORIG
            and syn_ack == TCP_SYN):
        return ConnState.SYN_SENT, 0
    if state == ConnState.SYN_SENT:
        if direction == CONN_REPLY and syn_ack == TCP_SYN | TCP_ACK:
            return ConnState.SYN_RECV, fin_dirs
        return state, fin_dirs
    if state == ConnState.SYN_RECV and direction == CONN_ORIG and syn_ack == TCP_ACK:
        state = ConnState.ESTABLISHED
    if tcp_flags & TCP_FIN and state in (ConnState.ESTABLISHED, ConnState.SYN_RECV,
                                         ConnState.FIN_WAIT):
        fin_dirs |= 1 << (direction & 1)
        return (ConnState.TIME_WAIT if fin_dirs == 3 else ConnState.FIN_WAIT), fin_dirs
    return state, fin_dirs


def snat_candidate(h: int, n: int, port_min: int, port_max: int) -> int:
    """lb_snat_candidate: the n-th SNAT port tried (u64 sum, then % range)."""
    return port_min + ((h + n) & 0xFFFFFFFFFFFFFFFF) % (port_max - port_min + 1)


def snat_addr_index(h: int, naddrs: int) -> int:
    """lb_snat_addr_index."""
    return (h >> 32) % naddrs if naddrs else 0


@dataclass
class ConnEntry:
    """struct lb_conn: one direction's entry. The state and fin_dirs live in
    the original entry (a reply entry's stay as created)."""

    peer: FlowTuple
    dir: int
    backend_id: int
    vip_id: int
    state: ConnState
    fin_dirs: int
    client_mac: bytes
    client_port: int
    flags: int


def tcp_flags_of(ip: bytes, ihl: int, proto: int) -> int:
    """lb_tcp_flags: byte 13 of the TCP header (the parse checked 20 bytes), 0 for UDP."""
    return ip[ihl * 4 + 13] if proto == IPPROTO_TCP else 0


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
    #: NAT connection-table entries (two per connection): the planes'
    #: --conn-table-size / DpdkLaunch.conn_table_size.
    conn_capacity: int = CONN_TABLE_DEFAULT
    conns: dict[FlowTuple, ConnEntry] = field(default_factory=dict)
    #: Original keys of embryonic connections in creation order, at most
    #: conn_capacity of them (a push onto a full FIFO drops the oldest).
    conn_fifo: collections.deque[FlowTuple] = field(default_factory=collections.deque)
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
        as the target, valid options (none of length 0, none past the
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
        """An untagged IPv6 frame: lb_parse_ipv6's verdict, then DSR or tunnel
        mode for TCP/UDP to an IPv6 VIP (NAT VIPs are IPv4 only)."""
        p = parse_ipv6(frame[ETH_HLEN:])
        if p.verdict == ParseVerdict.MALFORMED:
            return Verdict("drop", "drop_malformed", frame)
        if p.verdict == ParseVerdict.EXT_TOO_LONG:
            return Verdict("pass", "pass_ext_headers", frame)
        if p.verdict == ParseVerdict.FRAGMENT:
            return Verdict("pass", "pass_fragment", frame)
        if p.verdict == ParseVerdict.UNSUPPORTED_L4:
            if p.proto == IPPROTO_ICMPV6 and self.answers_arp:
                reply = self._ndp_reply(frame, p.length, in_port)
                if reply is not None:
                    return Verdict("tx", "ndp_reply", reply, port=in_port)
            return Verdict("pass", "pass_not_vip", frame)
        assert p.src is not None and p.dst is not None
        vip = self.tables.vip_for(p.dst, p.dport, p.proto)
        if vip is None:
            return Verdict("pass", "pass_not_vip", frame)
        if vip.mode == VipMode.NAT:
            raise ValueError(f"VIP {vip.vip_id}: NAT mode is IPv4 only (the protocol refuses it)")
        flow: FlowKey = (p.src.packed, p.dst.packed, p.sport, p.dport, p.proto)
        return self._dsr(frame, flow, vip, in_port, p.length)

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

    def _send(self, frame: bytes, dst_mac: bytes, port: int, in_port: int,
              key: FlowTuple | None, peer: FlowTuple | None, backend_id: int,
              events: tuple[str, ...], icmp: IcmpQuote | None = None,
              icmp_orig: FlowTuple | None = None) -> Verdict:
        """Translate and send out of ``port``: XDP_TX (fwd_tx) when that is the
        port the frame came in on, else a redirect (fwd_redirect)."""
        if port >= len(self.port_macs):
            return Verdict("drop", "drop_tx_error", frame, events=events)
        buf = bytearray(frame)
        buf[0:6] = dst_mac
        buf[6:12] = mac_bytes(self.port_macs[port])
        if icmp is not None and icmp_orig is not None:
            conn_icmp_translate(buf, icmp, icmp_orig)
        elif key is not None and peer is not None:
            conn_translate(buf, ETH_HLEN, key, peer)
        action, reason = ("tx", "fwd_tx") if port == in_port else ("redirect", "fwd_redirect")
        return Verdict(action, reason, bytes(buf), backend_id, port, events)

    def _nat_orig(self, frame: bytes, key: FlowTuple, vip: Vip, tcp_flags: int,
                  in_port: int) -> Verdict:
        """lb_conn.h 1.: a frame to a NAT VIP."""
        proto = key[4]
        events: tuple[str, ...] = ()
        entry = self.conns.get(key)
        if entry is not None and entry.dir == CONN_ORIG:
            if self._serving(entry.backend_id):
                entry.state, entry.fin_dirs = conn_next_state(
                    entry.state, entry.fin_dirs, CONN_ORIG, proto, tcp_flags)
                backend = self.tables.backends[entry.backend_id]
                port = backend.port or in_port
                return self._send(frame, mac_bytes(backend.mac), port, in_port, key, entry.peer,
                                  entry.backend_id, ("conn_hit",))
            if self.tables.nat.on_backend_down == NatDown.DROP:
                return Verdict("drop", "drop_backend_down", frame)
            self._delete(key)
            events = ("conn_reschedule",)
        elif entry is not None:
            # A VIP's 5-tuple that is some connection's reply key: lb_conn.h
            # names only original entries here; taken as that reply.
            return self._nat_reply(frame, key, tcp_flags, in_port)

        state = conn_open_state(proto, tcp_flags)
        if state is None:
            return Verdict("drop", "drop_conn_invalid", frame, events=events)
        h = flow_hash(self.tables.hash_key, *key)
        backend_id = self._pick_hashed(vip.vip_id, h)
        if backend_id == NO_BACKEND:
            return Verdict("drop", "drop_no_backend", frame, events=events)
        backend = self.tables.backends[backend_id]
        baddr = int(ipaddress.IPv4Address(backend.addr))
        bport = vip.nat_port or vip.port
        saddr, _, sport, _, _ = key
        # The reply key: it must be free (another connection's replies would
        # be told apart from this one's by nothing). Without SNAT there is one
        # candidate; taken (the same client address and port through two VIPs
        # to one backend port), the connection is refused like an exhausted
        # SNAT range: no reply key.
        def free(candidate: FlowTuple) -> bool:
            return candidate != key and candidate not in self.conns

        flags = 0
        reply: FlowTuple | None = None
        if vip.snat:
            nat = self.tables.nat
            if nat.snat_addrs:
                snat_addr = int(nat.snat_addrs[snat_addr_index(h, len(nat.snat_addrs))])
                for n in range(SNAT_PROBES):
                    port_n = snat_candidate(h, n, nat.snat_port_min, nat.snat_port_max)
                    if free(candidate := (baddr, snat_addr, bport, port_n, proto)):
                        reply = candidate
                        break
            flags = CONN_F_SNAT
        elif free(candidate := (baddr, saddr, bport, sport, proto)):
            reply = candidate
        if reply is None:
            return Verdict("drop", "drop_snat_exhausted", frame, events=events)
        if len(self.conns) + 2 > self.conn_capacity:
            if not self._evict_one():
                return Verdict("drop", "drop_conn_full", frame, events=events)
            events += ("conn_evict",)
        client_mac = frame[6:12]
        self.conns[key] = ConnEntry(reply, CONN_ORIG, backend_id, vip.vip_id, state, 0,
                                    client_mac, in_port, flags)
        self.conns[reply] = ConnEntry(key, CONN_REPLY, backend_id, vip.vip_id, state, 0,
                                      client_mac, in_port, flags)
        if state in EMBRYONIC:
            if len(self.conn_fifo) >= self.conn_capacity:
                self.conn_fifo.popleft()
            self.conn_fifo.append(key)
        events += ("conn_new",)
        port = backend.port or in_port
        return self._send(frame, mac_bytes(backend.mac), port, in_port, key, reply, backend_id,
                          events)

    def _evict_one(self) -> bool:
        """lb_conn.h "Full table": up to CONN_EVICT_TRIES keys off the FIFO's
        head, the first still an embryonic connection evicted (both entries)."""
        for _ in range(CONN_EVICT_TRIES):
            if not self.conn_fifo:
                return False
            key = self.conn_fifo.popleft()
            entry = self.conns.get(key)
            if entry is not None and entry.dir == CONN_ORIG and entry.state in EMBRYONIC:
                self._delete(key)
                return True
        return False

    def _delete(self, orig_key: FlowTuple) -> None:
        """Both entries of the connection whose original key is ``orig_key``."""
        entry = self.conns.pop(orig_key)
        self.conns.pop(entry.peer, None)

    def _nat_reply(self, frame: bytes, key: FlowTuple, tcp_flags: int, in_port: int) -> Verdict:
        """lb_conn.h 2.: not to a VIP; a reply entry is translated back."""
        entry = self.conns.get(key)
        if entry is None or entry.dir != CONN_REPLY:
            return Verdict("pass", "pass_not_vip", frame)
        orig = self.conns[entry.peer]
        orig.state, orig.fin_dirs = conn_next_state(orig.state, orig.fin_dirs, CONN_REPLY,
                                                    key[4], tcp_flags)
        return self._send(frame, orig.client_mac, orig.client_port, in_port, key, entry.peer,
                          orig.backend_id, ("conn_reply",))

    def _nat_icmp(self, frame: bytes, ip_len: int, in_port: int) -> Verdict | None:
        """lb_conn.h 3.: an ICMP error quoting a connection's packet, sent
        where the found entry's peer came from; None: pass it."""
        ic = icmp_parse(frame, ETH_HLEN, ip_len)
        if ic is None:
            return None
        entry = self.conns.get(conn_icmp_key(ic))
        if entry is None:
            return None
        events = ("nat_icmp",)
        if entry.dir == CONN_REPLY:  # about a packet sent towards the backend
            orig = self.conns[entry.peer]
            return self._send(frame, orig.client_mac, orig.client_port, in_port, None, None,
                              orig.backend_id, events, ic, entry.peer)
        backend = self.tables.backends.get(entry.backend_id)
        if backend is None:
            return Verdict("drop", "drop_tx_error", frame, events=events)
        return self._send(frame, mac_bytes(backend.mac), backend.port or in_port, in_port,
                          None, None, entry.backend_id, events, ic, entry.peer)

    # ---- the connection table's figures -------------------------------------------

    def conn_stats(self) -> dict[str, object]:
        """struct lb_conn_stats as the stats reply's "conns" carries it."""
        by_state = dict.fromkeys(CONN_STATE_NAMES, 0)
        snat = 0
        for entry in self.conns.values():
            if entry.dir == CONN_ORIG:
                by_state[CONN_STATE_NAMES[entry.state]] += 1
                snat += bool(entry.flags & CONN_F_SNAT)
        return {"capacity": self.conn_capacity, "entries": len(self.conns),
                "by_state": by_state, "snat_ports_in_use": snat, "expired": self.conns_expired}

    def conn_state(self, key: FlowTuple) -> ConnState | None:
        """The state of the connection whose original key is ``key``."""
        entry = self.conns.get(key)
        return entry.state if entry is not None and entry.dir == CONN_ORIG else None

    def expire(self, key: FlowTuple) -> None:
        """What the idle sweep does to the connection whose original key is
        ``key``: both entries removed, counted as expired."""
        self._delete(key)
        self.conns_expired += 1
