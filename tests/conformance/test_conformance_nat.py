"""NAT gateway mode (``mode: nat``), run against the model and every data plane.

The specification is the header comment of ``dataplane/common/lb_conn.h``;
the rewrites are ``lb_nat.h``'s. As in test_conformance.py, the harness sends
every frame to the model and to the data plane under test and fails on the
first byte they disagree on; it also compares the NAT counters (conn_*,
nat_icmp) and, through ``Harness.conns``, the connection table's figures.
The asserts written here are the semantics, checked on the model's verdicts:
where a frame is translated, the whole expected frame is built with scapy
(every checksum computed in full) and must equal the output byte for byte,
and every frame that leaves has its checksums recomputed by scapy.

Every family-neutral case takes the ``nat`` fixture (natcase.NatCase) and
runs twice: as written (IPv4) and as its IPv6 twin, every address through
harness.v6, in the IPv6 connection table (NAT over IPv6 needs the hello's
"nat6" capability). IPv6's own cases are test_conformance_nat6.py.

The gateway is two-armed: clients on port 0, backends 10..12 behind port 1
(their replies and the routers' ICMP errors arrive on port 1). The session's
data plane keeps the connections of earlier cases (nothing expires), so each
case uses client addresses 198.19.1NN.x of its own and, with SNAT, a pool
address of its own.
"""

from __future__ import annotations

from scapy.layers.inet import ICMP, IP, TCP, UDP, IPOption_NOP
from scapy.layers.inet6 import (
    ICMPv6EchoReply,
    ICMPv6EchoRequest,
    ICMPv6ND_Redirect,
    ICMPv6PacketTooBig,
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
)
from scapy.layers.l2 import ARP, Dot1Q, Ether
from scapy.packet import Raw

from hpclb.contract.tables import IPPROTO_TCP, BackendState, NatDown, TableSet

from .harness import (
    BACKEND6_MACS,
    BACKEND_MACS,
    CLIENT_MAC,
    NAT_BACKEND_MACS,
    VIP_NAT_ONE_ARM,
    VIP_NAT_TCP,
    VIP_NAT_TWIN,
    VIP_NAT_UDP,
    VIP_SNAT_TCP,
    VIP_SNAT_UDP,
    Harness,
    dual_tables,
    nat_tables,
    tcp,
    udp,
    v6,
)
from .natcase import (
    ROUTER,
    ROUTER_MAC,
    NatCase,
    assert_all_pass,
    backend_port,
    by_state,
    expected_snat,
    ip_of,
    opened,
    sums,
)

# ---- both directions -------------------------------------------------------


def test_nat_tcp_both_directions(nat: NatCase) -> None:
    """Client -> VIP:80 is DNATed to a backend's 8080 out of port 1; the
    backend's reply on port 1 is translated back and sent out of port 0 to
    the client's MAC; the connection goes SYN_SENT, SYN_RECV, ESTABLISHED."""
    h = nat.h
    nat.load()
    c = nat.conn("198.19.100.1", 40000)
    v = c.orig("S")
    assert (v.action, v.reason, v.port, v.events) == ("redirect", "fwd_redirect", 1,
                                                       ("conn_new",))
    assert c.backend in (10, 11, 12)
    assert h.conns()["entries"] == 2 and by_state(h) == {"syn_sent": 1}
    v = c.reply("SA")
    assert (v.action, v.reason, v.port, v.events) == ("redirect", "fwd_redirect", 0,
                                                       ("conn_reply",))
    assert by_state(h) == {"syn_recv": 1}
    v = c.orig("A")
    assert (v.reason, v.events) == ("fwd_redirect", ("conn_hit",))
    assert by_state(h) == {"established": 1}
    for i in range(3):
        assert c.orig("PA", b"GET / HTTP/1.1\r\n" * (i + 1)).events == ("conn_hit",)
        assert c.reply("PA", b"HTTP/1.1 200 OK\r\n" * (i + 1)).events == ("conn_reply",)
    assert by_state(h) == {"established": 1} and h.conns()["entries"] == 2


def test_nat_connections_spread_and_stay(nat: NatCase) -> None:
    """New connections are balanced over the VIP's ring as in DSR mode (the
    flow hash of the 5-tuple), and each keeps its backend."""
    h = nat.h
    nat.load()
    conns = [nat.conn(f"198.19.101.{1 + i % 50}", 41000 + i) for i in range(60)]
    for c in conns:
        c.orig("S")
    assert {c.backend for c in conns} == {10, 11, 12}
    for c in conns[:20]:
        first = c.backend
        c.reply("SA")
        c.orig("A")
        assert c.backend == first
    assert by_state(h) == {"syn_sent": 40, "established": 20}
    assert h.conns()["entries"] == 120


def test_nat_one_arm_goes_back_out_of_its_port(nat: NatCase) -> None:
    """A backend on port 0 (one-arm): both directions leave by XDP_TX (fwd_tx)
    on port 0, the port the frame came in on."""
    h = nat.h
    nat.load()
    c = nat.conn("198.19.102.1", 42000, VIP_NAT_ONE_ARM)
    v = c.orig("S")
    assert (v.action, v.reason, v.port, c.backend) == ("tx", "fwd_tx", 0, 13)
    v = c.reply("SA")
    assert (v.action, v.reason, v.port) == ("tx", "fwd_tx", 0)
    assert c.orig("A").reason == "fwd_tx"
    assert by_state(h) == {"established": 1}


def test_nat_udp_both_directions(nat: NatCase) -> None:
    """UDP: UDP_UNREPLIED until the backend answers, UDP_REPLIED after; a NAT
    VIP without nat_port keeps its port towards the backend."""
    h = nat.h
    nat.load()
    c = nat.conn("198.19.103.1", 43000, VIP_NAT_UDP)
    v = c.orig(payload=b"query")
    assert (v.reason, v.events, c.bport) == ("fwd_redirect", ("conn_new",), 53)
    assert c.orig(payload=b"again").events == ("conn_hit",)
    assert by_state(h) == {"udp_unreplied": 1}
    assert c.reply(payload=b"answer").events == ("conn_reply",)
    assert by_state(h) == {"udp_replied": 1}
    assert c.orig(payload=b"more").events == ("conn_hit",)
    assert c.reply(payload=b"more answers").events == ("conn_reply",)
    assert by_state(h) == {"udp_replied": 1}


