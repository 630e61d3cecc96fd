"""One set of packet cases, run against the model and every data plane.

Each case drives the harness, which sends every frame to the model and to the
data plane under test and fails on the first byte they disagree on. The
asserts written here are the semantics themselves (docs/ARCHITECTURE.md), checked on the
model's verdicts, which the data plane just matched.

A family-neutral case takes the ``family`` fixture and runs twice: as
written (IPv4) and as its IPv6 twin, every address through ``harness.v6``
(198.B.C.D -> fd00:B:C::D) on ``base_tables(family=6)``. The cases of one
family's header (IPv4 options and IHL, IPv6 extension headers) are written
for each.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable

import pytest
from scapy.layers.inet import IP, TCP, UDP, IPOption_NOP
from scapy.layers.inet6 import (
    ICMPv6EchoRequest,
    ICMPv6ND_NA,
    ICMPv6ND_NS,
    ICMPv6NDOptDstLLAddr,
    ICMPv6NDOptSrcLLAddr,
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    IPv6ExtHdrRouting,
    PadN,
)
from scapy.layers.ipsec import AH
from scapy.layers.l2 import ARP, Dot1Q, Ether
from scapy.packet import Packet
from scapy.pton_ntop import inet_ntop, inet_pton
from scapy.utils6 import in6_getnsma, in6_getnsmac

from hpclb.contract.model import Verdict
from hpclb.contract.tables import BackendState

from .harness import (
    BACKEND6_MACS,
    BACKEND_MACS,
    CLIENT_MAC,
    Harness,
    addr_of,
    base_tables,
    dual_tables,
    ip_layer,
    tcp,
    udp,
)

ETH = Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01")


def icmp_echo(family: int, src: str, dst: str) -> bytes:
    """An ICMP (IPv4) or ICMPv6 echo request: no VIP's protocol."""
    if family == 4:
        return bytes(ETH / IP(src=src, dst=dst, proto=1) / b"\x08\x00ping")
    return bytes(ETH / IPv6(src=src, dst=dst) / ICMPv6EchoRequest())


def fragments(family: int, src: str, dst: str, sport: int) -> tuple[bytes, bytes]:
    """A UDP datagram's first fragment (ports inside) and a later one."""
    if family == 4:
        return (bytes(ETH / IP(src=src, dst=dst, flags="MF") / UDP(sport=sport, dport=53)
                      / (b"x" * 64)),
                bytes(ETH / IP(src=src, dst=dst, frag=8, proto=17) / (b"y" * 64)))
    return (bytes(ETH / IPv6(src=src, dst=dst) / IPv6ExtHdrFragment(m=1, id=7)
                  / UDP(sport=sport, dport=53) / (b"x" * 64)),
            bytes(ETH / IPv6(src=src, dst=dst) / IPv6ExtHdrFragment(offset=9, nh=17, id=7)
                  / (b"y" * 64)))


def with_ip_length(frame: bytes, ip_len: int) -> bytes:
    """The frame with its IP header's length field saying the packet is
    ``ip_len`` bytes (IPv4 total length; IPv6 40 + payload length)."""
    out = bytearray(frame)
    if out[12:14] == b"\x86\xdd":
        struct.pack_into("!H", out, 14 + 4, ip_len - 40)
    else:
        struct.pack_into("!H", out, 14 + 2, ip_len)
    return bytes(out)


def ip_hlen(family: int) -> int:
    return 20 if family == 4 else 40


def test_tcp_to_vip_goes_to_a_backend(harness: Harness, family: int) -> None:
    harness.load(base_tables(family=family))
    frame = tcp(addr_of(family, "198.19.1.1"), 40000)
    v = harness.send(frame)
    assert v.action == "tx" and v.backend_id in (0, 1, 2)
    assert v.frame[:6] == bytes.fromhex(BACKEND_MACS[v.backend_id].replace(":", ""))
    assert v.frame[12:] == frame[12:], "DSR touches only the MACs"


def test_udp_to_vip_goes_to_a_backend(harness: Harness, family: int) -> None:
    harness.load(base_tables(family=family))
    src = addr_of(family, "198.19.2.1")
    seen = {harness.send(udp(src, 1000 + i)).backend_id for i in range(60)}
    assert seen == {0, 1, 2}


def test_flows_spread_over_the_ring(harness: Harness, family: int) -> None:
    harness.load(base_tables({0: 1.0, 1: 2.0, 2: 3.0}, family=family))
    counts = {0: 0, 1: 0, 2: 0}
    src = addr_of(family, "198.19.3.1")
    for i in range(600):
        counts[harness.backend_of(tcp(src, 1024 + i))] += 1  # type: ignore[index]
    assert counts[0] < counts[1] < counts[2]


