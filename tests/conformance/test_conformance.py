"""One set of packet cases, run against the model and every data plane.

Each case drives the harness, which sends every frame to the model and to the
data plane under test and fails on the first byte they disagree on. The
asserts written here are the semantics themselves (docs/ARCHITECTURE.md), checked on the
model's verdicts, which the data plane just matched.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import pytest
from scapy.layers.inet import IP, TCP, UDP, IPOption_NOP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether

from hpclb.contract.tables import BackendState

from .harness import BACKEND_MACS, CLIENT_MAC, Harness, base_tables, dual_tables, tcp, udp

ETH = Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01")


def test_tcp_to_vip_goes_to_a_backend(harness: Harness) -> None:
    harness.load(base_tables())
    v = harness.send(tcp("198.19.1.1", 40000))
    assert v.action == "tx" and v.backend_id in (0, 1, 2)
    assert v.frame[:6] == bytes.fromhex(BACKEND_MACS[v.backend_id].replace(":", ""))
    assert v.frame[12:] == tcp("198.19.1.1", 40000)[12:], "DSR touches only the MACs"


def test_udp_to_vip_goes_to_a_backend(harness: Harness) -> None:
    harness.load(base_tables())
    seen = {harness.send(udp("198.19.2.1", 1000 + i)).backend_id for i in range(60)}
    assert seen == {0, 1, 2}


def test_flows_spread_over_the_ring(harness: Harness) -> None:
    harness.load(base_tables({0: 1.0, 1: 2.0, 2: 3.0}))
    counts = {0: 0, 1: 0, 2: 0}
    for i in range(600):
        counts[harness.backend_of(tcp("198.19.3.1", 1024 + i))] += 1  # type: ignore[index]
    assert counts[0] < counts[1] < counts[2]


def test_non_vip_ipv4_passes(harness: Harness) -> None:
    harness.load(base_tables())
    assert harness.send(tcp("198.19.4.1", 4000, dst="198.18.0.3")).action == "pass"
    icmp_to_vip = bytes(ETH / IP(src="198.19.4.1", dst="198.18.1.10", proto=1) / b"\x08\x00ping")
    assert harness.send(icmp_to_vip).reason == "pass_not_vip"


def test_vip_address_on_unconfigured_port_passes(harness: Harness) -> None:
    harness.load(base_tables())
    v = harness.send(tcp("198.19.5.1", 5000, dport=81))
    assert (v.action, v.reason) == ("pass", "pass_not_vip")
    v = harness.send(udp("198.19.5.1", 5000, dport=80))  # TCP port, UDP protocol
    assert (v.action, v.reason) == ("pass", "pass_not_vip")


def test_non_ip_passes(harness: Harness) -> None:
    harness.load(base_tables())
    arp = bytes(Ether(src=CLIENT_MAC, dst="ff:ff:ff:ff:ff:ff") / ARP(pdst="198.18.0.1"))
    v6 = bytes(Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01") / IPv6() / UDP(dport=53))
    for frame in (arp, v6):
        assert harness.send(frame).reason == "pass_not_ipv4"


def test_ipv6_frames_to_an_ipv6_vip_pass(harness: Harness) -> None:
    """Table protocol 2 carries IPv6 VIPs and backends, and the data planes
    hold them; the fast paths do not forward IPv6 yet, so a frame to a
    configured IPv6 VIP passes to the kernel like any IPv6 frame."""
    harness.load(dual_tables())
    to_vip = [
        bytes(ETH / IPv6(src=f"fd00:19::{i + 1}", dst="fd00:18::10")
              / TCP(sport=40000 + i, dport=80, flags="S"))
        for i in range(8)
    ] + [bytes(ETH / IPv6(src="fd00:19::1", dst="fd00:18::10") / UDP(sport=1000, dport=53)
               / b"query")]
    for frame in to_vip:
        v = harness.send(frame)
        assert (v.action, v.reason, v.frame) == ("pass", "pass_not_ipv4", frame)


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


def test_truncated_headers_are_dropped(harness: Harness) -> None:
    harness.load(base_tables())
    full_tcp = tcp("198.19.6.1", 6000)
    full_udp = udp("198.19.6.1", 6000)
    cases = {
        "ethernet": full_tcp[:13],
        "ipv4": full_tcp[: 14 + 19],
        "tcp": full_tcp[: 14 + 20 + 19],
        "udp": full_udp[: 14 + 20 + 7],
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


def _with_total_length(frame: bytes, total_length: int) -> bytes:
    out = bytearray(frame)
    struct.pack_into("!H", out, 14 + 2, total_length)
    return bytes(out)


def test_ip_total_length_beyond_the_frame_is_dropped(harness: Harness) -> None:
    """A packet that claims more bytes than the frame carries is truncated:
    dropped, never forwarded (the kernel would drop it too)."""
    harness.load(base_tables())
    frame = tcp("198.19.17.1", 17000)
    for claimed in (len(frame) - 14 + 1, 1500, 0xFFFF):
        v = harness.send(_with_total_length(frame, claimed))
        assert (v.action, v.reason) == ("drop", "drop_malformed"), claimed
    v = harness.send(_with_total_length(udp("198.19.17.1", 17001), 0xFFFF))
    assert (v.action, v.reason) == ("drop", "drop_malformed")
    # The IPv4 header is checked before anything else is decided: not even
    # what would pass (a fragment, another protocol) passes with a lie in it.
    fragment = bytes(ETH / IP(src="198.19.17.1", dst="198.18.1.10", flags="MF")
                     / UDP(sport=17002, dport=53) / (b"x" * 64))
    icmp = bytes(ETH / IP(src="198.19.17.1", dst="198.18.1.10", proto=1) / b"\x08\x00ping")
    for other in (fragment, icmp):
        assert harness.send(other).action == "pass"
        v = harness.send(_with_total_length(other, len(other) - 14 + 1))
        assert (v.action, v.reason) == ("drop", "drop_malformed")


def test_ip_total_length_below_the_header_is_dropped(harness: Harness) -> None:
    harness.load(base_tables())
    frame = tcp("198.19.18.1", 18000)
    for claimed in (19, 1):
        v = harness.send(_with_total_length(frame, claimed))
        assert (v.action, v.reason) == ("drop", "drop_malformed"), claimed
    # With options (IHL 6: a 24-byte header), 20 is below the header too.
    with_options = bytes(ETH / IP(src="198.19.18.1", dst="198.18.1.10",
                                  options=[IPOption_NOP()] * 4) / TCP(sport=18001, dport=80))
    assert harness.send(with_options).action == "tx"
    for claimed in (20, 23):
        v = harness.send(_with_total_length(with_options, claimed))
        assert (v.action, v.reason) == ("drop", "drop_malformed"), claimed


def test_ip_total_length_zero_is_dropped(harness: Harness) -> None:
    harness.load(base_tables())
    for frame in (tcp("198.19.19.1", 19000), udp("198.19.19.1", 19001)):
        v = harness.send(_with_total_length(frame, 0))
        assert (v.action, v.reason) == ("drop", "drop_malformed")


def test_l4_header_beyond_the_ip_total_length_is_dropped(harness: Harness) -> None:
    """The frame holds a whole TCP/UDP header, the packet does not (its total
    length ends inside it): the ports are padding, not the packet's."""
    harness.load(base_tables())
    frame = tcp("198.19.20.1", 20000)
    for claimed in (20, 20 + 19):
        v = harness.send(_with_total_length(frame, claimed))
        assert (v.action, v.reason) == ("drop", "drop_malformed"), claimed
    v = harness.send(_with_total_length(udp("198.19.20.1", 20001), 20 + 7))
    assert (v.action, v.reason) == ("drop", "drop_malformed")
    v = harness.send(_with_total_length(udp("198.19.20.1", 20002), 20 + 8))  # no payload: fine
    assert v.action == "tx"