def test_nat_udp_checksum_zero_stays_zero(nat: NatCase) -> None:
    """A UDP checksum of 0 means "none" (RFC 768): it stays 0 both ways."""
    nat.load(pool=("198.18.3.103",))
    for vip in (VIP_NAT_UDP, VIP_SNAT_UDP):
        c = nat.conn("198.19.104.1", 44000 + vip.vip_id, vip)
        v = c.orig(payload=b"no checksum", udp_zero=True)
        assert Ether(v.frame)[UDP].chksum == 0
        v = c.reply(payload=b"none either", udp_zero=True)
        assert Ether(v.frame)[UDP].chksum == 0
        v = c.reply(payload=b"this one has one")
        assert Ether(v.frame)[UDP].chksum != 0


def _ones_diff(a: int, b: int) -> int:
    """a - b in one's complement (mod 0xffff): how far a checksum is off."""
    return (a - b) % 0xFFFF


def test_nat_wrong_checksum_stays_exactly_as_wrong(nat: NatCase) -> None:
    """The rewrites update checksums incrementally (RFC 1624), never
    recompute them: a segment that arrives with a bad checksum leaves with
    one exactly as far off, so the receiver still drops it."""
    h = nat.h
    nat.load()
    c = nat.conn("198.19.105.1", 45000)
    good = c.orig_frame("S")
    bad = bytearray(good)
    bad[14 + (20 if nat.family == 4 else 40) + 16] ^= 0x5A  # the TCP checksum
    v = h.send(bytes(bad))
    assert v.action == "redirect"
    out = Ether(v.frame)
    redo = out.copy()
    del redo[TCP].chksum
    correct = Ether(bytes(redo))[TCP].chksum
    good_in = Ether(good)[TCP].chksum
    bad_in = Ether(bytes(bad))[TCP].chksum
    assert out[TCP].chksum != correct
    assert _ones_diff(out[TCP].chksum, correct) == _ones_diff(bad_in, good_in)


def test_nat_ip_options_and_ethernet_padding(nat_harness: Harness) -> None:
    """IP options (the L4 header found through the IHL) and the padding of a
    60-byte frame: translated in place, padding kept as it was. (IPv6's
    twin, extension headers: test_conformance_nat6.py.)"""
    nat = NatCase(nat_harness, 4)
    h = nat.h
    nat.load()
    c = nat.conn("198.19.106.1", 46000)
    c.orig("S", options=[IPOption_NOP()] * 4)
    frame = c.orig_frame("A")
    assert len(frame) < 60
    padded = frame + bytes(range(1, 61 - len(frame)))
    v = sums(h, padded)
    assert v.events == ("conn_hit",)
    plain = nat.conn(c.client, c.cport, backend=c.backend, seen_as=c.seen_as)
    unpadded = plain.orig("A")  # the same segment, unpadded
    assert v.frame == unpadded.frame + padded[len(frame):]


def test_nat_replies_go_to_the_mac_of_the_clients_first_frame(nat: NatCase) -> None:
    """The connection remembers the source MAC of the client's first frame
    (the router in front of the clients) and the port it came in on: replies
    go there, whatever MAC the client's later frames come from."""
    nat.load()
    c = nat.conn("198.19.129.1", 39000, mac="02:aa:00:00:00:77")
    c.orig("S")
    c.mac = "02:aa:00:00:00:78"
    assert c.orig("A").events == ("conn_hit",)
    v = c.reply("PA", b"to the first MAC")
    assert Ether(v.frame).dst == "02:aa:00:00:00:77"
    other = nat.conn("198.19.129.2", 39001, mac="02:aa:00:00:00:79")
    other.orig("S")
    assert Ether(other.reply("SA").frame).dst == "02:aa:00:00:00:79"


# ---- the TCP state machine (lb_conn_next_state) -------------------------------

# (who, flags, state after): "c" the client (original direction), "b" the backend.
TCP_LIVES = {
    "handshake, FINs, TIME_WAIT reopened by a SYN, RST": [
        ("c", "S", "syn_sent"), ("b", "SA", "syn_recv"), ("c", "A", "established"),
        ("c", "PA", "established"), ("c", "FA", "fin_wait"), ("b", "A", "fin_wait"),
        ("b", "FA", "time_wait"), ("c", "A", "time_wait"), ("c", "S", "syn_sent"),
        ("b", "SA", "syn_recv"), ("c", "A", "established"), ("c", "R", "close"),
        ("c", "S", "syn_sent"), ("b", "SA", "syn_recv"), ("c", "A", "established"),
    ],
    "SYN_SENT waits for the backend's SYN+ACK; a backend RST closes": [
        ("c", "S", "syn_sent"), ("c", "A", "syn_sent"), ("c", "S", "syn_sent"),
        ("b", "A", "syn_sent"), ("b", "R", "close"), ("b", "SA", "close"),
        ("c", "A", "close"), ("c", "SA", "close"), ("c", "S", "syn_sent"),
    ],
    "a FIN in SYN_RECV, the other side's FIN": [
        ("c", "S", "syn_sent"), ("b", "SA", "syn_recv"), ("b", "F", "fin_wait"),
        ("b", "FA", "fin_wait"), ("c", "FA", "time_wait"), ("c", "SA", "time_wait"),
        ("b", "S", "time_wait"), ("c", "R", "close"),
    ],
    "picked up mid-stream; a reopened connection forgets the old FINs": [
        ("c", "A", "established"), ("b", "PA", "established"), ("b", "FA", "fin_wait"),
        ("c", "FA", "time_wait"), ("c", "S", "syn_sent"), ("b", "SA", "syn_recv"),
        ("c", "A", "established"), ("c", "FA", "fin_wait"), ("c", "FA", "fin_wait"),
        ("b", "RA", "close"),
    ],
    "an RST+ACK mid-stream": [
        ("c", "PA", "established"), ("c", "RA", "close"), ("b", "PA", "close"),
    ],
}


