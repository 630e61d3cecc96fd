"""Tunnel mode (``mode: tunnel``), run against the model and every data plane.

The specification is the header comment of ``dataplane/common/lb_encap.h``:
DSR through an IPIP or GUE tunnel. As everywhere in the suite, the harness
compares every output frame with the model's byte for byte (outer headers
included); the asserts here are the semantics, each outer field checked on
its own with scapy against what the header comment says, with the flow bits
re-derived here: the inner packet unchanged behind the outer headers
(Ethernet padding kept after it), the outer IPv4 checksum recomputing
equal, DSCP and ECN copied, outer source addresses, flow labels and GUE
source ports spread by flow, drop_encap for the pairs that are refused, and
a flow pinned across a weight change as in DSR mode.

Tables: ``harness.tunnel_tables`` (backends in networks of their own behind
a router, whose MAC the backend table holds).
"""

from __future__ import annotations

import ipaddress
import random
import struct

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

from hpclb.contract.model import Verdict
from hpclb.contract.tables import IPPROTO_TCP, BackendState, Encap, Vip
from hpclb.dataplane.client import DataplaneError

from .harness import (
    TUNNEL_BACKENDS4,
    TUNNEL_BACKENDS6,
    TUNNEL_VIPS,
    VIP_6IN4,
    Harness,
    addr_of,
    tcp,
    tunnel_tables,
    udp,
)

PAIRS = ("4in4", "4in4-gue", "4in6", "4in6-gue", "6in6", "6in6-gue")
# DSCP and ECN values the outer header must copy: none, EF, ECT(0), CE,
# AF41 with ECT(1).
TOS_VALUES = (0x00, 0xB8, 0x02, 0x03, 0x89)


def client_frame(vip: Vip, net: int, i: int, tos: int = 0) -> bytes:
    """Flow ``i`` of client net 198.19.<net>.0/24 (or its IPv6 twin) to ``vip``."""
    family = vip.addr.version
    src = addr_of(family, f"198.19.{net}.{1 + i % 61}")
    tos_field = {"tos": tos} if family == 4 else {"tc": tos}
    build = tcp if vip.proto == IPPROTO_TCP else udp
    return build(src, 20000 + 7 * i, dst=str(vip.addr), dport=vip.port, **tos_field)


def flow_bits(frame: bytes) -> int:
    """The flow bits as lb_encap.h's comment defines them, re-derived: the
    XOR of the inner source address's 16-bit words and the source port."""
    ip = frame[14:]
    if ip[0] >> 4 == 4:
        src, l4 = ip[12:16], (ip[0] & 0xF) * 4
    else:
        src, l4 = ip[8:24], 40
    x = 0
    for (word,) in struct.iter_unpack("!H", src):
        x ^= word
    return x ^ int.from_bytes(ip[l4 : l4 + 2], "big")


def inner_length(frame: bytes) -> int:
    ip = frame[14:]
    if ip[0] >> 4 == 4:
        return int.from_bytes(ip[2:4], "big")
    return 40 + int.from_bytes(ip[4:6], "big")


def inner_tos(frame: bytes) -> int:
    ip = frame[14:]
    return ip[1] if ip[0] >> 4 == 4 else ((ip[0] & 0xF) << 4) | (ip[1] >> 4)


def check_tunnelled(h: Harness, v: Verdict, frame: bytes, vip: Vip) -> int:
    """Every field of the encapsulated frame ``v.frame`` (``frame`` sent to the
    tunnel VIP ``vip``); returns the outer source's last 16 bits."""
    assert h.tables is not None and v.backend_id is not None
    assert (v.action, v.reason, v.events) == ("tx", "fwd_tx", ("tunnel_encap",))
    backend = h.tables.backends[v.backend_id]
    assert vip.tunnel_src is not None
    bits, mask = flow_bits(frame), (1 << vip.tunnel_src_bits) - 1
    gue = vip.tunnel_encap == Encap.GUE
    n_inner = inner_length(frame)
    out = Ether(v.frame)
    assert (out.dst, out.src) == (backend.mac, h.port_macs[0])
    src_last = int.from_bytes(vip.tunnel_src.packed[-2:], "big")
    want_src_last = (src_last & ~mask & 0xFFFF) | (bits & mask)
    if backend.addr.version == 4:
        outer = out[IP]
        hlen = 20
        assert out.type == 0x0800
        assert (outer.version, outer.ihl, outer.tos) == (4, 5, inner_tos(frame))
        assert (outer.len, outer.id, int(outer.flags), outer.frag, outer.ttl) == (
            hlen + 8 * gue + n_inner, 0, 2, 0, 64)  # flags 2: DF
        assert outer.proto == (17 if gue else 4)
        recomputed = IP(bytes(outer)[:20])
        recomputed.chksum = None
        assert IP(bytes(recomputed)).chksum == outer.chksum, "outer IPv4 checksum"
    else:
        outer = out[IPv6]
        hlen = 40
        assert out.type == 0x86DD
        assert (outer.version, outer.tc, outer.fl) == (6, inner_tos(frame), bits)
        assert (outer.plen, outer.hlim) == (8 * gue + n_inner, 64)
        assert outer.nh == (17 if gue else 4 if frame[14] >> 4 == 4 else 41)
    src = ipaddress.ip_address(outer.src)
    assert ipaddress.ip_address(outer.dst) == backend.addr
    assert src.packed[:-2] == vip.tunnel_src.packed[:-2], "only the last 16 bits vary"
    assert int.from_bytes(src.packed[-2:], "big") == want_src_last
    inner_at = 14 + hlen
    if gue:
        u = UDP(v.frame[inner_at : inner_at + 8])
        assert (u.sport, u.dport, u.len, u.chksum) == (
            49152 + (bits & 0x3FFF), vip.gue_port, 8 + n_inner, 0)
        inner_at += 8
    assert v.frame[inner_at:] == frame[14:], "the inner packet, padding and all, unchanged"
    return want_src_last


