"""hpclb.lab.xdp_cost's frames, without a lab: the new flows are distinct and
each still a valid IPv4/UDP frame (header checksum, UDP checksum updated), so
that lb_xdp sees them as the hit frame's kind with another flow."""

from __future__ import annotations

import random

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from hpclb.lab.xdp_cost import new_flow_frames, with_source


def _frame(chksum: bool = True) -> bytes:
    pkt = (Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
           / IP(src="198.18.0.2", dst="198.18.1.10") / UDP(sport=65535, dport=8080)
           / bytes(18))
    if not chksum:
        pkt[UDP].chksum = 0
    return bytes(pkt)


def _checksums_valid(frame: bytes) -> bool:
    pkt = Ether(frame)
    ip_sum, udp_sum = pkt[IP].chksum, pkt[UDP].chksum
    del pkt[IP].chksum
    fresh = Ether(bytes(pkt))
    if udp_sum:
        del pkt[UDP].chksum
        fresh = Ether(bytes(pkt))
        return fresh[IP].chksum == ip_sum and fresh[UDP].chksum == udp_sum
    return fresh[IP].chksum == ip_sum


def test_with_source_keeps_the_checksums_valid() -> None:
    hit = _frame()
    out = with_source(hit, "100.64.3.7", 12345)
    pkt = Ether(out)
    assert (pkt[IP].src, pkt[UDP].sport) == ("100.64.3.7", 12345)
    assert (pkt[IP].dst, pkt[UDP].dport) == ("198.18.1.10", 8080)
    assert len(out) == len(hit) and _checksums_valid(out)
    assert Ether(with_source(_frame(chksum=False), "100.64.0.1", 1))[UDP].chksum == 0


def test_new_flows_are_distinct_and_valid() -> None:
    frames = new_flow_frames(_frame(), 2500, random.Random(7))
    flows = {(Ether(f)[IP].src, Ether(f)[UDP].sport) for f in frames}
    assert len(flows) == 2500
    assert all(_checksums_valid(f) for f in frames[::250])
    # Another call (another random base) meets flows the first did not pin.
    again = new_flow_frames(_frame(), 100, random.Random(8))
    assert not flows & {(Ether(f)[IP].src, Ether(f)[UDP].sport) for f in again}