def test_nat_tcp_state_machine(nat: NatCase) -> None:
    """Every transition of lb_conn_next_state, seen in the connection table's
    figures after each segment; the connection keeps its backend and its
    translation throughout, a reopened one included."""
    h = nat.h
    nat.load()
    for n, (life, steps) in enumerate(TCP_LIVES.items()):
        c = nat.conn(f"198.19.107.{1 + n}", 47000 + n)
        for i, (who, flags, state) in enumerate(steps):
            v = c.orig(flags) if who == "c" else c.reply(flags)
            assert v.action == "redirect", (life, i)
            assert v.events == (("conn_new",) if i == 0 else
                                ("conn_hit",) if who == "c" else ("conn_reply",)), (life, i)
            assert c.state() == state, (life, i, who, flags)
            assert by_state(h).get(state, 0) >= 1
    assert h.conns()["entries"] == 2 * len(TCP_LIVES)
    assert by_state(h) == {"established": 1, "syn_sent": 1, "close": 3}


def test_nat_udp_state_machine(nat: NatCase) -> None:
    h = nat.h
    nat.load()
    c = nat.conn("198.19.108.1", 48000, VIP_NAT_UDP)
    c.orig(payload=b"1")
    assert c.state() == "udp_unreplied"
    c.orig(payload=b"2")
    assert c.state() == "udp_unreplied"
    c.reply(payload=b"3")
    assert c.state() == "udp_replied"
    c.orig(payload=b"4")
    c.reply(payload=b"5")
    assert c.state() == "udp_replied"
    assert by_state(h) == {"udp_replied": 1}


def test_nat_rst_opens_no_connection(nat: NatCase) -> None:
    """A TCP RST that matches no connection opens none: drop_conn_invalid.
    Any other segment opens one (a bare ACK: ESTABLISHED, mid-stream)."""
    h = nat.h
    nat.load()
    for i, flags in enumerate(("R", "RA", "SR")):
        c = nat.conn("198.19.109.1", 49000 + i)
        v = c.orig(flags)
        assert (v.action, v.reason, v.events) == ("drop", "drop_conn_invalid", ())
    assert h.conns()["entries"] == 0
    c = nat.conn("198.19.109.2", 49100)
    assert opened(c.orig("A"))
    assert c.state() == "established"
    c = nat.conn("198.19.109.3", 49101)
    assert opened(c.orig("FA"))
    assert c.state() == "established"  # the open state, then no transition on this packet
    assert h.conns()["entries"] == 4


# ---- what is not NAT's ------------------------------------------------------------


def test_nat_reply_of_no_connection_passes(nat: NatCase) -> None:
    """A frame for no VIP that is no connection's reply goes to the kernel,
    whichever port it arrives on."""
    h = nat.h
    nat.load(pool=("198.18.3.110",))
    c = nat.conn("198.19.110.1", 50000)
    c.orig("S")
    stray = [
        nat.conn("198.19.110.2", 50001, backend=11, seen_as=(nat.a("198.19.110.2"), 50001)),
        nat.conn("198.19.110.1", 50002, backend=c.backend,
                 seen_as=(nat.a("198.19.110.1"), 50002)),
        nat.conn("198.19.110.1", 50000, VIP_SNAT_TCP, backend=12,
                 seen_as=(nat.a("198.18.3.110"), 1024)),
    ]
    for s in stray:
        v = s.reply("SA")
        assert (v.action, v.reason, v.events) == ("pass", "pass_not_vip", ())
    # The connection's own reply, from the wrong source port: not it either.
    assert c.backend is not None
    wrong = bytes(Ether(src=NAT_BACKEND_MACS[c.backend], dst=h.port_macs[1])
                  / ip_of(nat.family, nat.backend_addr(c.backend), c.client)
                  / TCP(sport=8081, dport=c.cport, flags="SA"))
    assert h.send(wrong, 1).reason == "pass_not_vip"
    assert c.reply("SA").events == ("conn_reply",)


def test_non_vip_traffic_passes_in_nat_mode(nat_harness: Harness) -> None:
    """(IPv6's twin, next to IPv6 NAT VIPs: test_conformance_nat6.py.)"""
    nat = NatCase(nat_harness, 4)
    h = nat.h
    nat.load()
    eth = Ether(src=CLIENT_MAC, dst=h.port_macs[0])
    frames = {
        "pass_not_vip": [
            tcp("198.19.111.1", 51000, dst="198.18.9.9"),
            udp("198.19.111.1", 51000, dst="198.18.9.9"),
            tcp("198.19.111.1", 51001, dst="198.18.2.10", dport=81),  # the VIP, another port
            bytes(eth / IP(src="198.19.111.1", dst="198.18.2.10") / ICMP()),  # echo request
            bytes(eth / IP(src="198.19.111.1", dst="198.18.2.10", proto=47) / b"gre"),
        ],
        "pass_fragment": [
            bytes(eth / IP(src="198.19.111.1", dst="198.18.2.10", flags="MF")
                  / UDP(sport=51002, dport=53) / (b"x" * 64)),
            bytes(eth / IP(src="198.19.111.1", dst="198.18.2.10", frag=8, proto=6)
                  / (b"y" * 64)),
        ],
        # IPv6 next to NAT VIPs (NAT mode is IPv4 only): to the NAT VIPs'
        # twin addresses and ports, no VIP's.
        "pass_not_ipv4": [
            bytes(eth / Dot1Q(vlan=7) / IP(src="198.19.111.1", dst="198.18.2.10")
                  / TCP(sport=51003, dport=80)),
        ],
    }
    frames["pass_not_vip"] += [
        bytes(eth / IPv6(src=v6("198.19.111.1"), dst=v6("198.18.2.10")) / TCP(dport=80)),
        bytes(eth / IPv6(src=v6("198.19.111.1"), dst=v6("198.18.2.11")) / UDP(dport=53)),
        bytes(eth / IPv6(src=v6("198.19.111.1"), dst=v6("198.18.2.10")) / ICMPv6EchoRequest()),
    ]
    frames["pass_fragment"].append(
        bytes(eth / IPv6(src=v6("198.19.111.1"), dst=v6("198.18.2.10"))
              / IPv6ExtHdrFragment(m=1) / TCP(sport=51004, dport=80) / (b"x" * 64)))
    assert_all_pass(h, frames)