def test_non_vip_ip_passes(harness: Harness, family: int) -> None:
    harness.load(base_tables(family=family))
    src = addr_of(family, "198.19.4.1")
    v = harness.send(tcp(src, 4000, dst=addr_of(family, "198.18.0.3")))
    assert (v.action, v.reason) == ("pass", "pass_not_vip")
    v = harness.send(icmp_echo(family, src, addr_of(family, "198.18.1.10")))
    assert (v.action, v.reason) == ("pass", "pass_not_vip")


def test_vip_address_on_unconfigured_port_passes(harness: Harness, family: int) -> None:
    harness.load(base_tables(family=family))
    src = addr_of(family, "198.19.5.1")
    v = harness.send(tcp(src, 5000, dport=81))
    assert (v.action, v.reason) == ("pass", "pass_not_vip")
    v = harness.send(udp(src, 5000, dport=80))  # TCP port, UDP protocol
    assert (v.action, v.reason) == ("pass", "pass_not_vip")


def test_non_ip_and_tagged_frames_pass(harness: Harness) -> None:
    """ARP, and VLAN-tagged frames of either family even to a VIP: the
    planes balance untagged IP only."""
    harness.load(dual_tables())
    arp = bytes(Ether(src=CLIENT_MAC, dst="ff:ff:ff:ff:ff:ff") / ARP(pdst="198.18.0.1"))
    tagged = [bytes(Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01") / Dot1Q(vlan=7)
                    / ip_layer(src, dst) / TCP(sport=6000, dport=80))
              for src, dst in (("198.19.6.1", "198.18.1.10"), ("fd00:19::1", "fd00:18::10"))]
    for frame in (arp, *tagged):
        v = harness.send(frame)
        assert (v.action, v.reason, v.frame) == ("pass", "pass_not_ipv4", frame)


def test_ipv6_frames_to_an_ipv6_vip_are_balanced(harness: Harness) -> None:
    """IPv6 TCP/UDP to an IPv6 VIP is balanced in DSR mode like IPv4: only
    the MACs change, to one of the VIP's (IPv6) backends'."""
    harness.load(dual_tables())
    to_vip = [
        bytes(ETH / IPv6(src=f"fd00:19::{i + 1}", dst="fd00:18::10")
              / TCP(sport=40000 + i, dport=80, flags="S"))
        for i in range(16)
    ] + [bytes(ETH / IPv6(src="fd00:19::1", dst="fd00:18::10") / UDP(sport=1000 + i, dport=53)
               / b"query") for i in range(16)]
    seen = set()
    for frame in to_vip:
        v = harness.send(frame)
        assert (v.action, v.reason) == ("tx", "fwd_tx")
        assert v.backend_id in BACKEND6_MACS
        assert v.frame[:6] == bytes.fromhex(BACKEND6_MACS[v.backend_id].replace(":", ""))
        assert v.frame[6:12] == bytes.fromhex(harness.port_macs[0].replace(":", ""))
        assert v.frame[12:] == frame[12:]
        seen.add(v.backend_id)
    assert seen == set(BACKEND6_MACS)


def test_ipv4_unchanged_next_to_ipv6_vips(harness: Harness) -> None:
    """IPv4 flows reach the same backends whether or not IPv6 VIPs and
    backends share the tables (the IPv4 flow hash is protocol 1's)."""
    flows = [tcp(f"198.19.20.{1 + i % 200}", 2000 + i) for i in range(120)]
    flows += [udp(f"198.19.21.{1 + i}", 3000 + i) for i in range(40)]
    alone = Harness(None, harness.port_macs)
    alone.load(base_tables())
    expected = [alone.send(f) for f in flows]
    harness.load(dual_tables())
    for frame, before in zip(flows, expected, strict=True):
        v = harness.send(frame)
        assert (v.action, v.reason, v.backend_id, v.frame) == (
            before.action, before.reason, before.backend_id, before.frame)
        assert v.backend_id in (0, 1, 2)