def test_ethernet_padding_after_a_short_packet_still_forwards(harness: Harness) -> None:
    """A 60-byte minimum frame around a 40-byte packet (a bare TCP SYN, a
    short UDP datagram): the padding is no error. It is forwarded like the
    unpadded frame, to the same backend, padding and all (DSR touches only
    the MACs)."""
    harness.load(base_tables())
    for frame in (tcp("198.19.21.1", 21000), udp("198.19.21.1", 21001)):
        assert len(frame) < 60
        padded = frame + bytes(60 - len(frame))
        plain = harness.send(frame)
        v = harness.send(padded)
        assert (v.action, v.reason) == ("tx", "fwd_tx")
        assert v.backend_id == plain.backend_id
        assert v.frame == plain.frame + bytes(60 - len(frame))


def test_ip_options_are_skipped(harness: Harness) -> None:
    """Defined behaviour: the L4 header is found through the IHL, so a packet
    with options is balanced exactly like the same flow without them."""
    harness.load(base_tables())
    plain = harness.send(tcp("198.19.8.1", 8000))
    with_options = bytes(ETH / IP(src="198.19.8.1", dst="198.18.1.10",
                                  options=[IPOption_NOP()] * 8) / TCP(sport=8000, dport=80))
    v = harness.send(with_options)
    assert v.action == "tx" and v.backend_id == plain.backend_id


