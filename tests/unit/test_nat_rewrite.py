"""The NAT gateway's packet rewrites (dataplane/common/lb_nat.h, lb_nat6.h, and
lb_conn.h's IPv6 helpers), through tests/unit/nat_harness.c, against scapy's own
build of the expected packet.

* IPv4 TCP/UDP DNAT and SNAT: the harness rewrites the address and port, the
  expectation is the same frame with the new address and port and the IPv4 and
  L4 checksums deleted so that scapy recomputes them (a UDP checksum of 0 is
  kept at 0; a recomputed 0 must go out as 0xffff). Fixed cases (IP options,
  an 802.1Q tag, Ethernet padding) and random ones (hypothesis).
* ICMP errors (3/4 fragmentation needed, 3/1, 3/3, 11/0, 12/0) quoting a
  translated TCP or UDP packet with 8 bytes of L4 (RFC 792), the whole L4
  header, the whole packet, a Linux-style 576-byte error, odd cuts: the
  expected frame quotes the packet as the endpoint sent it (before the
  gateway translated it), cut at the same place, with the outer IPv4 and ICMP
  checksums recomputed by scapy; the quoted IP and L4 checksums must be the
  endpoint's own wherever the quote holds them.
* Refusals: every truncation of every kind of frame, fragments, IPv6, other
  ICMP messages, random corruption: an answer, never a write outside the
  frame (the harness is built with ASan/UBSan and copies every frame into a
  buffer of exactly its length) nor a write into a refused frame.
* IPv6: the same for TCP/UDP with and without extension headers (up to the
  256-byte bound, one past it refused), UDP checksum 0 and a computed 0, a
  wrong checksum staying exactly as wrong; ICMPv6 errors of each type (1, 2,
  3, 4) quoting TCP and UDP, short quotes, an inner extension header (not
  NAT's), lb_conn6_translate, lb_conn6_icmp_key/translate, lb_tcp_flags6.

As root, with clang and libbpf-dev, the harness also runs every request
through the BPF build of the same file (loaded: the verifier accepts lb_nat.h
behind lb_parse_frame) and answers BPFDIFF where the two builds differ.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scapy.layers.inet import ICMP, IP, TCP, UDP, IPOption_NOP, IPOption_RR
from scapy.layers.inet6 import (
    ICMPv6DestUnreach,
    ICMPv6EchoRequest,
    ICMPv6ND_NS,
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

REPO = Path(__file__).resolve().parents[2]
COMMON = REPO / "dataplane/common"
SOURCE = Path(__file__).with_name("nat_harness.c")
WARNINGS = ["-Wall", "-Wextra", "-Werror", "-std=gnu11"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]

CLIENT, VIP, BACKEND, ROUTER = "198.51.100.7", "203.0.113.10", "10.1.2.3", "192.0.2.254"
L4 = {"tcp": TCP, "udp": UDP}
SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _cc() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    return cc


def _compile(argv: list[str]) -> None:
    build = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr


def _bpf_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "not root: loading a BPF program and BPF_PROG_TEST_RUN need root"
    if shutil.which("clang") is None or not Path("/usr/include/bpf/libbpf.h").exists():
        return "needs clang and libbpf-dev"
    return None


class Harness:
    """nat_harness.c as a long-lived process: one request line, one answer line."""

    def __init__(self, argv: list[str], bpf_reason: str | None) -> None:
        self.bpf_reason = bpf_reason
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer:
            self.proc.wait(timeout=30)
            assert self.proc.stderr is not None
            pytest.fail(f"nat_harness died ({self.proc.returncode}) on {line[:200]}:\n"
                        + self.proc.stderr.read()[-8000:])
        assert not answer.startswith(("BUG", "BPFDIFF")), f"{answer} for {line[:300]}"
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=60)
        assert self.proc.stderr is not None
        err = self.proc.stderr.read()
        assert rc == 0, err[-8000:]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("nat")
    exe = tmp / "nat_harness"
    base = [_cc(), "-O1", "-g", *WARNINGS, *SANITIZE, f"-I{COMMON}", "-o", str(exe),
            str(SOURCE)]
    reason = _bpf_unavailable()
    if reason is None:
        machine = subprocess.run([_cc(), "-dumpmachine"], capture_output=True, text=True,
                                 check=True).stdout.strip()
        obj = tmp / "nat_harness.bpf.o"
        # The flags dataplane/Makefile gives lb.bpf.c (BPF_CFLAGS).
        _compile(["clang", "-O2", "-g", "-Wall", "-Werror", "-target", "bpf", "-D__BPF__",
                  f"-I{COMMON}", f"-I/usr/include/{machine}", "-c", str(SOURCE),
                  "-o", str(obj)])
        _compile([*base, "-DNAT_HARNESS_BPF", "-lbpf"])
        h = Harness([str(exe), "--bpf", str(obj)], None)
    else:
        print(f"test_nat_rewrite: BPF cross-check skipped: {reason}")
        _compile(base)
        h = Harness([str(exe)], reason)
    yield h
    h.close()


# ---- helpers -----------------------------------------------------------------


def a2h(addr: str) -> str:
    return socket.inet_aton(addr).hex()


def nat(h: Harness, frame: bytes, side: str, addr: str, port: int) -> str:
    return h.ask(f"N {side} {a2h(addr)} {port} {frame.hex()}")


def expect_nat(frame: bytes, proto: str, side: str, addr: str, port: int) -> bytes:
    """scapy's rebuild of the frame (IPv4 or IPv6) with the new address and port."""
    pkt = Ether(frame)
    ip, l4 = (pkt[IPv6] if IPv6 in pkt else pkt[IP]), pkt[L4[proto]]
    if side == "D":
        ip.dst, l4.dport = addr, port
    else:
        ip.src, l4.sport = addr, port
    if isinstance(ip, IP):
        del ip.chksum
    if not (proto == "udp" and l4.chksum == 0):  # RFC 768: 0 is "none", stays 0
        del l4.chksum
    return bytes(pkt)


def with_l4(ip: Packet, proto: str, sport: int, dport: int, payload: bytes,
            udp_zero: bool = False, flags: str = "PA") -> Packet:
    """ip (either family) carrying a TCP segment or a UDP datagram."""
    if proto == "tcp":
        return ip / TCP(sport=sport, dport=dport, seq=0x01020304, flags=flags) / payload
    udp = UDP(sport=sport, dport=dport)
    if udp_zero:
        udp.chksum = 0
    return ip / udp / payload


