"""NAT mode over IPv6: the cases of IPv6's own (every family-neutral NAT case
runs for IPv6 too, in test_conformance_nat.py): extension headers on a
connection and the 256-byte bound (LB_NAT6_MAX_L4_OFF, pass_ext_headers),
ICMPv6 errors of every type, the IPv6 SNAT pool next to the IPv4 one, no
NAT64 (a backend of the other family is no backend), and the two families'
connection tables side by side, each with its own capacity.

Run on the model and on every data plane whose hello has "nat6" (without
it the plane's cases skip, saying so; under CI they fail).
"""

from __future__ import annotations

import dataclasses

from scapy.layers.inet import IP, TCP
from scapy.layers.inet6 import (
    ICMPv6DestUnreach,
    ICMPv6EchoRequest,
    ICMPv6PacketTooBig,
    ICMPv6ParamProblem,
    ICMPv6TimeExceeded,
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    PadN,
)
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Packet, Raw

from hpclb.contract.tables import IPPROTO_TCP, Vip

from .harness import (
    CLIENT_MAC,
    NAT6_VIP_ID_OFFSET,
    VIP_NAT_TCP,
    VIP_NAT_UDP,
    VIP_SNAT_TCP,
    VIP_SNAT_UDP,
    Harness,
    nat_dual_tables,
    nat_vip,
    v6,
)
from .natcase import (
    BACKEND_MACS,
    ROUTER,
    ROUTER_MAC,
    Conn,
    NatCase,
    assert_all_pass,
    backend_port,
    by_state,
    expected_snat,
    opened,
    require_nat6,
    sums,
)
from .test_conformance import _check_advert, _solicit


def dest_opts(size: int) -> Packet:
    """A destination-options header of ``size`` bytes (a multiple of 8, 8..256)."""
    return IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\0" * (size - 4))])


#: Extension-header chains a NAT connection's frames carry, both ways.
EXT_CHAINS: dict[str, Packet] = {
    "hop-by-hop": IPv6ExtHdrHopByHop(),
    "hop-by-hop, destination options": IPv6ExtHdrHopByHop() / dest_opts(24),
    "atomic fragment": IPv6ExtHdrFragment(id=5),
    "exactly 256 bytes": dest_opts(256),
    "248 + 8 bytes": IPv6ExtHdrHopByHop() / dest_opts(248),
}
#: 264 bytes of extension headers: the L4 header beyond LB_NAT6_MAX_L4_OFF.
BEYOND = IPv6ExtHdrHopByHop() / dest_opts(256)


def test_nat6_extension_headers_are_carried_through(nat6: NatCase) -> None:
    """A connection whose frames carry extension headers (up to the bound,
    256 bytes): the addresses and ports rewritten, the headers kept as they
    are, the L4 checksum (found after them) right both ways; padding kept."""
    h = nat6.h
    nat6.load(pool=("198.18.3.140",))
    for n, (name, ext) in enumerate(EXT_CHAINS.items()):
        for m, vip in enumerate((VIP_NAT_TCP, VIP_SNAT_UDP)):
            c = nat6.conn(f"198.19.140.{1 + n}", 14000 + m, vip, ext=ext)
            payload = b"" if vip.proto == IPPROTO_TCP else b"q"
            assert opened(c.orig("S", payload)), name
            assert c.reply("SA", payload).events == ("conn_reply",), name
            assert c.orig("A", payload).events == ("conn_hit",), name
    short = nat6.conn("198.19.140.100", 14100, ext=IPv6ExtHdrHopByHop())
    short.orig("S")
    frame = short.orig_frame("A")
    padded = frame + bytes(range(1, 81 - len(frame)))
    v = sums(h, padded)
    plain = nat6.conn(short.client, short.cport, backend=short.backend, seen_as=short.seen_as,
                      ext=IPv6ExtHdrHopByHop())
    assert v.frame == plain.orig("A").frame + padded[len(frame):]