def test_arp_for_a_vip(harness: Harness) -> None:
    """The DPDK forwarder owns its port, so it answers ARP for VIP addresses
    (from the port's MAC); XDP hands ARP to the kernel, which holds the VIPs.
    A reply, a gratuitous request or a request for another address passes."""
    harness.load(base_tables())
    request = bytes(Ether(src=CLIENT_MAC, dst="ff:ff:ff:ff:ff:ff")
                    / ARP(op=1, hwsrc=CLIENT_MAC, psrc="198.19.6.1", pdst="198.18.1.11"))
    v = harness.send(request)
    if harness.target is not None and harness.target.answers_arp:
        reply = Ether(v.frame)
        assert (v.action, v.reason) == ("tx", "arp_reply")
        assert (reply.dst, reply.src) == (CLIENT_MAC, harness.port_macs[0])
        assert (reply[ARP].op, reply[ARP].psrc, reply[ARP].hwsrc) == (
            2, "198.18.1.11", harness.port_macs[0])
        assert (reply[ARP].pdst, reply[ARP].hwdst) == ("198.19.6.1", CLIENT_MAC)
    else:
        assert (v.action, v.reason) == ("pass", "pass_not_ipv4")
    others = [
        ARP(op=2, hwsrc=CLIENT_MAC, psrc="198.19.6.1", pdst="198.18.1.11"),  # a reply
        ARP(op=1, hwsrc=CLIENT_MAC, psrc="198.19.6.1", pdst="198.18.0.1"),  # not a VIP
        ARP(op=1, hwsrc=CLIENT_MAC, psrc="198.19.6.1", pdst="198.18.1.10", plen=6),
    ]
    for arp in others:
        frame = bytes(Ether(src=CLIENT_MAC, dst="ff:ff:ff:ff:ff:ff") / arp)
        assert harness.send(frame).reason == "pass_not_ipv4"
    assert harness.send(request[:30]).reason == "pass_not_ipv4"  # truncated request


def _solicit(target: str, src: str = "fd00:19:6::1", hlim: int = 255, code: int = 0,
             lladdr: bool = True, ext: bool = False) -> bytes:
    """A Neighbor Solicitation for ``target``, sent to its solicited-node
    multicast group (RFC 4861 7.2.2); ``ext``: behind a hop-by-hop header."""
    group = in6_getnsma(inet_pton(socket.AF_INET6, target))
    dst = inet_ntop(socket.AF_INET6, group)
    ns: Packet = ICMPv6ND_NS(tgt=target, code=code)
    if lladdr:
        ns = ns / ICMPv6NDOptSrcLLAddr(lladdr=CLIENT_MAC)
    if ext:
        ns = IPv6ExtHdrHopByHop() / ns
    return bytes(Ether(src=CLIENT_MAC, dst=in6_getnsmac(group)) / IPv6(src=src, dst=dst, hlim=hlim)
                 / ns)


def _check_advert(harness: Harness, v: Verdict, vip: str, to: str) -> None:
    """``v`` is the DPDK forwarder's Neighbor Advertisement for ``vip`` to a
    solicitation from ``to`` ("::": duplicate address detection)."""
    dad = to == "::"
    assert (v.action, v.reason, v.port) == ("tx", "ndp_reply", 0)
    assert len(v.frame) == 14 + 40 + 32
    reply = Ether(v.frame)
    assert (reply.dst, reply.src) == ("33:33:00:00:00:01" if dad else CLIENT_MAC,
                                      harness.port_macs[0])
    ip6 = reply[IPv6]
    assert (ip6.src, ip6.dst, ip6.hlim, ip6.tc, ip6.fl, ip6.plen) == (
        vip, "ff02::1" if dad else to, 255, 0, 0, 32)
    na = reply[ICMPv6ND_NA]
    assert (na.code, na.R, na.S, na.O, na.tgt) == (0, 0, 0 if dad else 1, 1, vip)
    assert na[ICMPv6NDOptDstLLAddr].lladdr == harness.port_macs[0]
    want = na.cksum
    na.cksum = None
    assert Ether(bytes(reply))[ICMPv6ND_NA].cksum == want, "ICMPv6 checksum"


def _ndp_not_answered(vip: str) -> list[bytes]:
    """Solicitations the DPDK forwarder leaves to the kernel."""
    bad_sum = bytearray(_solicit(vip))
    bad_sum[14 + 40 + 2] ^= 0xFF
    zero_opt = bytearray(_solicit(vip))
    zero_opt[14 + 40 + 24 + 1] = 0  # an option of length 0
    return [
        _solicit(vip, hlim=64),  # routed: not from the link
        _solicit(vip, code=1),
        _solicit(addr_of(6, "198.18.0.10")),  # a backend's address, not a VIP
        with_ip_length(_solicit(vip)[: 14 + 40 + 23], 40 + 23),  # no whole target
        bytes(bad_sum),
        bytes(zero_opt),
        _solicit(vip, src="::", lladdr=True),  # DAD carries no source link-layer option
        _solicit(vip, ext=True),  # behind an extension header: the kernel judges those
        bytes(Ether(src=CLIENT_MAC) / IPv6(src="fd00:19:6::1", dst=vip, hlim=255)
              / ICMPv6ND_NA(tgt=vip)),  # an advertisement
        _solicit("::ffff:198.18.1.11"),  # a VIP's IPv4 address, IPv4-mapped
    ]