def test_original_direction_after_its_vip_went_away(nat: NatCase) -> None:
    """A connection whose VIP was deleted: the client's packets are no VIP's
    and match an original entry, so they pass to the kernel; the backend's
    replies still find their entry and are translated back (the table keeps
    the connection until it expires)."""
    h = nat.h
    nat.load()
    c = nat.conn("198.19.112.1", 52000)
    c.orig("S")
    c.reply("SA")
    c.orig("A")
    nat.load(without=(VIP_NAT_TCP.vip_id,))
    v = c.orig("PA", b"after")
    assert (v.action, v.reason, v.events) == ("pass", "pass_not_vip", ())
    assert c.reply("PA", b"still here").events == ("conn_reply",)
    assert by_state(h) == {"established": 1}
    nat.load()  # the VIP is back: the connection was never gone
    assert c.orig("PA", b"back").events == ("conn_hit",)


def _nat_and_dual_tables() -> TableSet:
    """nat_tables plus dual_tables' IPv6 DSR VIPs and backends."""
    t, dual = nat_tables(), dual_tables()
    t.backends = {**dual.backends, **t.backends}
    t.vips = {**dual.vips, **t.vips}
    t.rings = {**dual.rings, **t.rings}
    return t


def test_dsr_unchanged_next_to_nat(nat_harness: Harness) -> None:
    """DSR VIPs of both families in the same tables as NAT VIPs: the same
    backends as without them, only the MACs rewritten, no connection."""
    h = nat_harness
    flows = [tcp(f"198.19.113.{1 + i % 100}", 53000 + i) for i in range(60)]
    flows += [udp(f"198.19.113.{1 + i}", 53500 + i) for i in range(20)]
    flows += [tcp("198.19.113.200", 53900, dst="198.18.1.11")]  # the two-arm DSR VIP
    flows += [tcp(f"fd00:19:113::{1 + i % 50}", 53000 + i, dst="fd00:18::10")
              for i in range(30)]
    flows += [udp("fd00:19:113::200", 53500 + i, dst="fd00:18::10") for i in range(10)]
    alone = Harness(None, h.port_macs)
    alone.load(dual_tables())
    expected = [alone.send(f) for f in flows]
    h.load(_nat_and_dual_tables())
    macs = {**BACKEND_MACS, **BACKEND6_MACS}
    for frame, before in zip(flows, expected, strict=True):
        v = h.send(frame)
        assert (v.action, v.reason, v.backend_id, v.frame, v.events) == (
            before.action, before.reason, before.backend_id, before.frame, ())
        assert v.frame[12:] == frame[12:]
        assert v.backend_id is not None
        assert v.frame[:6] == bytes.fromhex(macs[v.backend_id].replace(":", ""))
    assert h.conns()["entries"] == 0


def test_arp_for_a_snat_address(nat_harness: Harness) -> None:
    """The DPDK forwarder owns its ports, so it answers ARP for the SNAT pool
    (the backends send their replies there) from the port it was asked on;
    XDP leaves ARP to the kernel, which holds the pool addresses."""
    nat = NatCase(nat_harness, 4)
    h = nat.h
    nat.load(pool=("198.18.3.114", "198.18.3.115"))
    if h.target is None:
        assert h.model is not None
        h.model.answers_arp = True  # the model alone: as the DPDK forwarder
    answers = h.target is None or h.target.answers_arp
    for target_ip, port in (("198.18.3.115", 1), ("198.18.3.114", 1), ("198.18.2.10", 0)):
        asker = NAT_BACKEND_MACS[10] if port == 1 else CLIENT_MAC
        request = bytes(Ether(src=asker, dst="ff:ff:ff:ff:ff:ff")
                        / ARP(op=1, hwsrc=asker, psrc="198.18.0.20", pdst=target_ip))
        v = h.send(request, port)
        if not answers:
            assert (v.action, v.reason) == ("pass", "pass_not_ipv4")
            continue
        reply = Ether(v.frame)
        assert (v.action, v.reason, v.port) == ("tx", "arp_reply", port)
        assert (reply.dst, reply.src) == (asker, h.port_macs[port])
        assert (reply[ARP].op, reply[ARP].psrc, reply[ARP].hwsrc) == (
            2, target_ip, h.port_macs[port])
    v = h.send(bytes(Ether(src=CLIENT_MAC, dst="ff:ff:ff:ff:ff:ff")
                     / ARP(op=1, hwsrc=CLIENT_MAC, psrc="198.18.0.20", pdst="198.18.3.116")), 1)
    assert v.reason == "pass_not_ipv4"


# ---- SNAT ---------------------------------------------------------------------


def test_nat_snat_allocation_is_deterministic(nat: NatCase) -> None:
    """With SNAT the backend sees a pool address and port that the flow hash
    chooses (the next candidates when taken); its reply to that pair goes back
    to the client, from the VIP."""
    h = nat.h
    pool = ("198.18.3.116", "198.18.3.117")
    port_range = (20000, 20011)  # few enough ports that candidates collide
    nat.load(pool=pool, port_range=port_range)
    pool = tuple(nat.a(a) for a in pool)
    taken: set[tuple[int, str, int, int]] = set()
    conns = []
    for i in range(24):
        c = nat.conn(f"198.19.116.{1 + i % 6}", 56000 + i, VIP_SNAT_TCP)
        v = c.orig("S")
        assert opened(v) and c.backend is not None and c.seen_as is not None
        want = expected_snat(c.client, c.cport, c.vip, pool, port_range, taken, c.backend)
        assert c.seen_as == want, i
        taken.add((c.backend, *c.seen_as, IPPROTO_TCP))
        conns.append(c)
    assert {c.seen_as[0] for c in conns if c.seen_as} == set(pool)
    assert h.conns()["snat_ports_in_use"] == 24
    for c in conns:
        assert c.reply("SA").events == ("conn_reply",)
        assert c.orig("A").events == ("conn_hit",)
    assert by_state(h) == {"established": 24}
    # Without SNAT on the same backends the client's own address is kept.
    plain = nat.conn("198.19.116.100", 56100)
    plain.orig("S")
    assert plain.seen_as == (plain.client, plain.cport)
    assert h.conns()["snat_ports_in_use"] == 24