def test_nat6_beyond_the_bound_passes(nat6: NatCase) -> None:
    """More than 256 bytes of extension headers before the L4 header: NAT
    does not look at the packet, the kernel gets it (pass_ext_headers):
    to a NAT VIP (no connection opened), a connection's own packets either
    way, an ICMPv6 error quoting a connection's packet."""
    h = nat6.h
    nat6.load()
    c = nat6.conn("198.19.141.1", 15000)
    out = c.orig("S")
    assert c.backend is not None
    far = nat6.conn("198.19.141.2", 15001, ext=BEYOND)
    v = h.send(far.orig_frame("S"))
    assert (v.action, v.reason, v.events) == ("pass", "pass_ext_headers", ())
    assert far.state() is None
    beyond = dataclasses.replace(c, ext=BEYOND)
    for frame, port in ((beyond.orig_frame("A"), 0), (beyond.reply_frame("SA"), 1)):
        v = h.send(frame, port)
        assert (v.action, v.reason, v.events) == ("pass", "pass_ext_headers", ())
    err = bytes(Ether(src=ROUTER_MAC, dst=h.port_macs[1])
                / IPv6(src=nat6.a(ROUTER), dst=c.client) / BEYOND
                / ICMPv6PacketTooBig(mtu=1280) / Raw(out.frame[14:]))
    v = h.send(err, 1)
    assert (v.action, v.reason, v.events) == ("pass", "pass_ext_headers", ())
    assert c.state() == "syn_sent" and c.reply("SA").events == ("conn_reply",)


def _err6(icmp: Packet, src: str, dst: str, mac_src: str, mac_dst: str, quote: bytes,
          hlim: int = 64) -> bytes:
    return bytes(Ether(src=mac_src, dst=mac_dst) / IPv6(src=src, dst=dst, hlim=hlim) / icmp
                 / Raw(quote))


def _errors() -> dict[str, Packet]:
    """One message of each RFC 4443 error type, several codes (fresh layers:
    a case builds two frames of each)."""
    return {
        "no route": ICMPv6DestUnreach(code=0),
        "administratively prohibited": ICMPv6DestUnreach(code=1),
        "address unreachable": ICMPv6DestUnreach(code=3),
        "packet too big": ICMPv6PacketTooBig(mtu=1280),
        "hop limit exceeded": ICMPv6TimeExceeded(code=0),
        "reassembly time exceeded": ICMPv6TimeExceeded(code=1),
        "parameter problem": ICMPv6ParamProblem(code=0, ptr=6),
        "unrecognized next header": ICMPv6ParamProblem(code=1, ptr=40),
    }


def test_nat6_icmp_errors_of_every_type_reach_the_client(nat6: NatCase) -> None:
    """A router behind port 1 reports, with each ICMPv6 error type and
    several codes, a packet the gateway DNATed (and SNATed): it reaches the
    client from the VIP, out of port 0, the quote the client's own packet
    again (its L4 checksum too) and the ICMPv6 checksum, which covers the
    rewritten outer address through the pseudo-header, right."""
    h = nat6.h
    nat6.load(pool=("198.18.3.142",))
    for n, vip in enumerate((VIP_NAT_TCP, VIP_SNAT_TCP, VIP_NAT_UDP, VIP_SNAT_UDP)):
        c = nat6.conn(f"198.19.142.{1 + n}", 16000, vip)
        payload = b"" if vip.proto == IPPROTO_TCP else b"q"
        sent = c.orig_frame("PA" if vip.proto == IPPROTO_TCP else "", b"x" * 64 + payload)[14:]
        out = c.orig("PA" if vip.proto == IPPROTO_TCP else "", b"x" * 64 + payload)
        assert c.seen_as is not None
        for name, icmp in _errors().items():
            err = _err6(icmp.copy(), nat6.a(ROUTER), c.seen_as[0], ROUTER_MAC, h.port_macs[1],
                        out.frame[14:], hlim=60)
            v = sums(h, err, 1)
            assert (v.action, v.reason, v.port, v.events) == (
                "redirect", "fwd_redirect", 0, ("nat_icmp",)), name
            want = _err6(icmp.copy(), str(c.vip.addr), c.client, h.port_macs[0], CLIENT_MAC,
                         sent, hlim=60)
            assert v.frame.hex() == want.hex(), (vip.vip_id, name)