@pytest.mark.parametrize("pair", PAIRS)
def test_tunnel_pair_encapsulates(tunnel_harness: Harness, pair: str) -> None:
    """Each pair: every outer field, the inner packet unchanged, DSCP/ECN
    copied; the flows spread over the backends, and the flow bits over
    outer source addresses (8 bits of them), flow labels, GUE ports."""
    h = tunnel_harness
    h.load(tunnel_tables())
    vip = TUNNEL_VIPS[pair]
    sources, backends, bits = set(), set(), set()
    for i in range(64):
        frame = client_frame(vip, 40 + PAIRS.index(pair), i, TOS_VALUES[i % len(TOS_VALUES)])
        v = h.send(frame)
        sources.add(check_tunnelled(h, v, frame, vip))
        backends.add(v.backend_id)
        bits.add(flow_bits(frame))
    family_backends = TUNNEL_BACKENDS4 if vip.tunnel_src.version == 4 else TUNNEL_BACKENDS6  # type: ignore[union-attr]
    assert backends == set(family_backends)
    assert len(sources) >= 32, "the flow bits spread the outer source addresses"
    # check_tunnelled found the flow bits in the IPv6 flow label and the GUE
    # source port: they differ between almost all flows (an XOR may collide).
    assert len(bits) >= 56


def test_tunnel_refused_pairs_drop(tunnel_harness: Harness) -> None:
    """A tunnel source of another family than the backend's, the inner
    packet IPv6 (the 6-in-4 the tables can hold) or IPv4: drop_encap, the
    frame not sent. The pick happened (the flow is pinned as in DSR)."""
    h = tunnel_harness
    h.load(tunnel_tables())
    for n, pair in enumerate(("6in6-backends4", "4in6-backends4")):
        vip = TUNNEL_VIPS[pair]
        for i in range(4):
            frame = client_frame(vip, 50 + n, i)
            v = h.send(frame)
            assert (v.action, v.reason, v.events, v.frame) == ("drop", "drop_encap", (), frame)
            assert v.backend_id is None
    assert h.model is not None and len(h.model.flows) == 8


def test_tunnel_ipv6_in_ipv4_is_refused(tunnel_harness: Harness) -> None:
    """IPv6 inside IPv4 (Katran and GLB refuse it: IPv4's path MTU cannot
    carry IPv6's 1280 bytes plus 20): the table protocol refuses an IPv6 VIP
    an IPv4 tunnel source, and the data plane keeps what it had; the model,
    given one anyway, drops its frames as lb_encap_prepare would."""
    h = tunnel_harness
    t = tunnel_tables()
    h.load(t)
    frame = client_frame(VIP_6IN4, 51, 0)
    if h.target is None:
        model = Harness(None, h.port_macs)
        with_6in4 = tunnel_tables()
        with_6in4.vips[VIP_6IN4.vip_id] = VIP_6IN4
        with_6in4.rings[VIP_6IN4.vip_id] = with_6in4.rings[TUNNEL_VIPS["4in4"].vip_id]
        model.load(with_6in4)
        v = model.send(frame)
        assert (v.action, v.reason, v.frame) == ("drop", "drop_encap", frame)
    else:
        with pytest.raises(DataplaneError, match="tunnel_src"):
            h.target.client.set_vip(VIP_6IN4, t.rings[TUNNEL_VIPS["4in4"].vip_id])
    v = h.send(frame)  # nothing was added: no VIP's
    assert (v.action, v.reason) == ("pass", "pass_not_vip")