def test_nat_snat_exhausted(nat: NatCase) -> None:
    """A range of two ports, one backend: the third connection to it finds no
    free reply key among the probes: drop_snat_exhausted, nothing inserted.
    The reply key carries the protocol: UDP has its own two ports."""
    h = nat.h
    pool = ("198.18.3.118",)
    port_range = (30000, 30001)
    nat.load(pool=pool, port_range=port_range, snat_weights={10: 1.0})
    first = [nat.conn(f"198.19.118.{1 + i}", 58000 + i, VIP_SNAT_TCP) for i in range(3)]
    for c in first[:2]:
        assert opened(c.orig("S")) and c.backend == 10
    assert {c.seen_as for c in first[:2]} == {(nat.a(pool[0]), 30000), (nat.a(pool[0]), 30001)}
    v = first[2].orig("S")
    assert (v.action, v.reason, v.events) == ("drop", "drop_snat_exhausted", ())
    assert first[2].orig("A").reason == "drop_snat_exhausted"
    assert first[2].orig("R").reason == "drop_conn_invalid"  # checked first
    assert h.conns()["entries"] == 4 and h.conns()["snat_ports_in_use"] == 2
    # Closed connections keep their ports (only the sweep frees them).
    first[0].orig("R")
    assert first[2].orig("S").reason == "drop_snat_exhausted"
    udp_conns = [nat.conn(f"198.19.118.{1 + i}", 58000 + i, VIP_SNAT_UDP) for i in range(3)]
    for c in udp_conns[:2]:
        assert opened(c.orig(payload=b"q"))
    assert udp_conns[2].orig(payload=b"q").reason == "drop_snat_exhausted"
    assert h.conns()["snat_ports_in_use"] == 4
    # Existing connections are not affected.
    assert first[1].reply("SA").events == ("conn_reply",)
    assert udp_conns[0].reply(payload=b"a").events == ("conn_reply",)


def test_nat_reply_key_taken_without_snat(nat: NatCase) -> None:
    """Without SNAT the reply key is (backend, client, backend port, client
    port): one client address and port through two VIPs onto one backend
    port would share it, and the backend's replies could not be told apart.
    The second connection is refused as having no free reply key
    (drop_snat_exhausted); the first is untouched. With another client port
    or a backend of its own it opens."""
    h = nat.h
    nat.load(weights={10: 1.0})
    first = nat.conn("198.19.119.1", 59000, VIP_NAT_TCP)
    assert opened(first.orig("S")) and first.backend == 10
    twin = nat.conn("198.19.119.1", 59000, VIP_NAT_TWIN)
    v = twin.orig("S")
    assert (v.action, v.reason, v.events) == ("drop", "drop_snat_exhausted", ())
    assert h.conns()["entries"] == 2
    assert first.reply("SA").events == ("conn_reply",)
    assert first.orig("A").events == ("conn_hit",)
    other = nat.conn("198.19.119.1", 59001, VIP_NAT_TWIN)
    assert opened(other.orig("S"))
    assert other.reply("SA").events == ("conn_reply",)
    assert by_state(h) == {"established": 1, "syn_recv": 1}


# ---- a full table (fresh data planes whose table holds three connections) ------


def test_nat_full_table_evicts_the_oldest_embryonic(small_nat: NatCase) -> None:
    """Three connections fill the table. The next one evicts the oldest
    embryonic connection (both entries; conn_evict), in creation order."""
    nat = small_nat
    h = nat.h
    nat.load()
    a, b, c, d = (nat.conn(f"198.19.120.{1 + i}", 60000 + i) for i in range(4))
    for x in (a, b, c):
        assert opened(x.orig("S"))
    c.reply("SA")  # SYN_RECV: still embryonic
    assert h.conns()["entries"] == 6
    v = d.orig("S")
    assert v.events == ("conn_evict", "conn_new") and v.action == "redirect"
    assert a.state() is None and h.conns()["entries"] == 6
    assert a.reply("SA").reason == "pass_not_vip"  # its entries are gone
    v = a.orig("S")  # a opens anew, evicting b
    assert v.events == ("conn_evict", "conn_new")
    assert b.state() is None and b.reply("SA").reason == "pass_not_vip"
    u = nat.conn("198.19.120.9", 60009, VIP_NAT_UDP)
    assert u.orig(payload=b"q").events == ("conn_evict", "conn_new")  # evicts c
    assert c.reply("A").reason == "pass_not_vip"
    assert by_state(h) == {"syn_sent": 2, "udp_unreplied": 1}
    assert d.reply("SA").events == ("conn_reply",)
    assert a.reply("SA").events == ("conn_reply",)


