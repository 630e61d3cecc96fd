"""NAT mode's IPv6 rewrites: ``lb_nat6.h`` (and lb_conn.h's IPv6 half) ported.

Each function follows the C function it names (``lb_nat6.h``) operation
for operation: the address is rewritten with ``lb_csum_replace16`` (sixteen
bytes, one fold) and the port with ``lb_csum_replace2``, so the L4 checksum
moves exactly as the planes move it, a wrong one staying exactly as wrong.
There is no IP header checksum in IPv6; the ICMPv6 checksum covers the
pseudo-header (RFC 4443 2.3), so rewriting the outer address of an ICMPv6
error updates it too.

The frames reaching these functions were accepted by ``parse.parse_ipv6``
and by the model's NAT checks (L4 header at most NAT6_MAX_L4_OFF into the
frame, not a fragment): as in ``nat.py``, the refusals of the C functions
(a header not in the frame, an offset past the bound) are the caller's
verdicts, never reached here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from hpclb.contract.nat import (
    ICMP_QUOTE_L4,
    NAT_DST,
    NAT_SRC,
    TCP_CSUM_END,
    FlowKey6,
    _put16,
    _u16,
    csum_fold,
    csum_replace2,
    nat_udp_csum,
)
from hpclb.contract.parse import IPV6_HLEN, Parsed6
from hpclb.contract.tables import IPPROTO_TCP, IPPROTO_UDP

ETH_HLEN = 14
#: LB_NAT6_MAX_L4_OFF (lb_nat.h): a NAT packet's L4 header starts at most 256
#: bytes of extension headers after an untagged IPv6 header; one beyond is
#: passed to the kernel (pass_ext_headers).
NAT6_MAX_EXT_LEN = 256
NAT6_MAX_L4_OFF = ETH_HLEN + IPV6_HLEN + NAT6_MAX_EXT_LEN
ICMP6_HLEN = 8
#: RFC 4443 error types that quote the offending packet: destination
#: unreachable, packet too big, time exceeded, parameter problem (any code).
ICMP6_ERRORS = (1, 2, 3, 4)
_SADDR, _DADDR = 8, 24  # the addresses in the IPv6 header
_L4_CSUM_OFF = {IPPROTO_TCP: 16, IPPROTO_UDP: 6}


def _words(addr: bytes) -> list[int]:
    return [int.from_bytes(addr[i : i + 2], "big") for i in range(0, 16, 2)]


def csum_replace16(check: int, old: bytes, new: bytes) -> int:
    """lb_csum_replace16: ``check`` after 16 bytes (an IPv6 address) change;
    the eight words summed, then one fold (not eight replace2 steps: the
    result can differ in the sign of zero)."""
    s = ~check & 0xFFFF
    for o, n in zip(_words(old), _words(new), strict=True):
        s += (~o & 0xFFFF) + n
    return ~csum_fold(s) & 0xFFFF


def nat6_l4_csum(check: int, proto: int, old_addr: bytes, new_addr: bytes, old_port: int,
                 new_port: int) -> int:
    """The L4 checksum after the address (pseudo-header) and the port change,
    with the v4 code's UDP rule: 0 stays 0, a computed 0 is written 0xFFFF."""
    if proto == IPPROTO_UDP and check == 0:
        return 0
    check = csum_replace16(check, old_addr, new_addr)
    check = csum_replace2(check, old_port, new_port)
    return nat_udp_csum(check) if proto == IPPROTO_UDP else check


def nat6_rewrite(buf: bytearray, l4: int, proto: int, side: int, addr: bytes,
                 port: int) -> None:
    """lb_nat6_rewrite on a frame accepted for NAT (its IPv6 header at
    ETH_HLEN, its TCP/UDP header at frame offset ``l4``): the ``side``
    address and port become addr:port, the L4 checksum updated."""
    l3 = ETH_HLEN
    a_off = l3 + (_SADDR if side == NAT_SRC else _DADDR)
    p_off = l4 + (0 if side == NAT_SRC else 2)
    c_off = l4 + _L4_CSUM_OFF[proto]
    old_addr, old_port = bytes(buf[a_off : a_off + 16]), _u16(buf, p_off)
    _put16(buf, c_off, nat6_l4_csum(_u16(buf, c_off), proto, old_addr, addr, old_port, port))
    buf[a_off : a_off + 16] = addr
    _put16(buf, p_off, port)


def conn6_translate(buf: bytearray, l4: int, key: FlowKey6, peer: FlowKey6) -> None:
    """lb_conn6_translate: the packet whose key is ``key`` leaves as ``peer``
    reversed; the destination first, each side only if it changes."""
    saddr, daddr, sport, dport, proto = key
    psaddr, pdaddr, psport, pdport, _ = peer
    if daddr != psaddr or dport != psport:
        nat6_rewrite(buf, l4, proto, NAT_DST, psaddr, psport)
    if saddr != pdaddr or sport != pdport:
        nat6_rewrite(buf, l4, proto, NAT_SRC, pdaddr, pdport)


def tcp_flags6(frame: bytes, p: Parsed6) -> int:
    """lb_tcp_flags for IPv6: byte 13 of the TCP header at the parse's l4
    (the parse checked 20 bytes of it), 0 for UDP."""
    return frame[ETH_HLEN + p.l4 + 13] if p.proto == IPPROTO_TCP else 0


# ---- ICMPv6 errors ---------------------------------------------------------------


@dataclass(frozen=True)
class Icmp6Quote:
    """struct lb_nat6_icmp: where an ICMPv6 error's quoted packet lies (frame offsets)."""

    l3_off: int
    icmp_off: int
    inner_l3_off: int
    inner_l4_off: int
    l4_quoted: int  # bytes of the quoted L4 header and data within the packet
    inner_proto: int
    inner_saddr: bytes
    inner_daddr: bytes
    inner_sport: int
    inner_dport: int


