"""The backends' decapsulation program (dataplane/xdp/decap.bpf.c) on crafted
frames, with BPF_PROG_TEST_RUN: every tunnel the appliance writes comes out as
the inner packet behind the same MACs; what is not a tunnel frame passes
untouched; a tunnel frame whose headers do not hold together is dropped and
counted. No network: the program is loaded and pinned with bpftool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6, IPv6ExtHdrHopByHop
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Packet, Raw

from hpclb.host import install
from hpclb.lab.bpf_testrun import PinnedXdpProgram

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="loading an XDP program needs root")

GUE_PORT = 7000
DST, SRC = "02:48:4c:00:02:0b", "02:48:4c:00:02:01"
STATS = ("decapsulated", "passed", "malformed")


class Decap:
    def __init__(self, pin: Path, maps: Path) -> None:
        self.prog = PinnedXdpProgram(str(pin))
        self.maps = maps

    def run(self, frame: Packet | bytes) -> tuple[str, bytes]:
        return self.prog.run(bytes(frame))

    def stats(self) -> dict[str, int]:
        out = subprocess.run(["bpftool", "-j", "map", "dump", "pinned",
                              str(self.maps / "decap_stats")], check=True,
                             capture_output=True, text=True).stdout
        values = {}
        for entry in json.loads(out):
            f = entry.get("formatted", entry)
            values[STATS[int(f["key"])]] = int(f["value"])
        return values


@pytest.fixture(scope="module")
def decap() -> Iterator[Decap]:
    base = Path("/sys/fs/bpf") / f"hpclb-test-decap-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    pin, maps = base / "prog", base / "maps"
    try:
        subprocess.run(["bpftool", "prog", "load", str(install.find("decap.bpf.o")), str(pin),
                        "type", "xdp", "pinmaps", str(maps)], check=True, capture_output=True)
        port = GUE_PORT.to_bytes(2, "little")
        subprocess.run(["bpftool", "map", "update", "pinned", str(maps / "decap_config"),
                        "key", "0", "0", "0", "0", "value", str(port[0]), str(port[1]), "0",
                        "0"], check=True, capture_output=True)
        d = Decap(pin, maps)
        yield d
        d.prog.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def eth(proto: int | None = None) -> Ether:
    return Ether(dst=DST, src=SRC) if proto is None else Ether(dst=DST, src=SRC, type=proto)


INNER4 = IP(src="198.18.0.2", dst="198.18.1.10") / UDP(sport=1234, dport=8080) / Raw(b"who\n")
INNER6 = IPv6(src="fd48:4c00::2", dst="fd48:4c01::10") / UDP(sport=1234, dport=8080) / Raw(b"x")
OUT4 = IP(src="198.18.0.241", dst="198.19.2.11", flags="DF")
OUT6 = IPv6(src="fd48:4c00::f1", dst="fd48:4c02::11")


def gue(port: int = GUE_PORT) -> UDP:
    return UDP(sport=49153, dport=port, chksum=0)


@pytest.mark.parametrize(("outer", "inner"), [
    (OUT4 / INNER4, INNER4),                        # IPIP
    (OUT4 / gue() / INNER4, INNER4),                # GUE over IPv4
    (IPv6(src=OUT6.src, dst=OUT6.dst, nh=4) / INNER4, INNER4),  # 4in6
    (OUT6 / gue() / INNER4, INNER4),                # GUE 4in6
    (IPv6(src=OUT6.src, dst=OUT6.dst, nh=41) / INNER6, INNER6),  # 6in6
    (OUT6 / gue() / INNER6, INNER6),                # GUE 6in6
    (IP(src=OUT4.src, dst=OUT4.dst, proto=41) / INNER6, INNER6),  # 6in4
], ids=["ipip", "gue4", "4in6", "gue4in6", "6in6", "gue6in6", "6in4"])
def test_tunnel_frames_become_their_inner_packet(decap: Decap, outer: Packet,
                                                 inner: Packet) -> None:
    before = decap.stats()
    action, out = decap.run(eth() / outer)
    assert action == "pass"
    family = 0x0800 if inner.version == 4 else 0x86DD
    assert out == bytes(eth(family)) + bytes(inner)
    after = decap.stats()
    assert after["decapsulated"] == before["decapsulated"] + 1


def test_ethernet_padding_after_the_inner_packet_stays(decap: Decap) -> None:
    inner = IP(src="198.18.0.2", dst="198.18.1.10", proto=253)  # 20 bytes
    frame = bytes(eth() / OUT4 / inner)
    padded = frame + bytes(64 - len(frame))
    action, out = decap.run(padded)
    assert action == "pass"
    assert out == bytes(eth(0x0800)) + bytes(inner) + bytes(64 - len(frame))


@pytest.mark.parametrize("frame", [
    eth() / INNER4,                                                  # plain UDP
    eth() / OUT4 / gue(GUE_PORT + 1) / INNER4,                       # another UDP port
    eth() / IP(src=OUT4.src, dst=OUT4.dst, proto=4, flags="MF") / INNER4,  # a fragment
    eth() / IP(src=OUT4.src, dst=OUT4.dst, proto=4, frag=8) / INNER4,  # a later one
    eth() / IPv6(src=OUT6.src, dst=OUT6.dst) / IPv6ExtHdrHopByHop(nh=4) / INNER4,
    Ether(dst=DST, src=SRC) / Dot1Q(vlan=5) / OUT4 / INNER4,        # tagged
    bytes(eth()) + bytes(OUT4 / INNER4)[:28],                        # outer length past
], ids=["udp", "other-port", "fragment", "later-fragment", "ext-header", "vlan",
        "outer-short"])
def test_what_is_not_a_tunnel_frame_passes_untouched(decap: Decap,
                                                     frame: Packet | bytes) -> None:
    raw = bytes(frame)
    before = decap.stats()
    action, out = decap.run(raw)
    assert (action, out) == ("pass", raw)
    after = decap.stats()
    assert after["passed"] == before["passed"] + 1
    assert after["decapsulated"] == before["decapsulated"]


def _bad_inner_length() -> bytes:
    """IPIP whose inner IPv4 header claims 40 bytes more than the frame holds."""
    inner = bytearray(bytes(INNER4))
    inner[2:4] = (len(inner) + 40).to_bytes(2, "big")
    return bytes(eth() / IP(src=OUT4.src, dst=OUT4.dst, proto=4) / Raw(bytes(inner)))


@pytest.mark.parametrize("frame", [
    bytes(eth() / IP(src=OUT4.src, dst=OUT4.dst, proto=4) / INNER6),   # 4 carrying IPv6
    bytes(eth() / IPv6(src=OUT6.src, dst=OUT6.dst, nh=41) / INNER4),   # 41 carrying IPv4
    bytes(eth() / OUT4 / gue() / Raw(b"\x50" + bytes(INNER4)[1:])),    # GUE, not IP
    bytes(eth() / OUT4 / gue()),                                        # GUE, no payload
    bytes(eth() / IP(src=OUT4.src, dst=OUT4.dst, proto=4) / Raw(bytes(INNER4)[:12])),
    bytes(eth() / IPv6(src=OUT6.src, dst=OUT6.dst, nh=41) / Raw(bytes(INNER6)[:30])),
    _bad_inner_length(),
], ids=["4-with-v6", "41-with-v4", "gue-not-ip", "gue-empty", "inner4-short",
        "inner6-short", "inner-length-past-frame"])
def test_broken_tunnel_frames_are_dropped_and_counted(decap: Decap, frame: bytes) -> None:
    before = decap.stats()
    action, _ = decap.run(frame)
    assert action == "drop"
    after = decap.stats()
    assert after["malformed"] == before["malformed"] + 1
    assert after["decapsulated"] == before["decapsulated"]