def test_nat_full_table_never_evicts_an_established_connection(
        small_nat: NatCase) -> None:
    """Established connections are never evicted: keys of connections that
    grew up are skipped (and dropped from the FIFO), and with nothing
    embryonic left a new connection is refused: drop_conn_full."""
    nat = small_nat
    h = nat.h
    nat.load()
    a, b, c, d, e, f = (nat.conn(f"198.19.121.{1 + i}", 61000 + i) for i in range(6))
    a.orig("S")
    a.reply("SA")
    a.orig("A")  # established; its key still in the FIFO
    b.orig("A")  # opened established: never in the FIFO
    c.orig("S")
    assert by_state(h) == {"established": 2, "syn_sent": 1}
    v = d.orig("S")  # a's key skipped, c evicted
    assert v.events == ("conn_evict", "conn_new")
    assert a.state() == "established" and c.state() is None
    assert e.orig("S").events == ("conn_evict", "conn_new")  # evicts d
    e.reply("SA")
    e.orig("A")
    assert by_state(h) == {"established": 3}
    v = f.orig("S")
    assert (v.action, v.reason, v.events) == ("drop", "drop_conn_full", ())
    u = nat.conn("198.19.121.9", 61009, VIP_NAT_UDP)
    assert u.orig(payload=b"q").reason == "drop_conn_full"
    assert f.orig("A").reason == "drop_conn_full"
    assert h.conns()["entries"] == 6
    for x in (a, b, e):
        assert x.orig("PA", b"fine").events == ("conn_hit",)
        assert x.reply("PA", b"fine").events == ("conn_reply",)
    b.orig("R")  # CLOSE is not embryonic either: still full
    assert f.orig("S").reason == "drop_conn_full"


def _backend_of(nat: NatCase, tables_: TableSet, client: str, cport: int) -> int:
    """The backend a new connection to VIP_NAT_TCP gets (asked of a model of
    its own)."""
    scratch = Harness(None, ["02:00:00:00:00:01", "02:00:00:00:00:02"])
    scratch.load(tables_)
    c = NatCase(scratch, nat.family).conn(client, cport)
    c.orig("S")
    assert c.backend is not None
    return c.backend


def test_nat_eviction_fifo_holds_a_table_size_of_keys(small_nat: NatCase) -> None:
    """lb_conn.h: the FIFO of embryonic keys is "of the table's size" (here 6
    keys for 3 connections): a rescheduled connection's key goes in again,
    its stale key stays, and the oldest embryonic key is still there when
    the table fills. (A FIFO of 3 keys would have dropped x's key for y's
    second one, and evicted y instead of x.)"""
    nat = small_nat
    h = nat.h
    tables_ = nat.tables()
    y_backend = _backend_of(nat, tables_, "198.19.131.2", 31100)
    x_port, z_port = (next(p for p in range(first, first + 200)
                           if _backend_of(nat, tables_, client, p) != y_backend)
                      for client, first in (("198.19.131.1", 31000), ("198.19.131.3", 31200)))
    h.load(tables_)
    x = nat.conn("198.19.131.1", x_port)
    y = nat.conn("198.19.131.2", 31100)
    z = nat.conn("198.19.131.3", z_port)
    x.orig("S")  # FIFO: x
    y.orig("S")  # x, y
    y.reply("SA")
    y.orig("A")
    z.orig("S")  # x, y, z: the table is full
    z.reply("SA")
    z.orig("A")
    assert y.backend == y_backend and y_backend not in (x.backend, z.backend)
    assert by_state(h) == {"established": 2, "syn_sent": 1}
    nat.load(states={y_backend: BackendState.DOWN})
    v = y.orig("S")  # rescheduled: x, y, z, y
    assert v.events == ("conn_reschedule", "conn_new") and y.state() == "syn_sent"
    w = nat.conn("198.19.131.4", 31300)
    v = w.orig("S")  # x, the oldest, is still embryonic: evicted
    assert v.events == ("conn_evict", "conn_new")
    assert x.state() is None and y.state() == "syn_sent" and z.state() == "established"
    assert by_state(h) == {"established": 1, "syn_sent": 2}
    assert x.reply("SA").reason == "pass_not_vip"  # the data plane evicted x too
    assert y.reply("SA").events == ("conn_reply",)


# ---- ICMP errors ----------------------------------------------------------------


def test_nat_icmp_fragmentation_needed_from_a_router(nat: NatCase) -> None:
    """A router behind port 1 cannot forward a DNATed packet (fragmentation
    needed, RFC 1191) and tells its source, the client: the quote becomes the
    client's packet again (to the VIP, every checksum back to what the client
    sent), the error comes from the VIP, out of port 0 to the client's MAC.
    The same with the 8-byte quote of RFC 792, and with SNAT (the error then
    comes to the pool address, and reaches the client)."""
    h = nat.h
    nat.load(pool=("198.18.3.122",))
    for n, vip in enumerate((VIP_NAT_TCP, VIP_SNAT_TCP)):
        c = nat.conn(f"198.19.122.{1 + n}", 62000, vip)
        sent = nat.ip(c.orig_frame("PA", b"x" * 200))
        out = c.orig("PA", b"x" * 200)
        assert c.seen_as is not None
        forwarded = nat.ip(out.frame)
        hl = 20 if nat.family == 4 else 40
        # The whole packet, RFC 792's 8 bytes of L4, the TCP checksum just
        # in; IPv4 options in the outer header.
        cuts: list[tuple[int, dict[str, object]]] = [
            (len(forwarded), {}), (hl + 8, {}), (hl + 18, {})]
        if nat.family == 4:
            cuts.append((len(forwarded), {"options": [IPOption_NOP()] * 4}))
        for quote_len, ip in cuts:
            err = nat.icmp(nat.a(ROUTER), c.seen_as[0], ROUTER_MAC, h.port_macs[1], 3, 4,
                           forwarded[:quote_len], ttl=250, **ip)
            v = sums(h, err, 1)
            assert (v.action, v.reason, v.port, v.events) == ("redirect", "fwd_redirect", 0,
                                                               ("nat_icmp",))
            want = nat.icmp(str(c.vip.addr), c.client, h.port_macs[0], CLIENT_MAC, 3, 4,
                            sent[:quote_len], ttl=250, **ip)
            assert v.frame.hex() == want.hex(), (vip, quote_len, ip)
    assert by_state(h) == {"established": 2}