def l4_packet(proto: str, src: str, dst: str, sport: int, dport: int, payload: bytes,
              options: list | None = None, udp_zero: bool = False, ip_id: int = 1) -> IP:
    ip = IP(src=src, dst=dst, id=ip_id, options=options or [])
    return with_l4(ip, proto, sport, dport, payload, udp_zero)


def frame_of(ip: Packet, vlan: bool = False, pad: int = 0) -> bytes:
    eth = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    pkt = eth / Dot1Q(vlan=42) / ip if vlan else eth / ip
    raw = bytes(pkt)
    return raw + b"\xee" * pad


# ---- IPv4 TCP/UDP DNAT and SNAT ----------------------------------------------


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("side", ["D", "S"])
@pytest.mark.parametrize("shape", ["plain", "options", "vlan", "padded", "options+vlan"])
def test_nat_rewrite_matches_scapy(harness: Harness, proto: str, side: str, shape: str) -> None:
    options = [IPOption_RR(routers=["1.2.3.4"]), IPOption_NOP()] if "options" in shape else None
    ip = l4_packet(proto, CLIENT, VIP, 40000, 443, b"x" * 5, options=options)
    frame = frame_of(ip, vlan="vlan" in shape, pad=12 if shape == "padded" else 0)
    addr, port = (BACKEND, 8443) if side == "D" else (VIP, 1234)
    got = nat(harness, frame, side, addr, port)
    want = expect_nat(frame, proto, side, addr, port)
    assert got == f"OK {want.hex()}"


ADDRS = st.integers(min_value=0, max_value=2**32 - 1).map(
    lambda n: socket.inet_ntoa(struct.pack("!I", n)))
PORTS = st.integers(min_value=0, max_value=65535)


@SETTINGS
@given(proto=st.sampled_from(["tcp", "udp"]), side=st.sampled_from(["S", "D"]),
       src=ADDRS, dst=ADDRS, sport=PORTS, dport=PORTS, new_addr=ADDRS, new_port=PORTS,
       payload=st.binary(max_size=64), nopts=st.integers(min_value=0, max_value=10),
       udp_zero=st.booleans(), vlan=st.booleans(), ip_id=PORTS)
def test_nat_rewrite_random(harness: Harness, proto: str, side: str, src: str, dst: str,
                            sport: int, dport: int, new_addr: str, new_port: int,
                            payload: bytes, nopts: int, udp_zero: bool, vlan: bool,
                            ip_id: int) -> None:
    ip = l4_packet(proto, src, dst, sport, dport, payload,
                   options=[IPOption_NOP()] * (4 * nopts) or None, udp_zero=udp_zero,
                   ip_id=ip_id)
    frame = frame_of(ip, vlan=vlan)
    got = nat(harness, frame, side, new_addr, new_port)
    assert got == f"OK {expect_nat(frame, proto, side, new_addr, new_port).hex()}"


def test_udp_checksum_zero_stays_zero(harness: Harness) -> None:
    frame = frame_of(l4_packet("udp", CLIENT, VIP, 5353, 53, b"query", udp_zero=True))
    got = nat(harness, frame, "D", BACKEND, 5300)
    out = Ether(bytes.fromhex(got.split()[1]))
    assert out[UDP].chksum == 0 and out[IP].dst == BACKEND and out[UDP].dport == 5300
    assert got == f"OK {expect_nat(frame, 'udp', 'D', BACKEND, 5300).hex()}"


def _ones_sum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


@pytest.mark.parametrize("side", ["D", "S"])
def test_udp_recomputed_zero_goes_out_as_ffff(harness: Harness, side: str) -> None:
    """A translated datagram whose checksum computes to 0: RFC 768 sends 0xffff."""
    new_addr, new_port = "10.9.8.7", 4242
    # The translated datagram with a zero last word, then that word chosen so
    # that the one's-complement sum of pseudo-header and datagram is 0xffff.
    sent = l4_packet("udp", CLIENT, VIP, 1111, 2222, b"abcdef\0\0")
    ip = IP(bytes(sent))
    if side == "D":
        ip.dst, ip[UDP].dport = new_addr, new_port
    else:
        ip.src, ip[UDP].sport = new_addr, new_port
    udp = bytes(ip[UDP])
    pseudo = socket.inet_aton(ip.src) + socket.inet_aton(ip.dst) + struct.pack(
        "!BBH", 0, 17, len(udp))
    udp_zeroed = udp[:6] + b"\0\0" + udp[8:]
    word = 0xFFFF - _ones_sum(pseudo + udp_zeroed)
    sent = l4_packet("udp", CLIENT, VIP, 1111, 2222, b"abcdef" + struct.pack("!H", word))
    frame = frame_of(sent)
    want = expect_nat(frame, "udp", side, new_addr, new_port)
    assert Ether(want)[UDP].chksum == 0xFFFF, "the case must be the one that computes to 0"
    assert Ether(frame)[UDP].chksum not in (0, 0xFFFF)
    assert nat(harness, frame, side, new_addr, new_port) == f"OK {want.hex()}"


# ---- refusals ------------------------------------------------------------------


def test_nat_refuses_what_it_cannot_translate(harness: Harness) -> None:
    base = l4_packet("tcp", CLIENT, VIP, 1000, 80, b"data" * 4)
    cases = {
        "first fragment": IP(bytes(base), flags="MF"),
        "later fragment": IP(bytes(base), frag=8),
        "icmp": IP(src=CLIENT, dst=VIP) / ICMP() / b"ping",
        "other protocol": IP(src=CLIENT, dst=VIP, proto=47) / b"gre-ish-payload",
    }
    for name, ip in cases.items():
        del ip.chksum
        assert nat(harness, frame_of(ip), "D", BACKEND, 80).startswith(
            "ERR not_applicable"), name
    v6 = bytes(Ether(dst="02:00:00:00:00:02") / IPv6(src="2001:db8::1", dst="2001:db8::2")
               / TCP())
    assert nat(harness, v6, "D", BACKEND, 80).startswith("ERR not_applicable")
    arp = bytes(Ether(dst="ff:ff:ff:ff:ff:ff", type=0x0806) / Raw(b"\0" * 28))
    assert nat(harness, arp, "D", BACKEND, 80).startswith("ERR not_applicable")
    # An invalid side is refused, with nothing written (the harness checks).
    assert harness.ask(f"N 0 {a2h(BACKEND)} 80 {frame_of(base).hex()}") == "ERR malformed ok"


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_nat_every_truncation_is_refused(harness: Harness, proto: str) -> None:
    frames = [frame_of(l4_packet(proto, CLIENT, VIP, 1000, 80, b"p" * 9)),
              frame_of(l4_packet(proto, CLIENT, VIP, 1000, 80, b"",
                                 options=[IPOption_NOP()] * 8), vlan=True)]
    for frame in frames:
        for cut in range(len(frame)):
            answer = nat(harness, frame[:cut], "S", VIP, 9)
            assert answer.startswith("ERR "), (cut, answer)
        assert nat(harness, frame, "S", VIP, 9).startswith("OK ")