def test_ndp_for_a_vip(harness: Harness) -> None:
    """The IPv6 twin of ARP: the DPDK forwarder answers a Neighbor
    Solicitation for an IPv6 VIP address itself (RFC 4861 7.2.4: an
    advertisement from the port's MAC, with the target link-layer address
    option), counted ndp_reply; XDP hands NDP to the kernel (pass_not_vip,
    ICMPv6 being no VIP's protocol). What is not a valid solicitation for a
    VIP passes to the kernel."""
    harness.load(base_tables(family=6))
    vip = addr_of(6, "198.18.1.11")
    answers = harness.target is not None and harness.target.answers_arp
    for src in ("fd00:19:6::1", "::"):  # "::": duplicate address detection
        request = _solicit(vip, src=src, lladdr=src != "::")
        v = harness.send(request)
        if answers:
            _check_advert(harness, v, vip, src)
        else:
            assert (v.action, v.reason, v.frame) == ("pass", "pass_not_vip", request)
    for frame in _ndp_not_answered(vip):
        v = harness.send(frame)
        assert (v.action, v.reason, v.frame) == ("pass", "pass_not_vip", frame)


def test_model_answers_ndp_as_the_dpdk_forwarder() -> None:
    """The model on its own, as the DPDK target runs it (answers_arp), so
    that the NDP semantics are checked where no DPDK forwarder runs."""
    harness = Harness(None, ["02:00:00:00:00:01", "02:00:00:00:00:02"])
    harness.load(base_tables(family=6))
    assert harness.model is not None
    harness.model.answers_arp = True
    vip = addr_of(6, "198.18.1.10")
    for src in ("fd00:19:6::1", "::"):
        _check_advert(harness, harness.send(_solicit(vip, src=src, lladdr=src != "::")), vip,
                      src)
    # 24 bytes (no option) is a whole solicitation; a trailer after it goes.
    bare = _solicit(vip, lladdr=False)
    assert len(bare) == 14 + 40 + 24
    _check_advert(harness, harness.send(bare + bytes(10)), vip, "fd00:19:6::1")
    for frame in _ndp_not_answered(vip):
        assert harness.send(frame).reason == "pass_not_vip"


def test_truncated_headers_are_dropped(harness: Harness, family: int) -> None:
    harness.load(base_tables(family=family))
    src, hl = addr_of(family, "198.19.6.1"), ip_hlen(family)
    full_tcp = tcp(src, 6000)
    full_udp = udp(src, 6000)
    cases = {
        "ethernet": full_tcp[:13],
        "ip": full_tcp[: 14 + hl - 1],
        "tcp": with_ip_length(full_tcp[: 14 + hl + 19], hl + 19),
        "udp": with_ip_length(full_udp[: 14 + hl + 7], hl + 7),
        "tcp, the length field not cut": full_tcp[: 14 + hl + 19],
    }
    for what, frame in cases.items():
        v = harness.send(frame)
        assert (v.action, v.reason) == ("drop", "drop_malformed"), what


def test_bad_ihl_and_version_are_dropped(harness: Harness) -> None:
    harness.load(base_tables())
    frame = bytearray(tcp("198.19.7.1", 7000))
    frame[14] = 0x44  # IHL 4 < 5
    assert harness.send(bytes(frame)).reason == "drop_malformed"
    frame[14] = 0x65  # version 6 inside an IPv4 ethertype
    assert harness.send(bytes(frame)).reason == "drop_malformed"
    frame = bytearray(tcp("198.19.7.1", 7001))
    frame[14] = 0x4F  # IHL 15: options claim 40 bytes the frame does not have
    assert harness.send(bytes(frame)).reason == "drop_malformed"


def test_bad_ipv6_version_is_dropped(harness: Harness) -> None:
    """The IPv6 EtherType with another version in the header: malformed
    (version 4 included: the EtherType decides how the header is read)."""
    harness.load(base_tables(family=6))
    for version in (4, 5, 0):
        frame = bytearray(tcp(addr_of(6, "198.19.7.1"), 7002))
        frame[14] = (version << 4) | (frame[14] & 0x0F)
        v = harness.send(bytes(frame))
        assert (v.action, v.reason) == ("drop", "drop_malformed"), version


