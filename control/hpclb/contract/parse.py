"""IPv6's parse: ``lb_parse_ipv6`` (``dataplane/common/lb_parse.h``) ported.

The model's IPv4 parse lives in ``model.py`` (it came first); this is the
IPv6 side of ``lb_parse_untagged``: the header, the payload length, the
bounded walk of the extension-header chain, then the TCP/UDP ports, in the
C code's order, so that a frame wrong in two ways gets the C code's verdict.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from dataclasses import dataclass

from hpclb.contract.tables import IPPROTO_TCP, IPPROTO_UDP

IPV6_HLEN = 40
IPV6_MAX_EXT_HDRS = 8  # LB_IPV6_MAX_EXT_HDRS
IPPROTO_HOPOPTS = 0
IPPROTO_ROUTING = 43
IPPROTO_FRAGMENT = 44
IPPROTO_AH = 51
IPPROTO_DSTOPTS = 60
IPV6_EXT_HDRS = frozenset(
    (IPPROTO_HOPOPTS, IPPROTO_ROUTING, IPPROTO_FRAGMENT, IPPROTO_AH, IPPROTO_DSTOPTS))
IP6_MF = 0x0001
IP6_OFFSET = 0xFFF8
TCP_HLEN = 20
UDP_HLEN = 8


class ParseVerdict(enum.Enum):
    """enum lb_parse_verdict (those lb_parse_ipv6 returns)."""

    OK = "ok"
    MALFORMED = "malformed"
    UNSUPPORTED_L4 = "unsupported_l4"
    FRAGMENT = "fragment"
    EXT_TOO_LONG = "ext_too_long"


@dataclass(frozen=True)
class Parsed6:
    """What the planes read of struct lb_parsed after lb_parse_ipv6: ``proto``
    and ``l4`` (offset from the IPv6 header) with OK, UNSUPPORTED_L4 and
    FRAGMENT; the ports with OK only."""

    verdict: ParseVerdict
    src: ipaddress.IPv6Address | None = None
    dst: ipaddress.IPv6Address | None = None
    length: int = 0  # 40 + payload length: the packet's bytes; what follows is padding
    proto: int = 0
    l4: int = 0
    sport: int = 0
    dport: int = 0
    #: LB_PF_FRAGMENT with UNSUPPORTED_L4: a non-atomic fragment of another
    #: protocol (ICMPv6 included), which NAT never translates.
    fragment: bool = False


def _l4_supported(proto: int) -> bool:
    return proto in (IPPROTO_TCP, IPPROTO_UDP)


def parse_ipv6(ip: bytes) -> Parsed6:
    """lb_parse_ipv6 on ``ip``, the frame's bytes from the IPv6 header on."""
    bad = Parsed6(ParseVerdict.MALFORMED)
    if len(ip) < IPV6_HLEN or ip[0] >> 4 != 6:
        return bad
    src = ipaddress.IPv6Address(ip[8:24])
    dst = ipaddress.IPv6Address(ip[24:40])
    (payload_len,) = struct.unpack_from("!H", ip, 4)
    length = IPV6_HLEN + payload_len
    if length > len(ip):
        return bad
    nexthdr, off = ip[6], IPV6_HLEN
    for _ in range(IPV6_MAX_EXT_HDRS):
        if nexthdr not in IPV6_EXT_HDRS:
            break
        if off + 8 > length:  # each header's first 8 bytes inside the packet
            return bad
        if nexthdr == IPPROTO_FRAGMENT:
            (fo,) = struct.unpack_from("!H", ip, off + 2)
            nexthdr = ip[off]
            off += 8
            if fo & (IP6_OFFSET | IP6_MF):  # not an atomic fragment (RFC 6946)
                # A known other protocol wins over "fragment"; an extension
                # header in the fragmentable part hides the protocol.
                if not _l4_supported(nexthdr) and nexthdr not in IPV6_EXT_HDRS:
                    return Parsed6(ParseVerdict.UNSUPPORTED_L4, src, dst, length, nexthdr, off,
                                   fragment=True)
                return Parsed6(ParseVerdict.FRAGMENT, src, dst, length, nexthdr, off)
            continue
        hdrlen = ip[off + 1]
        # AH counts 4-byte units minus 2 (RFC 4302), the others 8-byte units
        # minus 1 (RFC 8200).
        size = (hdrlen + 2) * 4 if nexthdr == IPPROTO_AH else (hdrlen + 1) * 8
        nexthdr = ip[off]
        off += size
        if off > length:  # the next header's start; its bytes are checked above
            return bad
    if nexthdr in IPV6_EXT_HDRS:
        return Parsed6(ParseVerdict.EXT_TOO_LONG, src, dst, length)
    if not _l4_supported(nexthdr):
        return Parsed6(ParseVerdict.UNSUPPORTED_L4, src, dst, length, nexthdr, off)
    need = TCP_HLEN if nexthdr == IPPROTO_TCP else UDP_HLEN
    if off + need > length:
        return bad
    sport, dport = struct.unpack_from("!HH", ip, off)
    return Parsed6(ParseVerdict.OK, src, dst, length, nexthdr, off, sport, dport)