def test_nat_header_that_contradicts_the_parse_is_refused(harness: Harness) -> None:
    # Total length shorter than IP + TCP header up to its checksum.
    ip = l4_packet("tcp", CLIENT, VIP, 1, 2, b"")
    raw = bytearray(frame_of(ip))
    struct.pack_into("!H", raw, 14 + 2, 20 + 10)
    assert nat(harness, bytes(raw), "D", BACKEND, 3).startswith("ERR ")


# ---- ICMP errors ---------------------------------------------------------------


def icmp_case(proto: str, mode: str, itype: int, code: int, quote: int | str, *,
              outer_rewrite: bool = True, inner_options: bool = False, udp_zero: bool = False,
              payload: bytes = b"some payload!", extra: bytes = b"", vlan: bool = False,
              outer_options: bool = False, pad: int = 0,
              ) -> tuple[str, bytes, bytes, IP, int]:
    """(request line, frame, expected frame, the quoted packet as sent on, l4 quoted).

    mode "dnat": the client sent CLIENT -> VIP:443, the gateway sent it on to
    BACKEND:8443; an error about it (from a router, or the backend) goes back to
    the client: the quoted destination becomes VIP:443 again, the outer source
    VIP. mode "snat": the backend's reply BACKEND:8443 -> CLIENT left the
    gateway as VIP:443 -> CLIENT; the error comes to VIP: the quoted source and
    the outer destination become the backend's.
    """
    options = [IPOption_NOP()] * 8 if inner_options else None
    kw = {"options": options, "udp_zero": udp_zero, "ip_id": 77}
    if mode == "dnat":
        orig = l4_packet(proto, CLIENT, VIP, 40000, 443, payload, **kw)
        wire = l4_packet(proto, CLIENT, BACKEND, 40000, 8443, payload, **kw)
        outer = (ROUTER, CLIENT)
        want_outer = (VIP, CLIENT) if outer_rewrite else outer
        req = ("D", VIP, 443, VIP if outer_rewrite else "0.0.0.0")
    else:
        orig = l4_packet(proto, BACKEND, CLIENT, 8443, 40000, payload, **kw)
        wire = l4_packet(proto, VIP, CLIENT, 443, 40000, payload, **kw)
        outer = (ROUTER, VIP)
        want_outer = (ROUTER, BACKEND) if outer_rewrite else outer
        req = ("S", BACKEND, 8443, BACKEND if outer_rewrite else "0.0.0.0")
    wire_b, orig_b = bytes(wire), bytes(orig)
    ihl = IP(wire_b).ihl * 4
    qlen = len(wire_b) if quote == "whole" else ihl + int(quote) if isinstance(
        quote, int) else int(quote[1:])  # "=N": N bytes of the packet, any cut
    qlen = min(qlen, len(wire_b))
    quoted_orig = bytearray(orig_b[:qlen])
    l4q = qlen - ihl
    if proto == "tcp" and 16 < l4q < 18:
        # Half a checksum quoted: left as it is (it cannot be updated).
        quoted_orig[ihl + 16] = wire_b[ihl + 16]
    icmp = ICMP(type=itype, code=code)
    if (itype, code) == (3, 4):
        icmp.nexthopmtu = 1400
    oopts = [IPOption_NOP()] * 4 if outer_options else None

    def build(src: str, dst: str, quoted: bytes) -> bytes:
        ip = IP(src=src, dst=dst, id=99, ttl=61, options=oopts or []) / icmp.copy() / Raw(
            quoted + extra)
        return frame_of(ip, vlan=vlan, pad=pad)
    frame = build(*outer, wire_b[:qlen])
    want = build(*want_outer, bytes(quoted_orig))
    line = f"X {req[0]} {a2h(req[1])} {req[2]} {a2h(req[3])} {frame.hex()}"
    if l4q >= len(wire_b) - ihl and extra:
        l4q = len(wire_b) - ihl  # the trailing bytes are not the quoted packet
    return line, frame, want, wire, l4q


ICMP_TYPES = [(3, 4), (3, 1), (3, 3), (11, 0), (12, 0)]


@pytest.mark.parametrize(("itype", "code"), ICMP_TYPES)
@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("mode", ["dnat", "snat"])
@pytest.mark.parametrize("quote", [8, 17, 18, 20, "whole"])
def test_icmp_error_translated(harness: Harness, itype: int, code: int, proto: str, mode: str,
                               quote: int | str) -> None:
    line, frame, want, wire, l4q = icmp_case(proto, mode, itype, code, quote)
    assert harness.ask(line) == f"OK {want.hex()}"
    # The parse alone: the quoted packet's 5-tuple as it left the gateway.
    info = harness.ask(f"I {frame.hex()}").split()
    sport, dport = wire[L4[proto]].sport, wire[L4[proto]].dport
    assert info == ["OK", str(itype), str(code), "6" if proto == "tcp" else "17",
                    a2h(wire.src), a2h(wire.dst), str(sport), str(dport), "14", "34", "42",
                    "62", str(l4q)]


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("variant", ["inner_options", "outer_options", "vlan", "no_outer",
                                     "udp_zero", "linux576", "extension", "padding"])
@pytest.mark.parametrize("mode", ["dnat", "snat"])
def test_icmp_error_variants(harness: Harness, proto: str, variant: str, mode: str) -> None:
    kw: dict = {}
    quote: int | str = "whole"
    if variant in ("inner_options", "outer_options", "vlan", "udp_zero"):
        kw[variant] = True
    elif variant == "no_outer":
        kw["outer_rewrite"] = False
    elif variant == "linux576":
        # Linux quotes as much as fits in 576 bytes: 576 - 20 - 8 of the packet.
        kw["payload"] = bytes(range(256)) * 4
        quote = "=548"
    elif variant == "extension":
        # RFC 4884 objects (or anything) after a whole quoted packet are not
        # part of it: the quoted packet's length bounds the quote.
        kw["extra"] = bytes.fromhex("2000a5a5") + b"\xde\xad" * 10
    elif variant == "padding":
        # Ethernet padding after a short error is no part of the quote: an
        # 8-byte TCP quote must not have its "checksum" rewritten there.
        quote, kw["pad"] = 8, 40
    line, frame, want, _wire, l4q = icmp_case(proto, mode, 3, 4, quote, **kw)
    assert harness.ask(line) == f"OK {want.hex()}"
    info = harness.ask(f"I {frame.hex()}").split()
    assert info[0] == "OK" and info[-1] == str(l4q), (info, l4q)