def test_ip_length_beyond_the_frame_is_dropped(harness: Harness, family: int) -> None:
    """A packet that claims more bytes than the frame carries is truncated:
    dropped, never forwarded (the kernel would drop it too). IPv4: the total
    length; IPv6: 40 + the payload length."""
    harness.load(base_tables(family=family))
    src, vip = addr_of(family, "198.19.17.1"), addr_of(family, "198.18.1.10")
    frame = tcp(src, 17000)
    for claimed in (len(frame) - 14 + 1, 1500, 0xFFFF if family == 4 else 0xFFFF + 40):
        v = harness.send(with_ip_length(frame, claimed))
        assert (v.action, v.reason) == ("drop", "drop_malformed"), claimed
    v = harness.send(with_ip_length(udp(src, 17001), 0xFFFF))
    assert (v.action, v.reason) == ("drop", "drop_malformed")
    # The IP header is checked before anything else is decided: not even
    # what would pass (a fragment, another protocol) passes with a lie in it.
    for other in (fragments(family, src, vip, 17002)[0], icmp_echo(family, src, vip)):
        assert harness.send(other).action == "pass"
        v = harness.send(with_ip_length(other, len(other) - 14 + 1))
        assert (v.action, v.reason) == ("drop", "drop_malformed")


def test_ip_total_length_below_the_header_is_dropped(harness: Harness) -> None:
    harness.load(base_tables())
    frame = tcp("198.19.18.1", 18000)
    for claimed in (19, 1):
        v = harness.send(with_ip_length(frame, claimed))
        assert (v.action, v.reason) == ("drop", "drop_malformed"), claimed
    # With options (IHL 6: a 24-byte header), 20 is below the header too.
    with_options = bytes(ETH / IP(src="198.19.18.1", dst="198.18.1.10",
                                  options=[IPOption_NOP()] * 4) / TCP(sport=18001, dport=80))
    assert harness.send(with_options).action == "tx"
    for claimed in (20, 23):
        v = harness.send(with_ip_length(with_options, claimed))
        assert (v.action, v.reason) == ("drop", "drop_malformed"), claimed


def test_ipv6_payload_length_inside_an_extension_header_is_dropped(harness: Harness) -> None:
    """The IPv6 twin of a length below the header: the payload length ends
    inside an extension header (its first 8 bytes, or its declared length),
    or the chain runs past the packet."""
    harness.load(base_tables(family=6))
    src, vip = addr_of(6, "198.19.18.1"), addr_of(6, "198.18.1.10")
    dst_opts = bytes(ETH / IPv6(src=src, dst=vip) / IPv6ExtHdrDestOpt()
                     / TCP(sport=18002, dport=80))
    assert harness.send(dst_opts).action == "tx"
    for claimed in (40, 40 + 7, 40 + 8, 40 + 8 + 19):
        v = harness.send(with_ip_length(dst_opts, claimed))
        assert (v.action, v.reason) == ("drop", "drop_malformed"), claimed
    # A routing header claiming 24 bytes (hdrlen 2) more than there are.
    long_routing = bytearray(bytes(ETH / IPv6(src=src, dst=vip) / IPv6ExtHdrRouting()
                                   / TCP(sport=18003, dport=80)))
    long_routing[14 + 40 + 1] = 5  # 48 bytes: beyond the packet
    v = harness.send(bytes(long_routing))
    assert (v.action, v.reason) == ("drop", "drop_malformed")
    # The chain cut short by the frame itself (no length field lying).
    v = harness.send(dst_opts[: 14 + 40 + 4])
    assert (v.action, v.reason) == ("drop", "drop_malformed")


def test_ip_length_zero_is_dropped(harness: Harness, family: int) -> None:
    """IPv4 total length 0; IPv6 payload length 0 (a jumbogram's, which
    Ethernet cannot carry: the TCP/UDP header is then outside the packet)."""
    harness.load(base_tables(family=family))
    src = addr_of(family, "198.19.19.1")
    for frame in (tcp(src, 19000), udp(src, 19001)):
        v = harness.send(with_ip_length(frame, 0 if family == 4 else 40))
        assert (v.action, v.reason) == ("drop", "drop_malformed")


