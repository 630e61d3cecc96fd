"""The keyed flow hash, bit-identical to ``dataplane/common/lb_hash.h``.

SipHash-2-4 over the 16-byte ``struct lb_flow_key`` (saddr, daddr, sport,
dport in network byte order, proto, three zero bytes), keyed with the
appliance's 16-byte hash key. The control plane uses it in the reference model
and to predict where a flow lands; tests/unit/test_flowhash.py checks it
against the C header on a corpus of random tuples.
"""

from __future__ import annotations

import ipaddress
import struct

_MASK = 0xFFFFFFFFFFFFFFFF

Address = str | int | ipaddress.IPv4Address


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _MASK


def _round(v0: int, v1: int, v2: int, v3: int) -> tuple[int, int, int, int]:
    v0 = (v0 + v1) & _MASK
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 = (v2 + v3) & _MASK
    v3 = _rotl(v3, 16) ^ v2
    v0 = (v0 + v3) & _MASK
    v3 = _rotl(v3, 21) ^ v0
    v2 = (v2 + v1) & _MASK
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def siphash24(key: bytes, msg: bytes) -> int:
    """SipHash-2-4 of any message (the reference algorithm)."""
    if len(key) != 16:
        raise ValueError("SipHash key must be 16 bytes")
    k0, k1 = struct.unpack("<QQ", key)
    v0, v1 = k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D
    v2, v3 = k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573
    tail_len = len(msg) % 8
    for (m,) in struct.iter_unpack("<Q", msg[: len(msg) - tail_len]):
        v3 ^= m
        v0, v1, v2, v3 = _round(*_round(v0, v1, v2, v3))
        v0 ^= m
    last = (len(msg) & 0xFF) << 56 | int.from_bytes(msg[len(msg) - tail_len :], "little")
    v3 ^= last
    v0, v1, v2, v3 = _round(*_round(v0, v1, v2, v3))
    v0 ^= last
    v2 ^= 0xFF
    for _ in range(4):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def _addr(a: Address) -> bytes:
    return ipaddress.IPv4Address(a).packed


def flow_key_bytes(saddr: Address, daddr: Address, sport: int, dport: int, proto: int) -> bytes:
    """``struct lb_flow_key`` as the data planes lay it out in memory."""
    return _addr(saddr) + _addr(daddr) + struct.pack("!HHB3x", sport, dport, proto)


def flow_hash(key: bytes, saddr: Address, daddr: Address, sport: int, dport: int,
              proto: int) -> int:
    return siphash24(key, flow_key_bytes(saddr, daddr, sport, dport, proto))


def probe_slot(flow_hash_value: int, ring_size: int, n: int) -> int:
    """n-th ring slot tried for a flow (lb_probe_slot): n = 0 is the flow's own slot."""
    step = (flow_hash_value >> 32) % (ring_size - 1) + 1
    return (flow_hash_value % ring_size + step * n) % ring_size


def flow_slot(key: bytes, saddr: Address, daddr: Address, sport: int, dport: int, proto: int,
              ring_size: int) -> int:
    return flow_hash(key, saddr, daddr, sport, dport, proto) % ring_size