@SETTINGS
@given(proto=st.sampled_from(["tcp", "udp"]), mode=st.sampled_from(["dnat", "snat"]),
       tc=st.sampled_from(ICMP_TYPES), payload=st.binary(max_size=80),
       cut=st.integers(min_value=8, max_value=200), inner_options=st.booleans(),
       udp_zero=st.booleans(), outer_rewrite=st.booleans())
def test_icmp_error_random(harness: Harness, proto: str, mode: str, tc: tuple[int, int],
                           payload: bytes, cut: int, inner_options: bool, udp_zero: bool,
                           outer_rewrite: bool) -> None:
    line, _frame, want, _wire, _l4q = icmp_case(
        proto, mode, tc[0], tc[1], cut, payload=payload, inner_options=inner_options,
        udp_zero=udp_zero, outer_rewrite=outer_rewrite)
    assert harness.ask(line) == f"OK {want.hex()}"


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_icmp_truncated_quotes_are_refused(harness: Harness, proto: str) -> None:
    # Fewer than 8 bytes of L4 quoted, or the quoted IP header cut: malformed.
    for quote in [0, 4, 7]:
        line, frame, _w, _p, _q = icmp_case(proto, "dnat", 3, 4, quote)
        assert harness.ask(line) == "ERR malformed", quote
        assert harness.ask(f"I {frame.hex()}") == "ERR malformed unsupported_l4"
    for cut in [0, 10, 19]:
        line, _f, _w, _p, _q = icmp_case(proto, "dnat", 11, 0, f"={cut}")
        assert harness.ask(line) == "ERR malformed", cut
    # Every truncation of whole frames: refused (the outer total length no
    # longer fits), never an access past the end.
    for quote in [8, "whole"]:
        line, frame, _w, _p, _q = icmp_case(proto, "snat", 3, 1, quote, inner_options=True)
        head = line[: len(line) - len(frame.hex())]
        for cut in range(len(frame)):
            assert harness.ask(head + frame[:cut].hex()).startswith("ERR "), cut
            assert harness.ask(f"I {frame[:cut].hex()}").startswith("ERR "), cut


def test_icmp_messages_nat_leaves_alone(harness: Harness) -> None:
    tcp = l4_packet("tcp", CLIENT, BACKEND, 1, 2, b"")
    later = IP(bytes(tcp), frag=10)
    del later.chksum
    cases = {
        "echo request": IP(src=ROUTER, dst=CLIENT) / ICMP(type=8) / b"ping",
        "redirect": IP(src=ROUTER, dst=CLIENT) / ICMP(type=5) / bytes(tcp),
        "quotes ICMP": IP(src=ROUTER, dst=CLIENT) / ICMP(type=3, code=1) / bytes(
            IP(src=CLIENT, dst=BACKEND) / ICMP() / b"12345678"),
        "quotes a later fragment": IP(src=ROUTER, dst=CLIENT) / ICMP(type=11) / bytes(later),
        "fragmented error": IP(src=ROUTER, dst=CLIENT, flags="MF") / ICMP(type=3) / bytes(tcp),
        "TCP, not ICMP": tcp,
    }
    for name, ip in cases.items():
        answer = harness.ask(f"X D {a2h(VIP)} 1 {a2h(VIP)} {frame_of(ip).hex()}")
        assert answer == "ERR not_applicable", name
    v6 = bytes(Ether(dst="02:00:00:00:00:02") / IPv6() / Raw(b"\x01" * 40))
    assert harness.ask(f"I {v6.hex()}").startswith("ERR not_applicable")


@SETTINGS
@given(seed=st.integers(min_value=0, max_value=2**32 - 1),
       kind=st.sampled_from(["N", "X"]), flips=st.integers(min_value=1, max_value=6))