def test_l4_header_beyond_the_ip_length_is_dropped(harness: Harness, family: int) -> None:
    """The frame holds a whole TCP/UDP header, the packet does not (its
    length ends inside it): the ports are padding, not the packet's."""
    harness.load(base_tables(family=family))
    src, hl = addr_of(family, "198.19.20.1"), ip_hlen(family)
    frame = tcp(src, 20000)
    for claimed in (hl, hl + 19):
        v = harness.send(with_ip_length(frame, claimed))
        assert (v.action, v.reason) == ("drop", "drop_malformed"), claimed
    v = harness.send(with_ip_length(udp(src, 20001), hl + 7))
    assert (v.action, v.reason) == ("drop", "drop_malformed")
    v = harness.send(with_ip_length(udp(src, 20002), hl + 8))  # no payload: fine
    assert v.action == "tx"


def test_ethernet_padding_after_a_short_packet_still_forwards(harness: Harness,
                                                              family: int) -> None:
    """Bytes after the packet (a 60-byte minimum frame around a 40-byte IPv4
    packet; any trailer after an IPv6 one): no error. Forwarded like the
    frame without them, to the same backend, trailer and all (DSR touches
    only the MACs)."""
    harness.load(base_tables(family=family))
    src = addr_of(family, "198.19.21.1")
    for frame in (tcp(src, 21000), udp(src, 21001)):
        pad = max(60 - len(frame), 6)
        padded = frame + bytes(pad)
        plain = harness.send(frame)
        v = harness.send(padded)
        assert (v.action, v.reason) == ("tx", "fwd_tx")
        assert v.backend_id == plain.backend_id
        assert v.frame == plain.frame + bytes(pad)


def test_ip_options_are_skipped(harness: Harness) -> None:
    """Defined behaviour: the L4 header is found through the IHL, so a packet
    with options is balanced exactly like the same flow without them."""
    harness.load(base_tables())
    plain = harness.send(tcp("198.19.8.1", 8000))
    with_options = bytes(ETH / IP(src="198.19.8.1", dst="198.18.1.10",
                                  options=[IPOption_NOP()] * 8) / TCP(sport=8000, dport=80))
    v = harness.send(with_options)
    assert v.action == "tx" and v.backend_id == plain.backend_id


def _ext_chain(n: int) -> Packet:
    """n extension headers (hop-by-hop first, destination options after)."""
    chain: Packet = IPv6ExtHdrHopByHop()
    for _ in range(n - 1):
        chain = chain / IPv6ExtHdrDestOpt()
    return chain


def test_ipv6_extension_headers_are_walked(harness: Harness) -> None:
    """Defined behaviour: the L4 header is found through the extension-header
    chain (hop-by-hop, routing, destination options, AH with its 4-byte
    units, an atomic fragment: RFC 6946, a whole packet), so the flow is
    balanced exactly like the same flow without them, the frame untouched
    but for the MACs. Up to eight headers are walked; a ninth passes the
    packet to the kernel unparsed (pass_ext_headers)."""
    harness.load(base_tables(family=6))
    src, vip = addr_of(6, "198.19.8.1"), addr_of(6, "198.18.1.10")
    plain = harness.send(tcp(src, 8000))
    chains: dict[str, Packet] = {
        "hop-by-hop": IPv6ExtHdrHopByHop(),
        "routing": IPv6ExtHdrRouting(),
        "destination options, 32 bytes": IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * 20)]),
        "ah": AH(nh=6, payloadlen=4, spi=1, icv=b"\0" * 12),
        "atomic fragment": IPv6ExtHdrFragment(offset=0, m=0, id=9),
        "all": (IPv6ExtHdrHopByHop() / IPv6ExtHdrDestOpt() / IPv6ExtHdrRouting()
                / IPv6ExtHdrFragment(id=10) / AH(nh=60, payloadlen=2, spi=2, icv=b"\0" * 4)
                / IPv6ExtHdrDestOpt()),
        "eight": _ext_chain(8),
    }
    for what, chain in chains.items():
        frame = bytes(ETH / IPv6(src=src, dst=vip) / chain / TCP(sport=8000, dport=80,
                                                                 flags="S"))
        v = harness.send(frame)
        assert (v.action, v.backend_id) == ("tx", plain.backend_id), what
        assert v.frame[12:] == frame[12:], what
    # AH's length counts 4-byte units minus 2: 12 + 12 ICV bytes is hdrlen 4
    # (read in 8-byte units it would be 40 bytes and end inside the TCP header).
    ah = bytes(ETH / IPv6(src=src, dst=vip) / AH(nh=6, payloadlen=4, spi=3, icv=b"\0" * 12)
               / TCP(sport=8000, dport=80, flags="S"))
    assert ah[14 + 40 + 1] == 4 and harness.send(ah).backend_id == plain.backend_id
    nine = bytes(ETH / IPv6(src=src, dst=vip) / _ext_chain(9) / TCP(sport=8000, dport=80))
    v = harness.send(nine)
    assert (v.action, v.reason, v.frame) == ("pass", "pass_ext_headers", nine)
    # Nine before a fragment header or ICMPv6 alike: the walk stops at eight.
    nine_icmp = bytes(ETH / IPv6(src=src, dst=vip) / _ext_chain(9) / ICMPv6EchoRequest())
    assert harness.send(nine_icmp).reason == "pass_ext_headers"


