"""The NAT conformance cases' tools, for either family: a client connection
through a NAT VIP (``Conn``), checksum checks, ICMP/ICMPv6 error frames, and
``NatCase``, what the ``nat`` fixtures hand a case (the harness and the
family it runs in: 6 runs the IPv4 case's twin, every address through
harness.v6: clients fd00:19:1NN::x, VIPs fd00:18:2::1x, backends
fd00:18:0::2x, pool fd00:18:3::x)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass, field

import pytest
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.inet6 import (
    ICMPv6DestUnreach,
    ICMPv6PacketTooBig,
    ICMPv6ParamProblem,
    ICMPv6TimeExceeded,
    IPv6,
    in6_chksum,
)
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw

from hpclb.contract.flowhash import flow_hash
from hpclb.contract.model import Verdict
from hpclb.contract.tables import CONN_STATE_NAMES, IPPROTO_TCP, SNAT_PROBES, TableSet, Vip

from .harness import (
    HASH_KEY,
    NAT6_BACKEND_MACS,
    NAT_BACKEND_MACS,
    VIP_NAT_TCP,
    Harness,
    addr_of,
    nat_backend_addr,
    nat_tables,
    nat_vip,
)
from .targets import Target

ROUTER = "198.18.0.1"
ROUTER_MAC = "02:cc:00:00:00:01"
BACKEND_MACS = {**NAT_BACKEND_MACS, **NAT6_BACKEND_MACS}
IPV6_EXT = (0, 43, 44, 51, 60)  # hop-by-hop, routing, fragment, AH, destination options


def backend_port(bid: int) -> int:
    return 0 if bid == 13 else 1


def ip_of(family: int, src: str, dst: str, **ip: object) -> Packet:
    """IP or IPv6 (``ttl`` becomes ``hlim``; IPv4 options have no twin)."""
    if family == 4:
        return IP(src=src, dst=dst, **ip)
    if "ttl" in ip:
        ip["hlim"] = ip.pop("ttl")
    return IPv6(src=src, dst=dst, **ip)


def _v6_l4(frame: bytes) -> tuple[int, int, int]:
    """(next header, L4 offset in the frame, end of the packet) of an IPv6 frame."""
    (plen,) = struct.unpack_from("!H", frame, 18)
    nh, off = frame[20], 54
    while nh in IPV6_EXT:
        size = 8 if nh == 44 else (frame[off + 1] + 2) * 4 if nh == 51 else (frame[off + 1] + 1) * 8
        nh, off = frame[off], off + size
    return nh, off, 54 + plen


def assert_checksums(frame: bytes) -> None:
    """Recompute, from scratch, the checksums of a frame that leaves: IPv4's
    header, TCP/UDP, ICMP (scapy); IPv6's TCP/UDP/ICMPv6 through the
    pseudo-header, after any extension headers (in6_chksum). A UDP checksum
    of 0, "none", is kept as 0. A quoted packet's are the ICMP cases'."""
    pkt = Ether(frame)
    if IP in pkt:
        redo = pkt.copy()
        del redo[IP].chksum
        top = redo[IP].payload
        if isinstance(top, TCP | ICMP) or (isinstance(top, UDP) and top.chksum != 0):
            del top.chksum
        assert bytes(redo) == frame, "a checksum is not what scapy computes"
        return
    if IPv6 not in pkt:
        return
    nh, off, end = _v6_l4(frame)
    at = {socket.IPPROTO_TCP: 16, socket.IPPROTO_UDP: 6, socket.IPPROTO_ICMPV6: 2}.get(nh)
    if at is None:
        return
    l4 = bytearray(frame[off:end])
    (field_,) = struct.unpack_from("!H", l4, at)
    if nh == socket.IPPROTO_UDP and field_ == 0:
        return
    l4[at : at + 2] = b"\0\0"
    want = in6_chksum(nh, pkt[IPv6], bytes(l4))
    if nh == socket.IPPROTO_UDP and want == 0:
        want = 0xFFFF
    assert field_ == want, f"the L4 checksum is {field_:#06x}, a recomputation gives {want:#06x}"


def sums(h: Harness, frame: bytes, in_port: int = 0) -> Verdict:
    """send, then check the checksums of what left."""
    v = h.send(frame, in_port)
    if v.action in ("tx", "redirect"):
        assert_checksums(v.frame)
    return v


def by_state(h: Harness) -> dict[str, int]:
    """The connections by state (the data plane's checked against the
    model's), states with none left out."""
    figures = h.conns()
    return {name: figures[f"by_state.{name}"] for name in CONN_STATE_NAMES
            if figures[f"by_state.{name}"]}


def opened(v: Verdict) -> bool:
    return v.action in ("tx", "redirect") and "conn_new" in v.events


def l4_sport(frame: bytes) -> int:
    pkt = Ether(frame)
    return int(pkt[TCP].sport if TCP in pkt else pkt[UDP].sport)


@dataclass
class Conn:
    """One client connection through a NAT VIP (of the client's family):
    builds its frames both ways, sends them, and checks every translated
    frame against the one scapy builds. ``ext``: IPv6 extension headers
    every frame of the connection carries (both ways), kept as they are."""

    h: Harness
    client: str
    cport: int
    vip: Vip = VIP_NAT_TCP
    backend: int | None = None
    #: The source the backend sees: (client, cport), or the SNAT pair.
    seen_as: tuple[str, int] | None = None
    #: The client's source MAC (its next frames'), and the one replies go to
    #: (its first frame's).
    mac: str = "02:aa:00:00:00:01"
    reply_mac: str | None = None
    ext: Packet | None = None
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def family(self) -> int:
        return int(self.vip.addr.version)

    @property
    def proto(self) -> int:
        return self.vip.proto

    @property
    def bport(self) -> int:
        return self.vip.nat_port or self.vip.port

    @property
    def key(self) -> tuple[int | bytes, int | bytes, int, int, int]:
        """The original key, as the model keeps it (IPv4: host ints; IPv6:
        packed addresses)."""
        client = ipaddress.ip_address(self.client)
        if self.family == 6:
            return (client.packed, self.vip.addr.packed, self.cport, self.vip.port, self.proto)
        return (int(client), int(self.vip.addr), self.cport, self.vip.port, self.proto)

    def _ip(self, src: str, dst: str, **ip: object) -> Packet:
        layer = ip_of(self.family, src, dst, **ip)
        return layer / self.ext.copy() if self.ext is not None else layer

    def _l4(self, sport: int, dport: int, flags: str, payload: bytes,
            udp_zero: bool = False) -> Packet:
        if self.proto == IPPROTO_TCP:
            return TCP(sport=sport, dport=dport, flags=flags, seq=1000, ack=2000) / payload
        if udp_zero:
            return UDP(sport=sport, dport=dport, chksum=0) / payload
        return UDP(sport=sport, dport=dport) / payload

    def orig_frame(self, flags: str = "S", payload: bytes = b"", udp_zero: bool = False,
                   **ip: object) -> bytes:
        return bytes(Ether(src=self.mac, dst=self.h.port_macs[0])
                     / self._ip(self.client, str(self.vip.addr), **ip)
                     / self._l4(self.cport, self.vip.port, flags, payload, udp_zero))

    def orig(self, flags: str = "S", payload: bytes = b"", udp_zero: bool = False,
             **ip: object) -> Verdict:
        """The client sends (port 0); if forwarded, it must reach the backend
        DNATed (and SNATed), nothing else changed."""
        v = sums(self.h, self.orig_frame(flags, payload, udp_zero, **ip))
        self.verdicts.append(v)
        if v.action not in ("tx", "redirect"):
            return v
        assert v.backend_id is not None
        if self.backend is not None and "conn_new" not in v.events:
            assert v.backend_id == self.backend, "a known connection changed backend"
        if "conn_new" in v.events or self.reply_mac is None:
            self.reply_mac = self.mac
        self.backend = v.backend_id
        out = Ether(v.frame)
        if self.vip.snat:
            src = out[IP].src if self.family == 4 else out[IPv6].src
            self.seen_as = (src, l4_sport(v.frame))
        else:
            self.seen_as = (self.client, self.cport)
        port = backend_port(self.backend)
        want = (Ether(dst=BACKEND_MACS[self.backend], src=self.h.port_macs[port])
                / self._ip(self.seen_as[0], nat_backend_addr(self.backend, self.family), **ip)
                / self._l4(self.seen_as[1], self.bport, flags, payload, udp_zero))
        assert v.frame.hex() == bytes(want).hex(), "not the DNATed frame"
        assert v.port == port and v.action == ("tx" if port == 0 else "redirect")
        return v

    def reply_frame(self, flags: str = "SA", payload: bytes = b"",
                    udp_zero: bool = False) -> bytes:
        assert self.backend is not None and self.seen_as is not None
        port = backend_port(self.backend)
        return bytes(Ether(src=BACKEND_MACS[self.backend], dst=self.h.port_macs[port])
                     / self._ip(nat_backend_addr(self.backend, self.family), self.seen_as[0])
                     / self._l4(self.bport, self.seen_as[1], flags, payload, udp_zero))

    def reply(self, flags: str = "SA", payload: bytes = b"", udp_zero: bool = False) -> Verdict:
        """The backend answers (on its port); if translated, it must reach the
        client from the VIP, out of port 0 to the client's MAC."""
        assert self.backend is not None
        v = sums(self.h, self.reply_frame(flags, payload, udp_zero), backend_port(self.backend))
        self.verdicts.append(v)
        if v.action in ("tx", "redirect"):
            want = (Ether(dst=self.reply_mac or self.mac, src=self.h.port_macs[0])
                    / self._ip(str(self.vip.addr), self.client)
                    / self._l4(self.vip.port, self.cport, flags, payload, udp_zero))
            assert v.frame.hex() == bytes(want).hex(), "not the reply translated back"
            assert v.port == 0 and v.backend_id == self.backend
            assert v.action == ("tx" if backend_port(self.backend) == 0 else "redirect")
        return v

    def state(self) -> str | None:
        assert self.h.model is not None
        s = self.h.model.conn_state(self.key)
        return None if s is None else CONN_STATE_NAMES[s]


# ---- ICMP errors ------------------------------------------------------------------

#: The ICMPv4 errors the cases send, and their ICMPv6 twins (RFC 4443):
#: fragmentation needed -> packet too big, port unreachable -> port
#: unreachable (1/4), host unreachable (3/1) -> address unreachable (1/3),
#: communication prohibited (3/13) -> administratively prohibited (1/1),
#: TTL exceeded -> hop limit exceeded (3/0), parameter problem (12/0) ->
#: erroneous header field (4/0).
ICMP6_TWIN = {(3, 4): (2, 0), (3, 3): (1, 4), (3, 1): (1, 3), (3, 13): (1, 1),
              (11, 0): (3, 0), (12, 0): (4, 0)}


def icmp_error(family: int, src: str, dst: str, mac_src: str, mac_dst: str, itype: int,
               code: int, quote: bytes, **ip: object) -> bytes:
    """An ICMP error of type/code (ICMPv4's numbers; for 6 their ICMPv6
    twin, ICMP6_TWIN) quoting ``quote``, the bytes of an IP packet."""
    if family == 4:
        icmp = ICMP(type=itype, code=code)
        if (itype, code) == (3, 4):
            icmp.nexthopmtu = 1400
    else:
        t6, c6 = ICMP6_TWIN[(itype, code)]
        icmp = {1: ICMPv6DestUnreach, 2: ICMPv6PacketTooBig, 3: ICMPv6TimeExceeded,
                4: ICMPv6ParamProblem}[t6](code=c6)
        if t6 == 2:
            icmp.mtu = 1400
        elif t6 == 4:
            icmp.ptr = 7
    return bytes(Ether(src=mac_src, dst=mac_dst) / ip_of(family, src, dst, **ip) / icmp
                 / Raw(quote))


def ip_bytes(frame: bytes) -> bytes:
    """The IP packet of a frame (the bytes after the Ethernet header)."""
    return frame[14:]


# ---- SNAT --------------------------------------------------------------------------


def expected_snat(client: str, cport: int, vip: Vip, pool: tuple[str, ...],
                  port_range: tuple[int, int], taken: set[tuple[int, str, int, int]],
                  backend: int) -> tuple[str, int] | None:
    """lb_conn.h's SNAT choice, written out: the flow hash of the original
    5-tuple picks the pool address ((hash >> 32) % naddrs, the pool of the
    VIP's family) and the first of SNAT_PROBES consecutive ports from
    min + hash % range whose reply key (backend, address, backend port,
    port, proto) is free."""
    h = flow_hash(HASH_KEY, client, str(vip.addr), cport, vip.port, vip.proto)
    addr = pool[(h >> 32) % len(pool)]
    lo, hi = port_range
    for n in range(SNAT_PROBES):
        port = lo + ((h + n) % (1 << 64)) % (hi - lo + 1)
        if (backend, addr, port, vip.proto) not in taken:
            return addr, port
    return None


@dataclass
class NatCase:
    """What a NAT case runs on: the harness, and the family (4, or 6 for
    the IPv6 twin: every address through ``a``, every VIP through ``vip``)."""

    h: Harness
    family: int

    def a(self, addr: str) -> str:
        """One of the suite's IPv4 addresses in this case's family (an IPv6
        address stays as it is)."""
        return addr if ":" in addr else addr_of(self.family, addr)

    def vip(self, vip: Vip) -> Vip:
        return nat_vip(vip, self.family)

    def tables(self, pool: tuple[str, ...] = ("198.18.3.1",), **kw: object) -> TableSet:
        return nat_tables(pool, family=self.family, **kw)  # type: ignore[arg-type]

    def load(self, pool: tuple[str, ...] = ("198.18.3.1",), **kw: object) -> None:
        self.h.load(self.tables(pool, **kw))

    def conn(self, client: str, cport: int, vip: Vip = VIP_NAT_TCP, **kw: object) -> Conn:
        """A connection of ``client`` (an IPv4 address of the suite, put in
        the case's family) to ``vip`` (likewise)."""
        return Conn(self.h, self.a(client), cport, self.vip(vip), **kw)  # type: ignore[arg-type]

    def backend_addr(self, bid: int) -> str:
        return nat_backend_addr(bid, self.family)

    def ip(self, frame: bytes) -> bytes:
        return ip_bytes(frame)

    def icmp(self, src: str, dst: str, mac_src: str, mac_dst: str, itype: int, code: int,
             quote: bytes, **ip: object) -> bytes:
        """icmp_error in this case's family (addresses as given)."""
        return icmp_error(self.family, src, dst, mac_src, mac_dst, itype, code, quote, **ip)


def require_capability(target: Target | None, has: bool, capability: str, cases: str) -> None:
    """Cases that need the hello's ``capability`` (``has``: the target's hello
    lists it; the model has every one). A plane without it refuses what they
    set up: the case skips, saying so, except in CI, where both planes must
    run them."""
    if target is None or has:
        return
    reason = (f"the {target.name} data plane's hello lacks the '{capability}' capability: "
              f"{cases} cases skipped")
    print(reason)
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the {target.name} {cases} conformance cases: {reason}")
    pytest.skip(reason)


def require_nat6(target: Target | None) -> None:
    """IPv6 NAT cases need the hello's "nat6" capability (set_vip refuses an
    IPv6 NAT VIP without it)."""
    require_capability(target, target is not None and target.nat6, "nat6", "IPv6 NAT mode")


def assert_all_pass(h: Harness, frames: dict[str, list[bytes]]) -> None:
    """Every frame, on either port, passes to the kernel unchanged, for the
    reason it is filed under; no connection is made."""
    for reason, group in frames.items():
        for frame in group:
            for port in (0, 1):
                v = h.send(frame, port)
                assert (v.action, v.reason, v.frame) == ("pass", reason, frame)
    assert h.conns()["entries"] == 0