def test_nat_icmp_port_unreachable_from_the_backend(nat: NatCase) -> None:
    """The backend has no socket on the port (UDP): its port unreachable,
    about the DNATed datagram, reaches the client from the VIP quoting the
    datagram the client sent (a quoted UDP checksum of 0 stays 0)."""
    h = nat.h
    nat.load(pool=("198.18.3.123",))
    for n, (vip, zero) in enumerate(((VIP_NAT_UDP, False), (VIP_SNAT_UDP, False),
                                     (VIP_NAT_UDP, True))):
        c = nat.conn(f"198.19.123.{1 + n}", 63000, vip)
        sent = nat.ip(c.orig_frame(payload=b"query", udp_zero=zero))
        out = c.orig(payload=b"query", udp_zero=zero)
        assert c.backend is not None and c.seen_as is not None
        err = nat.icmp(nat.backend_addr(c.backend), c.seen_as[0], NAT_BACKEND_MACS[c.backend],
                       h.port_macs[1], 3, 3, nat.ip(out.frame))
        v = sums(h, err, 1)
        assert (v.action, v.reason, v.port, v.events) == ("redirect", "fwd_redirect", 0,
                                                           ("nat_icmp",))
        want = nat.icmp(str(c.vip.addr), c.client, h.port_macs[0], CLIENT_MAC, 3, 3, sent)
        assert v.frame.hex() == want.hex(), (vip, zero)
        assert c.state() == "udp_unreplied"  # an error is no reply


def test_nat_icmp_from_the_client_about_a_reply(nat: NatCase) -> None:
    """The client side reports an error about a reply it got (from the VIP):
    it goes to the backend (out of port 1, to its MAC), quoting the reply as
    the backend sent it (from its own address and port, to the client or the
    SNAT pair), the outer destination the backend, or with SNAT the outer
    source the pool address."""
    h = nat.h
    nat.load(pool=("198.18.3.124",))
    cases = ((VIP_NAT_TCP, 3, 3), (VIP_NAT_TCP, 11, 0), (VIP_SNAT_TCP, 3, 13),
             (VIP_NAT_UDP, 12, 0), (VIP_SNAT_UDP, 3, 3))
    for n, (vip, itype, code) in enumerate(cases):
        c = nat.conn(f"198.19.124.{1 + n}", 64000, vip)
        payload = b"" if vip.proto == IPPROTO_TCP else b"q"
        c.orig("S", payload)
        assert c.backend is not None and c.seen_as is not None
        sent = nat.ip(c.reply_frame("SA", payload))
        v = c.reply("SA", payload)
        err = nat.icmp(c.client, str(c.vip.addr), CLIENT_MAC, h.port_macs[0], itype, code,
                       nat.ip(v.frame), ttl=33)
        v = sums(h, err, 0)
        assert (v.action, v.reason, v.port, v.backend_id, v.events) == (
            "redirect", "fwd_redirect", 1, c.backend, ("nat_icmp",))
        src = c.seen_as[0] if vip.snat else c.client
        want = nat.icmp(src, nat.backend_addr(c.backend), h.port_macs[1],
                        NAT_BACKEND_MACS[c.backend], itype, code, sent, ttl=33)
        assert v.frame.hex() == want.hex(), (vip, itype, code)


def test_nat_icmp_for_a_backend_that_left_the_tables(nat: NatCase) -> None:
    """An error from the client side about a reply of a backend that has
    since been removed from the tables has nowhere to go: counted nat_icmp,
    dropped drop_tx_error. The connection's next packet finds its backend
    gone, which is down: rescheduled."""
    h = nat.h
    nat.load()
    c = nat.conn("198.19.132.1", 33000)
    c.orig("S")
    v = c.reply("SA")
    gone = c.backend
    assert gone is not None
    tables_ = nat.tables(weights={b: 1.0 for b in (10, 11, 12) if b != gone})
    del tables_.backends[gone]
    h.load(tables_)
    err = nat.icmp(c.client, str(c.vip.addr), CLIENT_MAC, h.port_macs[0], 3, 3,
                   nat.ip(v.frame))
    v = h.send(err, 0)
    assert (v.action, v.reason, v.events) == ("drop", "drop_tx_error", ("nat_icmp",))
    assert c.orig("A").events == ("conn_reschedule", "conn_new")
    assert c.backend != gone


def test_nat_icmp_that_is_no_connections_passes(nat: NatCase) -> None:
    """ICMP that is not an error, an error quoting no connection's packet, a
    quote too short for its ports, a fragmented error: to the kernel."""
    h = nat.h
    nat.load()
    c = nat.conn("198.19.125.1", 65000)
    out = nat.ip(c.orig("S").frame)
    assert c.backend is not None
    stranger = bytes(ip_of(nat.family, nat.a("198.19.125.2"), nat.backend_addr(c.backend))
                     / TCP(sport=65000, dport=8080, flags="S"))
    router = nat.a(ROUTER)

    def err(itype: int, code: int, quote: bytes, **ip: object) -> bytes:
        return nat.icmp(router, c.client, ROUTER_MAC, h.port_macs[1], itype, code, quote, **ip)

    hl = 20 if nat.family == 4 else 40
    frames = [err(3, 4, stranger), err(3, 4, out[: hl + 7])]
    eth = Ether(src=ROUTER_MAC, dst=h.port_macs[1])
    if nat.family == 4:
        frames += [
            err(0, 0, out),  # echo reply
            err(5, 0, out),  # redirect
            err(3, 4, out, flags="MF"),  # a fragmented error
        ]
        # A quote whose inner header says it is a later fragment: no ports in it.
        later = bytearray(out)
        later[6:8] = (0x0010).to_bytes(2, "big")
        frames.append(err(3, 4, bytes(later)))
    else:
        ip6 = IPv6(src=router, dst=c.client)
        frames += [
            bytes(eth / ip6 / ICMPv6EchoReply() / Raw(out)),
            bytes(eth / ip6 / ICMPv6ND_Redirect(tgt=router, dst=c.client) / Raw(out)),
            # A fragmented error (its first fragment).
            bytes(eth / ip6 / IPv6ExtHdrFragment(m=1, id=9) / ICMPv6PacketTooBig(mtu=1280)
                  / Raw(out)),
            # A quoted packet whose payload length leaves no room for ports.
            err(3, 4, out[:4] + (4).to_bytes(2, "big") + out[6:]),
            # A quote whose inner packet has an extension header: not looked at.
            bytes(eth / ip6 / ICMPv6PacketTooBig(mtu=1280)
                  / Raw(bytes(IPv6(out[:40]) / IPv6ExtHdrDestOpt() / Raw(out[40:])))),
        ]
    for frame in frames:
        v = h.send(frame, 1)
        assert (v.action, v.reason, v.events) == ("pass", "pass_not_vip", ())