def test_fragments_pass_to_the_kernel(harness: Harness, family: int) -> None:
    """Defined behaviour: a non-first fragment has no ports, so fragments of a
    VIP's traffic cannot be balanced consistently; the kernel gets them all.
    A fragmented ICMP message is ICMP (not a VIP's), not a fragment."""
    harness.load(base_tables(family=family))
    src, vip = addr_of(family, "198.19.9.1"), addr_of(family, "198.18.1.10")
    for frame in fragments(family, src, vip, 9000):
        v = harness.send(frame)
        assert (v.action, v.reason) == ("pass", "pass_fragment")
    if family == 4:
        icmp_fragment = bytes(ETH / IP(src=src, dst=vip, flags="MF", proto=1) / (b"i" * 64))
    else:
        icmp_fragment = bytes(ETH / IPv6(src=src, dst=vip) / IPv6ExtHdrFragment(m=1, nh=58)
                              / (b"i" * 64))
    assert harness.send(icmp_fragment).reason == "pass_not_vip"


def test_ipv6_fragment_header_cases(harness: Harness) -> None:
    """An atomic fragment (offset 0, M clear) is a whole packet: balanced as
    the flow. A first fragment behind other extension headers passes; so
    does one whose fragmentable part starts with an extension header (the
    protocol is hidden: a fragment, not "another protocol")."""
    harness.load(base_tables(family=6))
    src, vip = addr_of(6, "198.19.9.2"), addr_of(6, "198.18.1.10")
    plain = harness.send(udp(src, 9001))
    atomic = bytes(ETH / IPv6(src=src, dst=vip) / IPv6ExtHdrFragment(id=5)
                   / UDP(sport=9001, dport=53) / b"query")
    v = harness.send(atomic)
    assert (v.action, v.reason, v.backend_id) == ("tx", "fwd_tx", plain.backend_id)
    behind = bytes(ETH / IPv6(src=src, dst=vip) / IPv6ExtHdrHopByHop()
                   / IPv6ExtHdrFragment(m=1, id=6) / UDP(sport=9001, dport=53) / (b"q" * 8))
    hidden = bytes(ETH / IPv6(src=src, dst=vip) / IPv6ExtHdrFragment(m=1, id=7)
                   / IPv6ExtHdrDestOpt() / UDP(sport=9001, dport=53) / (b"q" * 8))
    for frame in (behind, hidden):
        v = harness.send(frame)
        assert (v.action, v.reason) == ("pass", "pass_fragment")


def test_down_backend_rehashes_its_flows_and_only_them(harness: Harness, family: int) -> None:
    harness.load(base_tables(family=family))
    src = addr_of(family, "198.19.10.1")
    flows = [tcp(src, 10000 + i) for i in range(90)]
    before = [harness.backend_of(f) for f in flows]
    victim = before[0]
    assert victim is not None
    harness.load(base_tables(states={victim: BackendState.DOWN}, family=family))  # same ring
    after = [harness.backend_of(f) for f in flows]
    for b, a in zip(before, after, strict=True):
        if b == victim:
            assert a not in (victim, None), "a flow stayed on a down backend"
        else:
            assert a == b, "a flow on a healthy backend moved"


def test_draining_backend_keeps_flows_and_takes_no_new_ones(harness: Harness,
                                                            family: int) -> None:
    harness.load(base_tables(family=family))
    src, src2 = addr_of(family, "198.19.11.1"), addr_of(family, "198.19.11.2")
    flows = [tcp(src, 11000 + i) for i in range(90)]
    before = [harness.backend_of(f) for f in flows]
    drained = before[0]
    harness.load(base_tables(states={drained: BackendState.DRAINING}, family=family))
    assert [harness.backend_of(f) for f in flows] == before
    fresh = [harness.backend_of(tcp(src2, 20000 + i)) for i in range(90)]
    assert drained not in fresh and None not in fresh