def test_fragments_pass_to_the_kernel(harness: Harness) -> None:
    """Defined behaviour: a non-first fragment has no ports, so fragments of a
    VIP's traffic cannot be balanced consistently; the kernel gets them all."""
    harness.load(base_tables())
    first = bytes(ETH / IP(src="198.19.9.1", dst="198.18.1.10", flags="MF")
                  / UDP(sport=9000, dport=53) / (b"x" * 64))
    later = bytes(ETH / IP(src="198.19.9.1", dst="198.18.1.10", frag=8, proto=17) / (b"y" * 64))
    for frame in (first, later):
        v = harness.send(frame)
        assert (v.action, v.reason) == ("pass", "pass_fragment")


def test_down_backend_rehashes_its_flows_and_only_them(harness: Harness) -> None:
    harness.load(base_tables())
    flows = [tcp("198.19.10.1", 10000 + i) for i in range(90)]
    before = [harness.backend_of(f) for f in flows]
    victim = before[0]
    assert victim is not None
    harness.load(base_tables(states={victim: BackendState.DOWN}))  # ring unchanged
    after = [harness.backend_of(f) for f in flows]
    for b, a in zip(before, after, strict=True):
        if b == victim:
            assert a not in (victim, None), "a flow stayed on a down backend"
        else:
            assert a == b, "a flow on a healthy backend moved"


def test_draining_backend_keeps_flows_and_takes_no_new_ones(harness: Harness) -> None:
    harness.load(base_tables())
    flows = [tcp("198.19.11.1", 11000 + i) for i in range(90)]
    before = [harness.backend_of(f) for f in flows]
    drained = before[0]
    harness.load(base_tables(states={drained: BackendState.DRAINING}))
    assert [harness.backend_of(f) for f in flows] == before
    fresh = [harness.backend_of(tcp("198.19.11.2", 20000 + i)) for i in range(90)]
    assert drained not in fresh and None not in fresh


def test_affinity_holds_across_a_ring_change(harness: Harness) -> None:
    harness.load(base_tables())
    flows = [udp("198.19.12.1", 12000 + i) for i in range(120)]
    before = [harness.backend_of(f) for f in flows]
    harness.load(base_tables({0: 1.0, 1: 1.0, 2: 4.0}))  # a weight change: a ring patch
    assert [harness.backend_of(f) for f in flows] == before
    fresh = [harness.backend_of(udp("198.19.12.2", 30000 + i)) for i in range(200)]
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


def test_a_flow_seen_on_another_cpu_keeps_its_backend(harness: Harness) -> None:
    """Packets of one flow arrive on several CPUs (a client's ACKs leave from
    the softirq that received the backend's reply; RSS tables change). A
    weight change in between must not move the flow: the flow table is
    shared, not per CPU (a per-CPU table moved a third of these flows)."""
    cpus, set_cpu = _two_cpus(harness)
    harness.load(base_tables())
    flows = [tcp("198.19.16.1", 16000 + i) for i in range(90)]
    try:
        set_cpu(cpus[0])
        first = [harness.backend_of(f) for f in flows]
        harness.load(base_tables({0: 1.0, 1: 1.0, 2: 5.0}))
        set_cpu(cpus[1])
        assert [harness.backend_of(f) for f in flows] == first
    finally:
        set_cpu(cpus[0])
    assert set(first) == {0, 1, 2}


def test_all_backends_down_drops(harness: Harness) -> None:
    down = dict.fromkeys((0, 1, 2), BackendState.DOWN)
    harness.load(base_tables(states=down))
    v = harness.send(tcp("198.19.13.1", 13000))
    assert (v.action, v.reason) == ("drop", "drop_no_backend")
    harness.load(base_tables({0: 0.0, 1: 0.0, 2: 0.0}))  # every weight 0: empty ring
    assert harness.send(udp("198.19.13.1", 13001)).reason == "drop_no_backend"


def test_two_arm_backend_is_redirected_out_of_its_port(harness: Harness) -> None:
    harness.load(base_tables())
    v = harness.send(tcp("198.19.14.1", 14000, dst="198.18.1.11"))
    assert (v.action, v.backend_id, v.port) == ("redirect", 3, 1)
    assert v.frame[6:12] == bytes.fromhex(harness.port_macs[1].replace(":", ""))


def test_random_frames_never_disagree(harness: Harness) -> None:
    """Garbage after a valid or a broken header: both sides agree on all of it."""
    import random

    rng = random.Random(7)
    harness.load(base_tables())
    base = tcp("198.19.15.1", 15000)
    for _ in range(300):
        frame = bytearray(base[: rng.randint(14, len(base))])
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(12, len(frame))] = rng.randrange(256)
        if rng.random() < 0.5:
            struct.pack_into("!H", frame, 12, 0x0800)
        harness.send(bytes(frame))