# ---- backends going down ----------------------------------------------------------


def test_nat_backend_down_reschedules(nat: NatCase) -> None:
    """on_backend_down reschedule: the next packet of a connection whose
    backend is down deletes it and opens a new one on an up backend
    (conn_reschedule, conn_new); the old backend's replies find nothing.
    A draining backend keeps its connections."""
    h = nat.h
    nat.load()
    conns = [nat.conn(f"198.19.126.{1 + i}", 36600 + i) for i in range(30)]
    for c in conns:
        c.orig("S")
        c.reply("SA")
        c.orig("A")
    victim = conns[0].backend
    drained = next(c.backend for c in conns if c.backend != victim)
    assert victim is not None and drained is not None
    nat.load(states={drained: BackendState.DRAINING})
    for c in conns:
        assert c.orig("PA", b"draining").events == ("conn_hit",)
    fresh = nat.conn("198.19.126.200", 36699)
    assert opened(fresh.orig("S")) and fresh.backend != drained
    nat.load(states={victim: BackendState.DOWN})
    moved = [c for c in conns if c.backend == victim]
    stayed = [c for c in conns if c.backend != victim]
    assert len(moved) >= 2
    for c in stayed:
        assert c.orig("PA", b"on").events == ("conn_hit",)
        assert c.reply("PA", b"on").events == ("conn_reply",)
    old = [nat.conn(c.client, c.cport, backend=c.backend, seen_as=c.seen_as) for c in moved]
    for c in moved[1:]:
        v = c.orig("PA", b"moving")
        assert v.events == ("conn_reschedule", "conn_new")
        assert c.backend != victim and c.state() == "established"
    for o in old[1:]:
        assert o.reply("PA", b"late").reason == "pass_not_vip"
    v = moved[0].orig("R")  # deleted, then refused like any unknown RST
    assert (v.reason, v.events) == ("drop_conn_invalid", ("conn_reschedule",))
    assert moved[0].state() is None
    for c in moved[1:]:
        assert c.reply("PA", b"new backend").events == ("conn_reply",)
    assert by_state(h) == {"established": len(conns) - 1, "syn_sent": 1}


def test_nat_backend_down_drops(nat: NatCase) -> None:
    """on_backend_down drop: the connection's packets are dropped
    (drop_backend_down) until the backend is back; then it goes on, on the
    same backend. Only the original direction looks at the backend's state:
    what the down backend still sends is translated back."""
    h = nat.h
    nat.load(down=NatDown.DROP)
    c = nat.conn("198.19.127.1", 37700)
    c.orig("S")
    c.reply("SA")
    c.orig("A")
    assert c.backend is not None
    nat.load(down=NatDown.DROP, states={c.backend: BackendState.DOWN})
    for flags in ("PA", "S", "R"):
        v = c.orig(flags)
        assert (v.action, v.reason, v.events) == ("drop", "drop_backend_down", ())
    assert c.reply("PA", b"still talking").events == ("conn_reply",)
    fresh = nat.conn("198.19.127.2", 37701)
    assert fresh.orig("S").action == "redirect" and fresh.backend != c.backend
    nat.load(down=NatDown.DROP)
    before = c.backend
    assert c.orig("PA", b"back").events == ("conn_hit",) and c.backend == before
    assert by_state(h) == {"established": 1, "syn_sent": 1}


def test_nat_all_backends_down(nat: NatCase) -> None:
    h = nat.h
    down = dict.fromkeys((10, 11, 12), BackendState.DOWN)
    nat.load(states=down)
    for i, vip in enumerate((VIP_NAT_TCP, VIP_NAT_UDP, VIP_SNAT_TCP)):
        c = nat.conn("198.19.128.1", 38800 + i, vip)
        v = c.orig("S", b"" if vip.proto == IPPROTO_TCP else b"q")
        assert (v.action, v.reason, v.events) == ("drop", "drop_no_backend", ())
    assert h.conns()["entries"] == 0


# ---- garbage ------------------------------------------------------------------------


def test_nat_random_frames_never_disagree(nat: NatCase) -> None:
    """Frames of live NAT connections (both directions, ICMP errors about
    them) with random bytes changed after the MACs, on either port: the data
    plane does to every one what the model does, connection table included."""
    import random

    rng = random.Random(11)
    h = nat.h
    nat.load(pool=("198.18.3.130",))
    base: list[tuple[bytes, int]] = []
    for n, vip in enumerate((VIP_NAT_TCP, VIP_SNAT_TCP, VIP_NAT_UDP, VIP_SNAT_UDP)):
        c = nat.conn(f"198.19.130.{1 + n}", 13000 + n, vip)
        payload = b"" if vip.proto == IPPROTO_TCP else b"q"
        out = c.orig("S", payload)
        assert c.backend is not None and c.seen_as is not None
        base.append((c.orig_frame("A", payload), 0))
        base.append((c.reply_frame("SA", payload), backend_port(c.backend)))
        base.append((nat.icmp(nat.a(ROUTER), c.seen_as[0], ROUTER_MAC, h.port_macs[1], 3, 4,
                              nat.ip(out.frame)), 1))
    for _ in range(300):
        frame, port = rng.choice(base)
        # Cut only now and then (the IP length then overruns the frame:
        # malformed), so that most mutations reach NAT's own checks.
        cut = rng.randint(14, len(frame)) if rng.random() < 0.2 else len(frame)
        mutated = bytearray(frame[:cut])
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(12, len(mutated))] = rng.randrange(256)
        if rng.random() < 0.6:
            mutated[12:14] = b"\x08\x00" if nat.family == 4 else b"\x86\xdd"
        if rng.random() < 0.1:
            port = 1 - port
        v = h.send(bytes(mutated), port)
        assert v.reason  # the harness compared it
    h.conns()