def test_affinity_holds_across_a_ring_change(harness: Harness, family: int) -> None:
    harness.load(base_tables(family=family))
    src, src2 = addr_of(family, "198.19.12.1"), addr_of(family, "198.19.12.2")
    flows = [udp(src, 12000 + i) for i in range(120)]
    before = [harness.backend_of(f) for f in flows]
    harness.load(base_tables({0: 1.0, 1: 1.0, 2: 4.0}, family=family))  # a ring patch
    assert [harness.backend_of(f) for f in flows] == before
    fresh = [harness.backend_of(udp(src2, 30000 + i)) for i in range(200)]
    assert fresh.count(2) > fresh.count(0) + fresh.count(1), "the new weights take new flows"


def _two_cpus(harness: Harness) -> tuple[list[int], Callable[[int], None]]:
    cpus = sorted(os.sched_getaffinity(0))
    if harness.target is None:
        pytest.skip("the model has no CPUs: this case needs a real data plane")
    set_cpu = getattr(harness.target, "set_cpu", None)
    if set_cpu is None:
        pytest.skip(f"{harness.target.name} steers every packet of a flow to one worker "
                    "(RSS on the 5-tuple), so no other CPU ever sees the flow")
    if len(cpus) < 2:
        pytest.skip("needs two CPUs this process may run on")
    return cpus, set_cpu


def test_a_flow_seen_on_another_cpu_keeps_its_backend(harness: Harness, family: int) -> None:
    """Packets of one flow arrive on several CPUs (a client's ACKs leave from
    the softirq that received the backend's reply; RSS tables change). A
    weight change in between must not move the flow: the flow table is
    shared, not per CPU (a per-CPU table moved a third of these flows)."""
    cpus, set_cpu = _two_cpus(harness)
    harness.load(base_tables(family=family))
    src = addr_of(family, "198.19.16.1")
    flows = [tcp(src, 16000 + i) for i in range(90)]
    try:
        set_cpu(cpus[0])
        first = [harness.backend_of(f) for f in flows]
        harness.load(base_tables({0: 1.0, 1: 1.0, 2: 5.0}, family=family))
        set_cpu(cpus[1])
        assert [harness.backend_of(f) for f in flows] == first
    finally:
        os.sched_setaffinity(0, cpus)  # every CPU again, for the cases after
    assert set(first) == {0, 1, 2}


def test_all_backends_down_drops(harness: Harness, family: int) -> None:
    down = dict.fromkeys((0, 1, 2), BackendState.DOWN)
    harness.load(base_tables(states=down, family=family))
    src = addr_of(family, "198.19.13.1")
    v = harness.send(tcp(src, 13000))
    assert (v.action, v.reason) == ("drop", "drop_no_backend")
    harness.load(base_tables({0: 0.0, 1: 0.0, 2: 0.0}, family=family))  # every weight 0
    assert harness.send(udp(src, 13001)).reason == "drop_no_backend"


def test_two_arm_backend_is_redirected_out_of_its_port(harness: Harness, family: int) -> None:
    harness.load(base_tables(family=family))
    v = harness.send(tcp(addr_of(family, "198.19.14.1"), 14000,
                         dst=addr_of(family, "198.18.1.11")))
    assert (v.action, v.backend_id, v.port) == ("redirect", 3, 1)
    assert v.frame[6:12] == bytes.fromhex(harness.port_macs[1].replace(":", ""))


def test_random_frames_never_disagree(harness: Harness, family: int) -> None:
    """Garbage after a valid or a broken header: both sides agree on all of it."""
    import random

    rng = random.Random(7 + family)
    harness.load(base_tables(family=family))
    src = addr_of(family, "198.19.15.1")
    vip = addr_of(family, "198.18.1.10")
    bases = [tcp(src, 15000)]
    if family == 6:  # chains to break too
        bases.append(bytes(ETH / IPv6(src=src, dst=vip) / IPv6ExtHdrHopByHop()
                           / IPv6ExtHdrFragment(id=3) / UDP(sport=15001, dport=53) / b"q"))
        bases.append(bytes(ETH / IPv6(src=src, dst=vip) / IPv6ExtHdrRouting()
                           / IPv6ExtHdrFragment(id=4) / AH(nh=60, payloadlen=2, icv=b"\0" * 4)
                           / IPv6ExtHdrDestOpt() / TCP(sport=15002, dport=80)))
        bases.append(_solicit(vip))
    ethertype = 0x0800 if family == 4 else 0x86DD
    for _ in range(300):
        base = rng.choice(bases)
        frame = bytearray(base[: rng.randint(14, len(base))])
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(12, len(frame))] = rng.randrange(256)
        if rng.random() < 0.5:
            struct.pack_into("!H", frame, 12, ethertype)
        harness.send(bytes(frame))