def test_nat6_time_exceeded_from_a_router_on_the_client_side(nat6: NatCase) -> None:
    """A router between the gateway and the client lets a reply's hop limit
    run out and tells its source, the VIP: the error goes to the backend
    (out of port 1, to its MAC), the quote the reply as the backend sent it,
    the outer destination the backend; with SNAT the quoted destination is
    the pool address again, and so is the outer source."""
    h = nat6.h
    nat6.load(pool=("198.18.3.143",))
    router = nat6.a("198.19.143.254")
    for n, vip in enumerate((VIP_NAT_TCP, VIP_SNAT_TCP, VIP_SNAT_UDP)):
        c = nat6.conn(f"198.19.143.{1 + n}", 17000, vip)
        payload = b"" if vip.proto == IPPROTO_TCP else b"q"
        c.orig("S", payload)
        assert c.backend is not None and c.seen_as is not None
        sent = c.reply_frame("SA", payload)[14:]
        v = c.reply("SA", payload)
        err = _err6(ICMPv6TimeExceeded(code=0), router, str(c.vip.addr), ROUTER_MAC,
                    h.port_macs[0], v.frame[14:], hlim=63)
        v = sums(h, err, 0)
        assert (v.action, v.reason, v.port, v.backend_id, v.events) == (
            "redirect", "fwd_redirect", 1, c.backend, ("nat_icmp",))
        src = c.seen_as[0] if vip.snat else router
        want = _err6(ICMPv6TimeExceeded(code=0), src, nat6.backend_addr(c.backend),
                     h.port_macs[1], BACKEND_MACS[c.backend], sent, hlim=63)
        assert v.frame.hex() == want.hex(), vip.vip_id


def test_nat6_udp_checksum_zero_is_kept(nat6: NatCase) -> None:
    """IPv6 forbids a UDP checksum of 0, but the gateway never makes a packet
    more right or more wrong than it came: 0 stays 0 both ways, and in a
    quote (the ICMPv6 checksum updated around it)."""
    h = nat6.h
    nat6.load(pool=("198.18.3.144",))
    for n, vip in enumerate((VIP_NAT_UDP, VIP_SNAT_UDP)):
        c = nat6.conn(f"198.19.144.{1 + n}", 18000, vip)
        sent = c.orig_frame(payload=b"zero", udp_zero=True)[14:]
        out = c.orig(payload=b"zero", udp_zero=True)
        assert out.frame[14 + 40 + 6 : 14 + 40 + 8] == b"\0\0"
        assert c.reply(payload=b"none", udp_zero=True).frame[14 + 40 + 6 : 14 + 40 + 8] == b"\0\0"
        assert c.backend is not None and c.seen_as is not None
        err = _err6(ICMPv6DestUnreach(code=4), nat6.backend_addr(c.backend), c.seen_as[0],
                    BACKEND_MACS[c.backend], h.port_macs[1], out.frame[14:])
        v = sums(h, err, 1)
        want = _err6(ICMPv6DestUnreach(code=4), str(c.vip.addr), c.client, h.port_macs[0],
                     CLIENT_MAC, sent)
        assert v.frame.hex() == want.hex(), vip.vip_id


def test_nat6_snat_takes_the_ipv6_pool(nat_harness: Harness) -> None:
    """A pool of both families: an IPv6 VIP's connections get addresses of
    the IPv6 entries only (snat_addrs6[(hash >> 32) % naddrs6]), an IPv4
    VIP's of the IPv4 entries only, each chosen as lb_conn.h says."""
    require_nat6(nat_harness.target)
    h = nat_harness
    pool4 = ("198.18.3.145", "198.18.3.146")
    pool6 = (v6("198.18.3.145"), v6("198.18.3.146"), v6("198.18.3.147"))
    port_range = (21000, 21999)
    t = nat_dual_tables(pool4, pool6)
    t.nat = dataclasses.replace(t.nat, snat_port_min=port_range[0], snat_port_max=port_range[1])
    h.load(t)
    seen6, seen4 = set(), set()
    for i in range(12):
        for family, vip, pool, seen in (
                (6, _twin6(VIP_SNAT_TCP), pool6, seen6), (4, VIP_SNAT_TCP, pool4, seen4)):
            client = f"198.19.145.{1 + i}" if family == 4 else v6(f"198.19.145.{1 + i}")
            c = Conn(h, client, 19000 + i, vip)
            assert opened(c.orig("S")) and c.backend is not None and c.seen_as is not None
            assert c.seen_as == expected_snat(client, c.cport, vip, pool, port_range, set(),
                                              c.backend), (family, i)
            seen.add(c.seen_as[0])
            assert c.reply("SA").events == ("conn_reply",)
    assert seen6 == set(pool6) and seen4 == set(pool4)
    assert h.conns()["snat_ports_in_use"] == 24


def _twin6(vip: Vip) -> Vip:
    """nat_dual_tables' IPv6 twin of an IPv4 NAT VIP."""
    return dataclasses.replace(nat_vip(vip, 6), vip_id=vip.vip_id + NAT6_VIP_ID_OFFSET)