def test_corrupted_frames_never_escape(harness: Harness, seed: int, kind: str,
                                       flips: int) -> None:
    """Random bytes of valid frames changed: any answer, but no BUG, no crash."""
    rng = random.Random(seed)
    if kind == "N":
        frame = frame_of(l4_packet(rng.choice(["tcp", "udp"]), CLIENT, VIP, 1, 2,
                                   rng.randbytes(rng.randrange(20))))
    else:
        _l, frame, *_ = icmp_case(rng.choice(["tcp", "udp"]), "dnat", 3, 4,
                                  rng.choice([8, 20, "whole"]))
    raw = bytearray(frame)
    for _ in range(flips):
        # Mostly the headers, where the lengths and offsets are.
        raw[rng.randrange(min(len(raw), 90))] = rng.randrange(256)
    raw = raw[: rng.randrange(len(raw) // 2, len(raw) + 1)]
    answer = harness.ask(f"{kind} D {a2h(VIP)} 7 {a2h(VIP) if kind == 'X' else ''} "
                         f"{bytes(raw).hex()}".replace("  ", " "))
    assert answer.startswith(("OK", "ERR")), answer


# ---- IPv6 (lb_nat6.h, lb_conn.h's IPv6 helpers) ----------------------------------

CLIENT6, VIP6, BACKEND6 = "2001:db8:1::7", "2001:db8:2::10", "fd00:1::3"
ROUTER6, SNAT6 = "2001:db8:ff::fe", "fd00:2::99"
# A Hop-by-Hop and a Destination Options header of 16 bytes each.
EXT6 = {"plain": [], "hbh": ["hbh"], "hbh+dst": ["hbh", "dst"], "atomic_frag": ["frag"]}


def a6(addr: str) -> str:
    return socket.inet_pton(socket.AF_INET6, addr).hex()


def ext_header(kind: str, size: int = 16) -> Packet:
    """One extension header of `size` bytes (a multiple of 8)."""
    if kind == "frag":  # atomic (RFC 6946): offset 0, M 0: a whole packet
        return IPv6ExtHdrFragment(offset=0, m=0, id=0x1234)
    cls = IPv6ExtHdrHopByHop if kind == "hbh" else IPv6ExtHdrDestOpt
    return cls(options=[PadN(optdata=b"\0" * (size - 4))], autopad=0)


def l4_packet6(proto: str, src: str, dst: str, sport: int, dport: int, payload: bytes,
               ext: list[str] | None = None, udp_zero: bool = False,
               ext_size: int = 16, flags: str = "PA") -> Packet:
    pkt: Packet = IPv6(src=src, dst=dst, hlim=60)
    for kind in ext or []:
        pkt = pkt / ext_header(kind, ext_size)
    return with_l4(pkt, proto, sport, dport, payload, udp_zero, flags)


def nat6(h: Harness, frame: bytes, side: str, addr: str, port: int) -> str:
    return h.ask(f"n {side} {a6(addr)} {port} {frame.hex()}")


def l4_sum6(frame: bytes, proto: str) -> int:
    """The one's-complement sum over pseudo-header and segment (0xffff: right)."""
    pkt = Ether(frame)
    ip = pkt[IPv6]
    whole = bytes(ip)  # Ethernet padding included: cut at the payload length
    seg = whole[len(whole) - len(bytes(pkt[L4[proto]])): 40 + ip.plen]
    pseudo = (socket.inet_pton(socket.AF_INET6, ip.src) + socket.inet_pton(socket.AF_INET6, ip.dst)
              + struct.pack("!IxxxB", len(seg), 6 if proto == "tcp" else 17))
    return _ones_sum(pseudo + seg)


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("side", ["D", "S"])
@pytest.mark.parametrize("shape", [*EXT6, "vlan", "padded", "vlan+hbh"])
def test_nat6_rewrite_matches_scapy(harness: Harness, proto: str, side: str, shape: str) -> None:
    ext = EXT6.get(shape, ["hbh"] if "hbh" in shape else [])
    frame = frame_of(l4_packet6(proto, CLIENT6, VIP6, 40000, 443, b"x" * 5, ext=ext),
                     vlan="vlan" in shape, pad=12 if shape == "padded" else 0)
    addr, port = (BACKEND6, 8443) if side == "D" else (SNAT6, 1234)
    got = nat6(harness, frame, side, addr, port)
    want = expect_nat(frame, proto, side, addr, port)
    assert got == f"OK {want.hex()}"
    assert l4_sum6(want, proto) == 0xFFFF  # scapy's checksum is right, and so is ours


ADDRS6 = st.binary(min_size=16, max_size=16).map(
    lambda b: socket.inet_ntop(socket.AF_INET6, b))


@SETTINGS
@given(proto=st.sampled_from(["tcp", "udp"]), side=st.sampled_from(["S", "D"]),
       src=ADDRS6, dst=ADDRS6, sport=PORTS, dport=PORTS, new_addr=ADDRS6, new_port=PORTS,
       payload=st.binary(max_size=64),
       ext=st.lists(st.sampled_from(["hbh", "dst"]), max_size=3),
       ext_size=st.sampled_from([8, 16, 64]), udp_zero=st.booleans(), vlan=st.booleans())
def test_nat6_rewrite_random(harness: Harness, proto: str, side: str, src: str, dst: str,
                             sport: int, dport: int, new_addr: str, new_port: int,
                             payload: bytes, ext: list[str], ext_size: int, udp_zero: bool,
                             vlan: bool) -> None:
    frame = frame_of(l4_packet6(proto, src, dst, sport, dport, payload, ext=ext,
                                udp_zero=udp_zero, ext_size=ext_size), vlan=vlan)
    got = nat6(harness, frame, side, new_addr, new_port)
    assert got == f"OK {expect_nat(frame, proto, side, new_addr, new_port).hex()}"


def test_nat6_udp_checksum_zero_stays_zero(harness: Harness) -> None:
    frame = frame_of(l4_packet6("udp", CLIENT6, VIP6, 5353, 53, b"query", udp_zero=True))
    got = nat6(harness, frame, "D", BACKEND6, 5300)
    out = Ether(bytes.fromhex(got.split()[1]))
    assert out[UDP].chksum == 0 and out[IPv6].dst == BACKEND6 and out[UDP].dport == 5300


@pytest.mark.parametrize("side", ["D", "S"])
def test_nat6_udp_recomputed_zero_goes_out_as_ffff(harness: Harness, side: str) -> None:
    new_addr, new_port = "fd00:9::7", 4242

    def datagram(last: int) -> Packet:
        return l4_packet6("udp", CLIENT6, VIP6, 1111, 2222, b"abcdef" + struct.pack("!H", last))
    ip = IPv6(bytes(datagram(0)))
    if side == "D":
        ip.dst, ip[UDP].dport = new_addr, new_port
    else:
        ip.src, ip[UDP].sport = new_addr, new_port
    udp = bytes(ip[UDP])
    pseudo = (socket.inet_pton(socket.AF_INET6, ip.src) + socket.inet_pton(socket.AF_INET6, ip.dst)
              + struct.pack("!IxxxB", len(udp), 17))
    word = 0xFFFF - _ones_sum(pseudo + udp[:6] + b"\0\0" + udp[8:])
    frame = frame_of(datagram(word))
    want = expect_nat(frame, "udp", side, new_addr, new_port)
    assert Ether(want)[UDP].chksum == 0xFFFF, "the case must be the one that computes to 0"
    assert Ether(frame)[UDP].chksum not in (0, 0xFFFF)
    assert nat6(harness, frame, side, new_addr, new_port) == f"OK {want.hex()}"


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("side", ["D", "S"])
def test_nat6_wrong_checksum_stays_as_wrong(harness: Harness, proto: str, side: str) -> None:
    """Incremental: a checksum that was wrong by d is still wrong by d."""
    raw = bytearray(frame_of(l4_packet6(proto, CLIENT6, VIP6, 40000, 443, b"data",
                                        ext=["dst"])))
    csum_at = 14 + 40 + 16 + (16 if proto == "tcp" else 6)
    raw[csum_at] ^= 0x12
    frame = bytes(raw)
    bad = l4_sum6(frame, proto)
    assert bad != 0xFFFF
    got = nat6(harness, frame, side, BACKEND6 if side == "D" else SNAT6, 8443)
    out = bytes.fromhex(got.split()[1])
    assert l4_sum6(out, proto) == bad


def test_nat6_refuses_what_it_cannot_translate(harness: Harness) -> None:
    base = l4_packet6("tcp", CLIENT6, VIP6, 1000, 80, b"data" * 4)
    head = IPv6(src=CLIENT6, dst=VIP6)
    tcp = bytes(base[TCP])
    cases = {
        "first fragment": head / IPv6ExtHdrFragment(nh=6, m=1, id=7) / Raw(tcp),
        "later fragment": head / IPv6ExtHdrFragment(nh=6, offset=2, id=7) / Raw(tcp[16:]),
        "icmpv6": head / ICMPv6EchoRequest(),
        "other protocol": IPv6(src=CLIENT6, dst=VIP6, nh=47) / b"gre-ish-payload",
        "ipv4": l4_packet("tcp", CLIENT, VIP, 1000, 80, b""),
    }
    for name, pkt in cases.items():
        assert nat6(harness, frame_of(pkt), "D", BACKEND6, 80).startswith(
            "ERR not_applicable"), name
    # An invalid side: refused, nothing written (the harness checks).
    assert harness.ask(f"n 0 {a6(BACKEND6)} 80 {frame_of(base).hex()}") == "ERR malformed ok"


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_nat6_extension_header_bound(harness: Harness, proto: str) -> None:
    """At most 256 bytes of extension headers (LB_NAT6_MAX_L4_OFF = 14 + 40 + 256)."""
    at_bound = frame_of(l4_packet6(proto, CLIENT6, VIP6, 1, 2, b"x", ext=["dst"], ext_size=256))
    assert nat6(harness, at_bound, "D", BACKEND6, 3) == \
        f"OK {expect_nat(at_bound, proto, 'D', BACKEND6, 3).hex()}"
    beyond = [frame_of(l4_packet6(proto, CLIENT6, VIP6, 1, 2, b"x", ext=["hbh", "dst"],
                                  ext_size=136)),
              frame_of(l4_packet6(proto, CLIENT6, VIP6, 1, 2, b"x", ext=["dst"], ext_size=256),
                       vlan=True)]
    for frame in beyond:
        assert nat6(harness, frame, "D", BACKEND6, 3) == "ERR not_applicable ok"
        assert harness.ask(f"f {frame.hex()}") == "OK 0"


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_nat6_every_truncation_is_refused(harness: Harness, proto: str) -> None:
    frames = [frame_of(l4_packet6(proto, CLIENT6, VIP6, 1000, 80, b"p" * 9)),
              frame_of(l4_packet6(proto, CLIENT6, VIP6, 1000, 80, b"", ext=["hbh"]),
                       vlan=True)]
    for frame in frames:
        for cut in range(len(frame)):
            assert nat6(harness, frame[:cut], "S", SNAT6, 9).startswith("ERR "), cut
        assert nat6(harness, frame, "S", SNAT6, 9).startswith("OK ")


def test_nat6_header_that_contradicts_the_parse_is_refused(harness: Harness) -> None:
    raw = bytearray(frame_of(l4_packet6("tcp", CLIENT6, VIP6, 1, 2, b"")))
    struct.pack_into("!H", raw, 14 + 4, 10)  # payload shorter than the TCP checksum's end
    assert nat6(harness, bytes(raw), "D", BACKEND6, 3).startswith("ERR ")


@pytest.mark.parametrize(("flags", "want"), [("S", 2), ("SA", 18), ("R", 4), ("FA", 17)])
def test_tcp_flags6(harness: Harness, flags: str, want: int) -> None:
    for ext in ([], ["hbh", "dst"]):
        frame = frame_of(l4_packet6("tcp", CLIENT6, VIP6, 1, 2, b"", ext=ext, flags=flags))
        assert harness.ask(f"f {frame.hex()}") == f"OK {want}"
    udp = frame_of(l4_packet6("udp", CLIENT6, VIP6, 1, 2, b"\x12" * 20))
    assert harness.ask(f"f {udp.hex()}") == "OK 0"
    v4 = frame_of(l4_packet("tcp", CLIENT, VIP, 1, 2, b""))
    assert harness.ask(f"f {v4.hex()}") == "OK 0"


def key6(saddr: str, daddr: str, sport: int, dport: int) -> str:
    return f"{a6(saddr)} {a6(daddr)} {sport} {dport}"


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_conn6_translate(harness: Harness, proto: str) -> None:
    """lb_conn6_translate: the packet leaves as its entry's peer reversed."""
    orig = key6(CLIENT6, VIP6, 40000, 443)
    to_vip = frame_of(l4_packet6(proto, CLIENT6, VIP6, 40000, 443, b"hi", ext=["hbh"]))
    # Original direction, no SNAT: the destination only.
    peer = key6(BACKEND6, CLIENT6, 8443, 40000)
    want = expect_nat(to_vip, proto, "D", BACKEND6, 8443)
    assert harness.ask(f"t {orig} {peer} {to_vip.hex()}") == f"OK {want.hex()}"
    # With SNAT: both.
    peer = key6(BACKEND6, SNAT6, 8443, 20001)
    want = expect_nat(expect_nat(to_vip, proto, "D", BACKEND6, 8443), proto, "S", SNAT6, 20001)
    assert harness.ask(f"t {orig} {peer} {to_vip.hex()}") == f"OK {want.hex()}"
    # The reply: the source only.
    reply = frame_of(l4_packet6(proto, BACKEND6, CLIENT6, 8443, 40000, b"ho"))
    want = expect_nat(reply, proto, "S", VIP6, 443)
    assert harness.ask(f"t {key6(BACKEND6, CLIENT6, 8443, 40000)} {orig} {reply.hex()}") == \
        f"OK {want.hex()}"
    # Nothing changes: nothing written.
    assert harness.ask(f"t {orig} {key6(VIP6, CLIENT6, 443, 40000)} {to_vip.hex()}") == \
        f"OK {to_vip.hex()}"
    # A fragment is refused whatever the keys say.
    frag = frame_of(IPv6(src=CLIENT6, dst=VIP6) / IPv6ExtHdrFragment(nh=6, m=1) / Raw(b"\0" * 24))
    assert harness.ask(f"t {orig} {peer} {frag.hex()}").startswith("ERR not_applicable")


ICMP6 = {1: ICMPv6DestUnreach, 2: ICMPv6PacketTooBig, 3: ICMPv6TimeExceeded,
         4: ICMPv6ParamProblem}
ICMP6_TYPES = [(1, 0), (1, 3), (1, 4), (2, 0), (3, 0), (3, 1), (4, 0)]


def icmp6_case(proto: str, mode: str, itype: int, code: int, quote: int | str, *,
               outer_rewrite: bool = True, udp_zero: bool = False,
               payload: bytes = b"some payload!", extra: bytes = b"", vlan: bool = False,
               outer_ext: bool = False, pad: int = 0, snat: bool = False,
               ) -> tuple[str, bytes, bytes, Packet, int]:
    """icmp_case for IPv6: (x request, frame, expected frame, quoted packet, l4 quoted).

    dnat: CLIENT6 -> VIP6:443 went on to BACKEND6:8443 (with snat=True from
    SNAT6:20001); the error goes back to the sender: the quote becomes the
    client's packet again, the outer source VIP6 (destination CLIENT6).
    snat: BACKEND6:8443 -> CLIENT6 left as VIP6:443 -> CLIENT6; the error comes
    to VIP6: the quoted source and the outer destination become BACKEND6's.
    """
    kw = {"udp_zero": udp_zero}
    if mode == "dnat":
        orig = l4_packet6(proto, CLIENT6, VIP6, 40000, 443, payload, **kw)
        src, sport = (SNAT6, 20001) if snat else (CLIENT6, 40000)
        wire = l4_packet6(proto, src, BACKEND6, sport, 8443, payload, **kw)
        outer = (ROUTER6, src)
        want_outer = (VIP6, CLIENT6 if snat else src) if outer_rewrite else outer
        req = ("D", VIP6, 443, VIP6 if outer_rewrite else "-")
    else:
        orig = l4_packet6(proto, BACKEND6, CLIENT6, 8443, 40000, payload, **kw)
        wire = l4_packet6(proto, VIP6, CLIENT6, 443, 40000, payload, **kw)
        outer = (ROUTER6, VIP6)
        want_outer = (ROUTER6, BACKEND6) if outer_rewrite else outer
        req = ("S", BACKEND6, 8443, BACKEND6 if outer_rewrite else "-")
    wire_b, orig_b = bytes(wire), bytes(orig)
    qlen = len(wire_b) if quote == "whole" else 40 + quote if isinstance(
        quote, int) else int(quote[1:])  # "=N": N bytes of the packet, any cut
    qlen = min(qlen, len(wire_b))
    quoted_orig = bytearray(orig_b[:qlen])
    l4q = qlen - 40
    if proto == "tcp" and 16 < l4q < 18:
        quoted_orig[40 + 16] = wire_b[40 + 16]  # half a checksum: left as it is

    def build(src: str, dst: str, quoted: bytes) -> bytes:
        icmp = ICMP6[itype](code=code)
        if itype == 2:
            icmp.mtu = 1280
        if itype == 4:
            icmp.ptr = 7
        ip: Packet = IPv6(src=src, dst=dst, hlim=61)
        if outer_ext:
            ip = ip / ext_header("hbh")
        return frame_of(ip / icmp / Raw(quoted + extra), vlan=vlan, pad=pad)
    frame = build(*outer, wire_b[:qlen])
    want = build(*want_outer, bytes(quoted_orig))
    outer_field = req[3] if req[3] == "-" else a6(req[3])
    line = f"x {req[0]} {a6(req[1])} {req[2]} {outer_field} {frame.hex()}"
    if l4q >= len(wire_b) - 40 and extra:
        l4q = len(wire_b) - 40
    return line, frame, want, wire, l4q


@pytest.mark.parametrize(("itype", "code"), ICMP6_TYPES)
@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("mode", ["dnat", "snat"])
@pytest.mark.parametrize("quote", [8, 17, 18, 20, "whole"])
def test_icmp6_error_translated(harness: Harness, itype: int, code: int, proto: str, mode: str,
                                quote: int | str) -> None:
    line, frame, want, wire, l4q = icmp6_case(proto, mode, itype, code, quote)
    assert harness.ask(line) == f"OK {want.hex()}"
    info = harness.ask(f"i {frame.hex()}").split()
    l4 = wire[L4[proto]]
    assert info == ["OK", str(itype), str(code), "6" if proto == "tcp" else "17",
                    a6(wire.src), a6(wire.dst), str(l4.sport), str(l4.dport), "14", "54", "62",
                    "102", str(l4q)]


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("variant", ["outer_ext", "vlan", "no_outer", "udp_zero", "linux1232",
                                     "extension", "padding"])
@pytest.mark.parametrize("mode", ["dnat", "snat"])
def test_icmp6_error_variants(harness: Harness, proto: str, variant: str, mode: str) -> None:
    kw: dict = {}
    quote: int | str = "whole"
    if variant in ("outer_ext", "vlan", "udp_zero"):
        kw[variant] = True
    elif variant == "no_outer":
        kw["outer_rewrite"] = False
    elif variant == "linux1232":
        # RFC 4443 2.4(c): as much as fits in the minimum MTU, 1280 - 40 - 8.
        kw["payload"] = bytes(range(256)) * 6
        quote = "=1232"
    elif variant == "extension":
        kw["extra"] = bytes.fromhex("2000a5a5") + b"\xde\xad" * 10
    elif variant == "padding":
        quote, kw["pad"] = 8, 40
    line, frame, want, _wire, l4q = icmp6_case(proto, mode, 1, 4, quote, **kw)
    assert harness.ask(line) == f"OK {want.hex()}"
    info = harness.ask(f"i {frame.hex()}").split()
    assert info[0] == "OK" and info[-1] == str(l4q), (info, l4q)


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("mode", ["dnat", "snat", "dnat+snat"])
def test_conn6_icmp_translate(harness: Harness, proto: str, mode: str) -> None:
    """lb_conn6_icmp_key + lb_conn6_icmp_translate against the entries' keys."""
    _line, frame, want, wire, _l4q = icmp6_case(proto, mode.split("+")[0], 3, 0, "whole",
                                                snat="+" in mode)
    l4 = wire[L4[proto]]
    # The entry found under the quote reversed names orig: the packet as sent.
    orig = (key6(CLIENT6, VIP6, 40000, 443) if mode.startswith("dnat")
            else key6(BACKEND6, CLIENT6, 8443, 40000))
    assert harness.ask(f"y {orig} {frame.hex()}") == f"OK {want.hex()}"
    # An orig equal to the quote: nothing to restore, nothing written.
    same = key6(wire.src, wire.dst, l4.sport, l4.dport)
    assert harness.ask(f"y {same} {frame.hex()}") == f"OK {frame.hex()}"


@SETTINGS
@given(proto=st.sampled_from(["tcp", "udp"]), mode=st.sampled_from(["dnat", "snat"]),
       tc=st.sampled_from(ICMP6_TYPES), payload=st.binary(max_size=80),
       cut=st.integers(min_value=8, max_value=200), udp_zero=st.booleans(),
       outer_rewrite=st.booleans(), outer_ext=st.booleans())
def test_icmp6_error_random(harness: Harness, proto: str, mode: str, tc: tuple[int, int],
                            payload: bytes, cut: int, udp_zero: bool, outer_rewrite: bool,
                            outer_ext: bool) -> None:
    line, _frame, want, _wire, _l4q = icmp6_case(
        proto, mode, tc[0], tc[1], cut, payload=payload, udp_zero=udp_zero,
        outer_rewrite=outer_rewrite, outer_ext=outer_ext)
    assert harness.ask(line) == f"OK {want.hex()}"


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_icmp6_truncated_quotes_are_refused(harness: Harness, proto: str) -> None:
    for quote in [0, 4, 7]:  # short of the ports
        line, frame, _w, _p, _q = icmp6_case(proto, "dnat", 1, 4, quote)
        assert harness.ask(line) == "ERR malformed", quote
        assert harness.ask(f"i {frame.hex()}") == "ERR malformed unsupported_l4"
    for cut in [0, 10, 39]:  # the quoted IPv6 header cut
        line, _f, _w, _p, _q = icmp6_case(proto, "dnat", 3, 0, f"={cut}")
        assert harness.ask(line) == "ERR malformed", cut
    for quote in [8, "whole"]:
        line, frame, _w, _p, _q = icmp6_case(proto, "snat", 2, 0, quote, outer_ext=True)
        head = line[: len(line) - len(frame.hex())]
        for cut in range(len(frame)):
            assert harness.ask(head + frame[:cut].hex()).startswith("ERR "), cut
            assert harness.ask(f"i {frame[:cut].hex()}").startswith("ERR "), cut


def test_icmp6_messages_nat_leaves_alone(harness: Harness) -> None:
    tcp = l4_packet6("tcp", CLIENT6, BACKEND6, 1, 2, b"")
    inner_ext = l4_packet6("tcp", CLIENT6, BACKEND6, 1, 2, b"", ext=["dst"])
    head = IPv6(src=ROUTER6, dst=CLIENT6)
    big = [ext_header("dst", 256), ext_header("hbh", 8)]
    cases = {
        "echo request": head / ICMPv6EchoRequest() / b"ping",
        "neighbor solicitation": head / ICMPv6ND_NS(tgt=CLIENT6),
        "quotes ICMPv6": head / ICMPv6DestUnreach() / bytes(
            IPv6(src=CLIENT6, dst=BACKEND6) / ICMPv6EchoRequest() / b"12345678"),
        "quotes an extension header": head / ICMPv6TimeExceeded() / bytes(inner_ext),
        "fragmented error": head / IPv6ExtHdrFragment(nh=58, m=1) / ICMPv6DestUnreach()
        / bytes(tcp),
        "beyond the bound": head / big[1] / big[0] / ICMPv6DestUnreach() / bytes(tcp),
        "TCP, not ICMPv6": tcp,
        "ICMPv4": IP(src=ROUTER, dst=CLIENT) / ICMP(type=3) / bytes(
            l4_packet("tcp", CLIENT, BACKEND, 1, 2, b"")),
    }
    for name, pkt in cases.items():
        frame = frame_of(pkt)
        assert harness.ask(f"x D {a6(VIP6)} 1 {a6(VIP6)} {frame.hex()}") == \
            "ERR not_applicable", name
        assert harness.ask(f"i {frame.hex()}").startswith("ERR not_applicable"), name


@SETTINGS
@given(seed=st.integers(min_value=0, max_value=2**32 - 1),
       kind=st.sampled_from(["n", "x", "t", "y", "f"]), flips=st.integers(min_value=1, max_value=6))
def test_nat6_corrupted_frames_never_escape(harness: Harness, seed: int, kind: str,
                                            flips: int) -> None:
    rng = random.Random(seed)
    if kind in "ntf":
        frame = frame_of(l4_packet6(rng.choice(["tcp", "udp"]), CLIENT6, VIP6, 1, 2,
                                    rng.randbytes(rng.randrange(20)),
                                    ext=rng.choice([[], ["hbh"], ["dst", "hbh"]])))
    else:
        _l, frame, *_ = icmp6_case(rng.choice(["tcp", "udp"]), "dnat", 1, 4,
                                   rng.choice([8, 20, "whole"]), outer_ext=rng.random() < 0.5)
    raw = bytearray(frame)
    for _ in range(flips):
        raw[rng.randrange(min(len(raw), 140))] = rng.randrange(256)
    raw = raw[: rng.randrange(len(raw) // 2, len(raw) + 1)]
    args = {"n": f"D {a6(VIP6)} 7", "x": f"D {a6(VIP6)} 7 {a6(VIP6)}", "f": "",
            "t": f"{key6(CLIENT6, VIP6, 1, 2)} {key6(BACKEND6, SNAT6, 3, 4)}",
            "y": key6(CLIENT6, VIP6, 40000, 443)}[kind]
    answer = harness.ask(f"{kind} {args} {bytes(raw).hex()}".replace("  ", " "))
    assert answer.startswith(("OK", "ERR")), answer


# ---- the BPF build ---------------------------------------------------------------


def test_bpf_build_is_loaded_and_agrees(harness: Harness) -> None:
    """Every request above went through the BPF build as well (root only)."""
    if harness.bpf_reason is not None:
        pytest.skip(f"BPF cross-check: {harness.bpf_reason}")
    before = harness.ask("C").split()
    line, *_ = icmp_case("tcp", "dnat", 3, 4, "whole")
    harness.ask(line)
    frame = frame_of(l4_packet("udp", CLIENT, VIP, 1, 2, b"x"))
    nat(harness, frame, "D", BACKEND, 3)
    # The IPv6 program too (nat6_xdp).
    line6, *_ = icmp6_case("udp", "snat", 2, 0, "whole")
    assert harness.ask(line6).startswith("OK ")
    frame6 = frame_of(l4_packet6("tcp", CLIENT6, VIP6, 1, 2, b"x", ext=["hbh"]))
    assert nat6(harness, frame6, "S", SNAT6, 3).startswith("OK ")
    count = harness.ask("C").split()
    print(f"nat_harness: {count[1]} requests, {count[2]} also through BPF")
    assert count[0] == "COUNT" and int(count[2]) - int(before[2]) == 4, (before, count)