def icmp6_parse(frame: bytes, p: Parsed6) -> Icmp6Quote | None:
    """lb_nat6_icmp_parse for an unfragmented ICMPv6 packet (the parse gave
    UNSUPPORTED_L4 with proto 58, its L4 header within NAT6_MAX_L4_OFF);
    None for LB_NAT_NOT_APPLICABLE and LB_NAT_MALFORMED alike (the planes
    pass both: pass_not_vip)."""
    l3 = ETH_HLEN
    icmp = l3 + p.l4
    end = l3 + p.length  # the packet's end; what follows is padding
    if icmp + ICMP6_HLEN > end:
        return None  # malformed
    if frame[icmp] not in ICMP6_ERRORS:
        return None  # not an error: none of NAT's business
    inner = icmp + ICMP6_HLEN
    if inner + IPV6_HLEN > end:
        return None  # malformed: the quoted header is not whole
    inner_proto = frame[inner + 6]
    if frame[inner] >> 4 != 6 or inner_proto not in (IPPROTO_TCP, IPPROTO_UDP):
        return None  # an inner extension header included: not applicable
    (inner_plen,) = struct.unpack_from("!H", frame, inner + 4)
    if inner_plen < ICMP_QUOTE_L4:
        return None  # malformed: the quoted packet had no ports
    # The quote ends with the outer packet, or with the quoted packet if it
    # was quoted whole (then padding or RFC 4884 objects follow).
    inner_l4 = inner + IPV6_HLEN
    quote_end = min(end, inner_l4 + inner_plen)
    if quote_end < inner_l4 + ICMP_QUOTE_L4:
        return None  # malformed: no ports
    return Icmp6Quote(l3, icmp, inner, inner_l4, quote_end - inner_l4, inner_proto,
                      bytes(frame[inner + _SADDR : inner + _SADDR + 16]),
                      bytes(frame[inner + _DADDR : inner + _DADDR + 16]),
                      int.from_bytes(frame[inner_l4 : inner_l4 + 2], "big"),
                      int.from_bytes(frame[inner_l4 + 2 : inner_l4 + 4], "big"))


def icmp6_rewrite(buf: bytearray, ic: Icmp6Quote, side: int, addr: bytes, port: int,
                  outer_addr: bytes | None) -> None:
    """lb_nat6_icmp_rewrite: the quoted packet's ``side`` becomes addr:port
    (its L4 checksum when quoted: UDP always, TCP with 18 bytes), the ICMPv6
    checksum updated for every quoted word that changed and, unless
    ``outer_addr`` is None, for the outer address on the mirrored side
    (inner SRC -> outer DST, DST -> SRC), which then becomes it. The order
    of the C function's operations: new inner L4 checksum from the old
    fields; inner address, port, L4 checksum written; ICMPv6 checksum
    replace16(inner address), replace2(port), replace2(L4 checksum),
    replace16(outer address); written; the outer address written."""
    inner, l4 = ic.inner_l3_off, ic.inner_l4_off
    a_off = inner + (_SADDR if side == NAT_SRC else _DADDR)
    p_off = l4 + (0 if side == NAT_SRC else 2)
    c_off: int | None = None
    if ic.inner_proto == IPPROTO_UDP or ic.l4_quoted >= TCP_CSUM_END:
        c_off = l4 + _L4_CSUM_OFF[ic.inner_proto]
    old_addr, old_port = bytes(buf[a_off : a_off + 16]), _u16(buf, p_off)
    old_l4 = new_l4 = 0
    if c_off is not None:
        old_l4 = _u16(buf, c_off)
        new_l4 = nat6_l4_csum(old_l4, ic.inner_proto, old_addr, addr, old_port, port)
    buf[a_off : a_off + 16] = addr
    _put16(buf, p_off, port)
    if c_off is not None:
        _put16(buf, c_off, new_l4)
    check = _u16(buf, ic.icmp_off + 2)
    check = csum_replace16(check, old_addr, addr)
    check = csum_replace2(check, old_port, port)
    if c_off is not None:
        check = csum_replace2(check, old_l4, new_l4)
    o_off = ic.l3_off + (_DADDR if side == NAT_SRC else _SADDR)
    if outer_addr is not None:
        check = csum_replace16(check, bytes(buf[o_off : o_off + 16]), outer_addr)
    _put16(buf, ic.icmp_off + 2, check)
    if outer_addr is not None:
        buf[o_off : o_off + 16] = outer_addr


def conn6_icmp_key(ic: Icmp6Quote) -> FlowKey6:
    """lb_conn6_icmp_key: the quote reversed, the key of the other direction's entry."""
    return (ic.inner_daddr, ic.inner_saddr, ic.inner_dport, ic.inner_sport, ic.inner_proto)


def conn6_icmp_translate(buf: bytearray, ic: Icmp6Quote, orig: FlowKey6) -> None:
    """lb_conn6_icmp_translate: the quote becomes ``orig`` (the packet as it
    was sent before translation); the restored quoted destination carries
    the outer source along, the restored quoted source the outer destination."""
    osaddr, odaddr, osport, odport, _ = orig
    if ic.inner_daddr != odaddr or ic.inner_dport != odport:
        icmp6_rewrite(buf, ic, NAT_DST, odaddr, odport, odaddr)
    if ic.inner_saddr != osaddr or ic.inner_sport != osport:
        icmp6_rewrite(buf, ic, NAT_SRC, osaddr, osport, osaddr)