def test_nat6_a_backend_of_the_other_family_is_no_backend(nat_harness: Harness) -> None:
    """No NAT64 (nor 46): an IPv6 NAT VIP whose ring picks an IPv4 backend,
    and an IPv4 NAT VIP whose ring picks an IPv6 one, drop the packet as
    drop_no_backend, opening nothing."""
    require_nat6(nat_harness.target)
    h = nat_harness
    t = nat_dual_tables(("198.18.3.148",), (v6("198.18.3.148"),))
    six = _twin6(VIP_NAT_TCP)
    t.rings[six.vip_id] = t.rings[VIP_NAT_TCP.vip_id]  # onto IPv4 backends 10..12
    t.rings[VIP_NAT_UDP.vip_id] = t.rings[_twin6(VIP_NAT_UDP).vip_id]  # onto IPv6 14..16
    h.load(t)
    for c in (Conn(h, v6("198.19.148.1"), 20000, six),
              Conn(h, "198.19.148.1", 20000, VIP_NAT_UDP)):
        v = c.orig("S", b"" if c.proto == IPPROTO_TCP else b"q")
        assert (v.action, v.reason, v.events) == ("drop", "drop_no_backend", ())
    assert h.conns()["entries"] == 0


def test_nat6_tables_side_by_side(small_nat_harness: Harness) -> None:
    """Each family has a connection table of its own, of the same capacity
    (three connections here): IPv4 connections filling theirs leave the
    IPv6 one empty, IPv6 connections open until theirs is full too, and a
    full table's refusal (drop_conn_full) or eviction stays in its family."""
    require_nat6(small_nat_harness.target)
    h = small_nat_harness
    h.load(nat_dual_tables(("198.18.3.149",), (v6("198.18.3.149"),)))
    four = [Conn(h, f"198.19.149.{1 + i}", 22000 + i) for i in range(4)]
    six = [Conn(h, v6(f"198.19.149.{1 + i}"), 22000 + i, _twin6(VIP_NAT_TCP)) for i in range(4)]
    for c in four[:3]:
        assert opened(c.orig("S"))
        c.reply("SA")
        c.orig("A")  # established: never evicted
    assert four[3].orig("S").reason == "drop_conn_full"
    for c in six[:3]:
        assert opened(c.orig("S"))  # the IPv4 table's being full is none of theirs
    v = six[3].orig("S")  # evicts the oldest embryonic IPv6 connection
    assert v.events == ("conn_evict", "conn_new")
    assert six[0].state() is None and all(c.state() == "established" for c in four[:3])
    assert four[3].orig("S").reason == "drop_conn_full"
    assert h.conns()["entries"] == 12
    assert by_state(h) == {"established": 3, "syn_sent": 3}
    for c in four[:3]:
        assert c.reply("PA", b"v4").events == ("conn_reply",)
    for c in six[1:]:
        assert c.reply("SA").events == ("conn_reply",)


def test_non_vip_traffic_passes_next_to_ipv6_nat(nat6: NatCase) -> None:
    """Next to IPv6 NAT VIPs: IPv6 to no VIP and no connection, to a NAT
    VIP's address on another port, ICMPv6 that is no error; fragments; a
    VLAN tag: all the kernel's, nothing opened."""
    h = nat6.h
    nat6.load()
    eth = Ether(src=CLIENT_MAC, dst=h.port_macs[0])
    src, vip = v6("198.19.146.1"), v6("198.18.2.10")
    frames = {
        "pass_not_vip": [
            bytes(eth / IPv6(src=src, dst=v6("198.18.9.9")) / TCP(sport=23000, dport=80)),
            bytes(eth / IPv6(src=src, dst=vip) / TCP(sport=23001, dport=81)),
            bytes(eth / IPv6(src=src, dst=vip) / ICMPv6EchoRequest()),
            bytes(eth / IPv6(src=src, dst=vip, nh=47) / b"gre!"),
            # IPv4 to the NAT VIP's IPv4 twin: no VIP of that family.
            bytes(eth / IP(src="198.19.146.1", dst="198.18.2.10") / TCP(sport=23002, dport=80)),
        ],
        "pass_fragment": [
            bytes(eth / IPv6(src=src, dst=vip) / IPv6ExtHdrFragment(m=1, id=3)
                  / TCP(sport=23003, dport=80) / (b"x" * 64)),
            bytes(eth / IPv6(src=src, dst=vip) / IPv6ExtHdrFragment(offset=8, nh=6, id=3)
                  / (b"y" * 64)),
        ],
        "pass_not_ipv4": [
            bytes(eth / Dot1Q(vlan=7) / IPv6(src=src, dst=vip) / TCP(sport=23004, dport=80)),
        ],
    }
    assert_all_pass(h, frames)


