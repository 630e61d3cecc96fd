"""NAT mode's rules and IPv4 rewrites: ``lb_conn.h`` and ``lb_nat.h`` ported.

The reference model (``model.py``) runs the connection table; this module
holds what it calls per packet, each function a port of the C function it
names, operation for operation: the RFC 1624 arithmetic of ``lb_rewrite.h``
(so that the model equals the planes even where an incremental update and a
recomputation differ, a wrong incoming checksum), the IPv4 TCP/UDP rewrite,
the ICMPv4 error parse and rewrite, and the connection rules (open state,
state machine, SNAT candidates). The IPv6 rewrites are ``nat6.py``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from hpclb.contract.tables import IPPROTO_TCP, IPPROTO_UDP, ConnState

FlowTuple = tuple[int, int, int, int, int]  # saddr, daddr, sport, dport, proto (host ints)
#: An IPv6 connection's key (struct lb_flow_key, family 6): the addresses as
#: their 16 packed bytes.
FlowKey6 = tuple[bytes, bytes, int, int, int]
#: A connection-table key of either family (each family has its own table).
ConnKey = FlowTuple | FlowKey6
IP_MF = 0x2000
IP_OFFSET = 0x1FFF

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


def nat_udp_csum(check: int) -> int:
    """lb_nat_udp_csum: a computed UDP checksum of 0 is sent as 0xFFFF (0 is "none")."""
    return check if check else 0xFFFF


def nat_l4_csum(check: int, proto: int, old_addr: int, new_addr: int, old_port: int,
                new_port: int) -> int:
    """lb_nat_l4_csum: UDP's 0 ("none") stays 0, a computed 0 is sent as 0xFFFF."""
    if proto == IPPROTO_UDP and check == 0:
        return 0
    check = csum_replace4(check, old_addr, new_addr)
    check = csum_replace2(check, old_port, new_port)
    return nat_udp_csum(check) if proto == IPPROTO_UDP else check


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

    peer: ConnKey
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


