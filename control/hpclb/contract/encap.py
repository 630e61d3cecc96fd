"""Tunnel mode's encapsulation: ``dataplane/common/lb_encap.h`` ported byte for byte.

The reference model (``model.py``) builds with it the frame a data plane
sends for a tunnel VIP, and the conformance suite compares the two planes'
frames with that one; the header comment of ``lb_encap.h`` is the
specification (every outer field, the flow bits, the outer source).

The C code works on little-endian loads of network-order words; the values
here are the big-endian numbers those words hold, which give the same bytes
(``lb_tunnel_flow_bits`` says so itself: the XOR of the 16-bit words read as
big-endian numbers).
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from hpclb.contract.tables import (
    TUNNEL_SRC_BITS_MAX,
    Backend,
    Encap,
    IPAddress,
    Vip,
)

IPPROTO_IPIP = 4
IPPROTO_IPV6 = 41
IPPROTO_UDP = 17
TUNNEL_TTL = 64
IP_DF = 0x4000
GUE_SPORT_BASE = 49152
GUE_SPORT_MASK = 0x3FFF
ENCAP_V4_LEN = 20
ENCAP_V6_LEN = 40
ENCAP_UDP_LEN = 8
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD


@dataclass(frozen=True)
class EncapPlan:
    """struct lb_encap_plan, less the MACs (the caller's)."""

    src: IPAddress  # the outer source: lb_tunnel_src
    dst: IPAddress  # the backend's address
    encap: Encap
    inner_proto: int  # IPPROTO_IPIP (inner IPv4) or IPPROTO_IPV6
    tos: int  # the inner tos / traffic class
    inner_len: int  # the inner IP packet's own length (Ethernet padding excluded)
    flow_bits: int
    gue_port: int
    length: int  # bytes put in front of the inner packet: 20, 28, 40 or 48

    @property
    def outer_family(self) -> int:
        return self.dst.version


def tunnel_flow_bits(src: IPAddress, sport: int) -> int:
    """lb_tunnel_flow_bits: the XOR of the inner source address's 16-bit
    words and the inner source port, each a big-endian number."""
    raw = src.packed
    x = 0
    for (word,) in struct.iter_unpack("!H", raw):
        x ^= word
    return x ^ (sport & 0xFFFF)


def tunnel_src(base: IPAddress, bits: int, flow_bits: int) -> IPAddress:
    """lb_tunnel_src: ``base`` with the low ``bits`` bits of its last 16
    taken from the flow bits."""
    mask = 0xFFFF if bits >= 16 else (1 << bits) - 1
    raw = bytearray(base.packed)
    (last,) = struct.unpack_from("!H", raw, len(raw) - 2)
    last = (last & ~mask & 0xFFFF) | (flow_bits & mask)
    struct.pack_into("!H", raw, len(raw) - 2, last)
    return ipaddress.ip_address(bytes(raw))


def inner_tos(ip: bytes) -> int:
    """lb_inner_tos: IPv4's tos byte, IPv6's traffic class (the IP header
    at ``ip``; the parse put at least its first 20 bytes in the frame)."""
    if ip[0] >> 4 == 4:
        return ip[1]
    return ((ip[0] & 0x0F) << 4) | (ip[1] >> 4)


def encap_prepare(inner_src: IPAddress, sport: int, inner_len: int, tos: int, vip: Vip,
                  backend: Backend) -> EncapPlan | None:
    """lb_encap_prepare for a parsed TCP/UDP packet (source ``inner_src`` and
    port ``sport``, ``inner_len`` bytes long) going to ``backend`` of the
    tunnel VIP ``vip``; None where the plane drops it (drop_encap): IPv6
    inside IPv4, or a tunnel source (none counts as family 0) of another
    family than the backend's."""
    tunnel_family = vip.tunnel_src.version if vip.tunnel_src is not None else 0
    family = backend.addr.version
    if family != tunnel_family or vip.tunnel_src is None:
        return None
    if family == 4:
        if inner_src.version != 4:
            return None
        length = ENCAP_V4_LEN
    elif family == 6:
        length = ENCAP_V6_LEN
    else:  # pragma: no cover - an address is version 4 or 6
        return None
    if vip.tunnel_encap == Encap.GUE:
        length += ENCAP_UDP_LEN
    elif vip.tunnel_encap != Encap.IPIP:
        return None
    bits = min(vip.tunnel_src_bits, TUNNEL_SRC_BITS_MAX)
    flow_bits = tunnel_flow_bits(inner_src, sport)
    return EncapPlan(
        src=tunnel_src(vip.tunnel_src, bits, flow_bits),
        dst=backend.addr,
        encap=Encap(vip.tunnel_encap),
        inner_proto=IPPROTO_IPIP if inner_src.version == 4 else IPPROTO_IPV6,
        tos=tos & 0xFF,
        inner_len=inner_len & 0xFFFF,
        flow_bits=flow_bits,
        gue_port=vip.gue_port & 0xFFFF,
        length=length,
    )


def ipv4_hdr_csum(header: bytes) -> int:
    """lb_ipv4_hdr_csum: RFC 791's checksum of a 20-byte header whose
    checksum field is 0 (one's-complement sum of its words, folded twice)."""
    s = sum(w for (w,) in struct.iter_unpack("!H", header[:20]))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def encap_headers(e: EncapPlan, dst_mac: bytes, src_mac: bytes) -> bytes:
    """lb_encap_write: the Ethernet header and the outer headers, the bytes
    that go in front of the inner IP packet."""
    gue = e.encap == Encap.GUE
    if e.outer_family == 4:
        ethertype = ETH_P_IP
        hdr = bytearray(struct.pack(
            "!BBHHHBBH4s4s", 0x45, e.tos, (e.length + e.inner_len) & 0xFFFF, 0, IP_DF,
            TUNNEL_TTL, IPPROTO_UDP if gue else e.inner_proto, 0, e.src.packed, e.dst.packed))
        struct.pack_into("!H", hdr, 10, ipv4_hdr_csum(bytes(hdr)))
        outer = bytes(hdr)
    else:
        ethertype = ETH_P_IPV6
        vtf = (6 << 28) | (e.tos << 20) | e.flow_bits
        outer = struct.pack(
            "!IHBB16s16s", vtf, (e.length - ENCAP_V6_LEN + e.inner_len) & 0xFFFF,
            IPPROTO_UDP if gue else e.inner_proto, TUNNEL_TTL, e.src.packed, e.dst.packed)
    if gue:
        outer += struct.pack("!HHHH", GUE_SPORT_BASE + (e.flow_bits & GUE_SPORT_MASK),
                             e.gue_port, (ENCAP_UDP_LEN + e.inner_len) & 0xFFFF, 0)
    return dst_mac + src_mac + struct.pack("!H", ethertype) + outer