def test_ndp_for_an_ipv6_snat_address(nat6: NatCase) -> None:
    """ARP's IPv6 twin for the pool: the DPDK forwarder answers a Neighbor
    Solicitation for an IPv6 SNAT pool address (the backends send their
    replies there), from the port it was asked on; XDP leaves NDP to the
    kernel, which holds the pool addresses. Not for an address outside it."""
    h = nat6.h
    nat6.load(pool=("198.18.3.150", "198.18.3.151"))
    if h.target is None:
        assert h.model is not None
        h.model.answers_arp = True  # the model alone: as the DPDK forwarder
    answers = h.target is None or h.target.answers_arp
    for target in (v6("198.18.3.151"), v6("198.18.3.150")):
        request = _solicit(target, src=v6("198.19.150.1"))
        v = h.send(request)
        if answers:
            _check_advert(h, v, target, v6("198.19.150.1"))
        else:
            assert (v.action, v.reason) == ("pass", "pass_not_vip")
    request = _solicit(v6("198.18.3.152"), src=v6("198.19.150.1"))
    assert h.send(request).reason == "pass_not_vip"


def test_nat6_random_frames_with_extension_headers_never_disagree(nat6: NatCase) -> None:
    """Frames of IPv6 NAT connections carrying extension headers up to and
    past the bound (both directions, ICMPv6 errors about them, the errors
    behind extension headers too), random bytes changed after the MACs: the
    data plane does to every one what the model does."""
    import random

    rng = random.Random(6)
    h = nat6.h
    nat6.load(pool=("198.18.3.151",))
    base: list[tuple[bytes, int]] = []
    chains = (IPv6ExtHdrHopByHop(), dest_opts(248), dest_opts(256), BEYOND)
    for n, (vip, ext) in enumerate(zip((VIP_NAT_TCP, VIP_SNAT_UDP, VIP_SNAT_TCP, VIP_NAT_UDP),
                                       chains, strict=True)):
        c = nat6.conn(f"198.19.151.{1 + n}", 25000 + n, vip)
        payload = b"" if vip.proto == IPPROTO_TCP else b"q"
        out = c.orig("S", payload)
        assert c.backend is not None and c.seen_as is not None
        c.ext = ext
        base.append((c.orig_frame("A", payload), 0))
        base.append((c.reply_frame("SA", payload), backend_port(c.backend)))
        base.append((bytes(Ether(src=ROUTER_MAC, dst=h.port_macs[1])
                           / IPv6(src=nat6.a(ROUTER), dst=c.seen_as[0]) / ext.copy()
                           / ICMPv6PacketTooBig(mtu=1280) / Raw(out.frame[14:])), 1))
    for _ in range(300):
        frame, port = rng.choice(base)
        # Cut (a payload length then overruns the frame: malformed) only
        # now and then, so that most mutations reach NAT's own checks.
        cut = rng.randint(15, len(frame)) if rng.random() < 0.1 else len(frame)
        mutated = bytearray(frame[:cut])
        for _ in range(rng.randint(1, 2)):
            mutated[rng.randrange(14, len(mutated))] = rng.randrange(256)
        v = h.send(bytes(mutated), port)
        assert v.reason  # the harness compared it
    h.conns()


def test_model_ipv6_snat_without_an_ipv6_pool() -> None:
    """The model alone (the table protocol refuses such tables): an IPv6
    SNAT VIP with no IPv6 pool address has no reply key to offer, whatever
    the IPv4 pool holds: drop_snat_exhausted, nothing opened; an IPv4 SNAT
    VIP beside it takes the IPv4 pool as before."""
    h = Harness(None, ["02:00:00:00:00:01", "02:00:00:00:00:02"])
    h.load(nat_dual_tables(("198.18.3.152",), ()))
    six = Conn(h, v6("198.19.152.1"), 26000, _twin6(VIP_SNAT_TCP))
    v = six.orig("S")
    assert (v.action, v.reason, v.events) == ("drop", "drop_snat_exhausted", ())
    four = Conn(h, "198.19.152.1", 26000, VIP_SNAT_TCP)
    assert opened(four.orig("S")) and four.seen_as is not None
    assert four.seen_as[0] == "198.18.3.152"
    assert h.conns()["entries"] == 2