def test_tunnel_keeps_ethernet_padding_after_the_inner_packet(tunnel_harness: Harness) -> None:
    """A 60-byte minimum frame around a 40-byte packet: the outer lengths
    count the inner packet, the padding follows it as it came."""
    h = tunnel_harness
    h.load(tunnel_tables())
    for n, pair in enumerate(("4in4", "4in6-gue", "6in6")):
        vip = TUNNEL_VIPS[pair]
        frame = client_frame(vip, 52 + n, 0)
        pad = max(60 - len(frame), 6)
        plain = h.send(frame)
        v = h.send(frame + bytes(pad))
        check_tunnelled(h, v, frame + bytes(pad), vip)
        assert v.frame == plain.frame + bytes(pad)


def test_tunnel_outer_source_bits(tunnel_harness: Harness) -> None:
    """tunnel_src_bits 0: every flow leaves from tunnel_src itself; 16: the
    address's whole last 16 bits are the flow's."""
    h = tunnel_harness
    h.load(tunnel_tables())
    fixed, whole = TUNNEL_VIPS["4in4-bits0"], TUNNEL_VIPS["6in6-bits16"]
    assert fixed.tunnel_src is not None and whole.tunnel_src is not None
    for i in range(24):
        frame = client_frame(fixed, 55, i)
        v = h.send(frame)
        check_tunnelled(h, v, frame, fixed)
        assert IP(v.frame[14:34]).src == str(fixed.tunnel_src)
        frame = client_frame(whole, 56, i)
        v = h.send(frame)
        assert check_tunnelled(h, v, frame, whole) == flow_bits(frame)


def test_tunnel_pinning_across_a_weight_change(tunnel_harness: Harness) -> None:
    """Flow pick and pinning exactly as DSR: a weight change moves no pinned
    flow (the same frames, byte for byte), new flows follow the new weights;
    a down backend's flows, and only those, re-hash to another tunnel."""
    h = tunnel_harness
    h.load(tunnel_tables())
    flows = {pair: [client_frame(TUNNEL_VIPS[pair], 57 + n, i) for i in range(60)]
             for n, pair in enumerate(("4in4-gue", "6in6"))}
    before = {pair: [h.send(f) for f in frames] for pair, frames in flows.items()}
    h.load(tunnel_tables({20: 1.0, 21: 1.0, 22: 5.0}, {24: 1.0, 25: 1.0, 26: 5.0}))
    for pair, frames in flows.items():
        assert [h.send(f).frame for f in frames] == [b.frame for b in before[pair]]
        vip, heavy = TUNNEL_VIPS[pair], 22 if pair == "4in4-gue" else 26
        fresh = [h.send(client_frame(vip, 59, 100 + i)).backend_id for i in range(90)]
        assert fresh.count(heavy) > len(fresh) // 2, "the new weights take new flows"
    victim = before["4in4-gue"][0].backend_id
    assert victim is not None
    h.load(tunnel_tables(states={victim: BackendState.DOWN}))
    vip = TUNNEL_VIPS["4in4-gue"]
    for frame, b in zip(flows["4in4-gue"], before["4in4-gue"], strict=True):
        v = h.send(frame)
        if b.backend_id == victim:
            assert v.backend_id not in (victim, None)
            check_tunnelled(h, v, frame, vip)
        else:
            assert v.frame == b.frame


def test_tunnel_two_arm_backend_is_redirected(tunnel_harness: Harness) -> None:
    h = tunnel_harness
    h.load(tunnel_tables())
    vip = TUNNEL_VIPS["4in4-two-arm"]
    v = h.send(client_frame(vip, 60, 0))
    assert (v.action, v.reason, v.backend_id, v.port, v.events) == (
        "redirect", "fwd_redirect", 23, 1, ("tunnel_encap",))
    assert v.frame[6:12] == bytes.fromhex(h.port_macs[1].replace(":", ""))
    assert IP(v.frame[14:34]).dst == "10.23.0.4"


@pytest.mark.parametrize("family", [4, 6], ids=["v4", "v6"])
def test_tunnel_random_frames_never_disagree(tunnel_harness: Harness, family: int) -> None:
    """Frames to tunnel VIPs with random bytes changed after the MACs: the
    data plane does to every one what the model does, outer headers and all."""
    rng = random.Random(23 + family)
    h = tunnel_harness
    h.load(tunnel_tables())
    pairs = [p for p in TUNNEL_VIPS if TUNNEL_VIPS[p].addr.version == family]
    bases = [client_frame(TUNNEL_VIPS[p], 61, i) for i, p in enumerate(pairs)]
    ethertype = b"\x08\x00" if family == 4 else b"\x86\xdd"
    for _ in range(150):
        base = rng.choice(bases)
        frame = bytearray(base[: rng.randint(14, len(base))])
        for _ in range(rng.randint(1, 3)):
            frame[rng.randrange(12, len(frame))] = rng.randrange(256)
        if rng.random() < 0.6:
            frame[12:14] = ethertype
        h.send(bytes(frame))
