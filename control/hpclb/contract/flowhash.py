"""The keyed flow hash, bit-identical to ``dataplane/common/lb_hash.h``.

The data planes pick a flow's ring slot with SipHash-2-4, keyed with the
16-byte key from the configuration, over a message built from the flow's
``struct lb_flow_key`` (40 bytes since table protocol 2): an IPv4 flow hashes
the 16-byte tuple of protocol 1 (saddr, daddr, sport, dport in network byte
order, the protocol byte, three zero bytes), so that every IPv4 flow keeps its
ring slot across the upgrade; an IPv6 flow hashes its whole 40-byte key.
The control plane needs the very same function: the reference
model (``model.py``) predicts which backend a packet reaches, and the
conformance suite compares that prediction with what the XDP program and the
DPDK forwarder actually did. Any difference here would show up as a data-plane
"bug" that is really a Python one, so this module mirrors the C code step by
step (including its unsigned 64-bit wrap-around in :func:`probe_slot`) and
``tests/unit/test_flowhash.py`` checks it against the compiled header.

Addresses may be given as strings, :class:`ipaddress.IPv4Address` or
:class:`ipaddress.IPv6Address`, the 4 or 16 packed bytes, or an IPv4 address's
numeric value (``int(IPv4Address(...))``, i.e. host order; an int is always
IPv4). Both addresses of a flow are of one family. Ports and protocol are plain
numbers, as a user writes them; the conversion to network order happens here,
exactly once.
"""

from __future__ import annotations

import ipaddress
import struct
from typing import TYPE_CHECKING

import numpy as np

from hpclb.contract.tables import HASH_KEY_LEN, RING_PROBES

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, NDArray

__all__ = [
    "FLOW_KEY_LEN",
    "HASH_KEY_LEN",
    "RING_PROBES",
    "Address",
    "BytesLike",
    "flow_hash",
    "flow_hash_many",
    "flow_hash_message",
    "flow_key_bytes",
    "flow_slot",
    "probe_slot",
    "probe_slots",
    "siphash24",
]

#: sizeof(struct lb_flow_key).
FLOW_KEY_LEN = 40
#: The message an IPv4 flow is hashed as: protocol 1's 16-byte tuple.
FLOW_TUPLE_V4_LEN = 16

FAMILY_V4 = 4
FAMILY_V6 = 6

Address = str | int | bytes | ipaddress.IPv4Address | ipaddress.IPv6Address
#: A hash key: 16 bytes in any bytes-like container.
BytesLike = bytes | bytearray | memoryview

_MASK64 = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1
# struct lb_flow_key: network order, no padding but the explicit 2x.
_FLOW_KEY = struct.Struct("!16s16sHHBB2x")
# The protocol-1 tuple an IPv4 flow is hashed as (lb_flow_hash_v4).
_FLOW_TUPLE_V4 = struct.Struct("!4s4sHHB3x")

_C0 = 0x736F6D6570736575
_C1 = 0x646F72616E646F6D
_C2 = 0x6C7967656E657261
_C3 = 0x7465646279746573


def _sipround(v0: int, v1: int, v2: int, v3: int) -> tuple[int, int, int, int]:
    """One SipRound on Python ints, masked to 64 bits after each addition."""
    v0 = (v0 + v1) & _MASK64
    v1 = ((v1 << 13) | (v1 >> 51)) & _MASK64
    v1 ^= v0
    v0 = ((v0 << 32) | (v0 >> 32)) & _MASK64
    v2 = (v2 + v3) & _MASK64
    v3 = ((v3 << 16) | (v3 >> 48)) & _MASK64
    v3 ^= v2
    v0 = (v0 + v3) & _MASK64
    v3 = ((v3 << 21) | (v3 >> 43)) & _MASK64
    v3 ^= v0
    v2 = (v2 + v1) & _MASK64
    v1 = ((v1 << 17) | (v1 >> 47)) & _MASK64
    v1 ^= v2
    v2 = ((v2 << 32) | (v2 >> 32)) & _MASK64
    return v0, v1, v2, v3


def _check_key(key: BytesLike) -> bytes:
    kb = bytes(key)
    if len(kb) != HASH_KEY_LEN:
        raise ValueError(f"hash key must be {HASH_KEY_LEN} bytes, got {len(kb)}")
    return kb


def siphash24(key: BytesLike, msg: BytesLike) -> int:
    """SipHash-2-4 of ``msg`` (any length) under a 16-byte ``key``.

    General-length, so that the published reference vectors (which include
    messages other than 16 bytes) can check the primitive on its own, apart
    from the flow-key layout.
    """
    kb = _check_key(key)
    data = bytes(msg)
    k0 = int.from_bytes(kb[:8], "little")
    k1 = int.from_bytes(kb[8:], "little")
    v0, v1, v2, v3 = k0 ^ _C0, k1 ^ _C1, k0 ^ _C2, k1 ^ _C3
    n = len(data)
    end = n - n % 8
    for i in range(0, end, 8):
        m = int.from_bytes(data[i : i + 8], "little")
        v3 ^= m
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0 ^= m
    last = ((n & 0xFF) << 56) | int.from_bytes(data[end:], "little")
    v3 ^= last
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0 ^= last
    v2 ^= 0xFF
    for _ in range(4):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def _addr_bytes(addr: Address) -> bytes:
    """The 4 or 16 network-order bytes of an address given in any accepted form."""
    if isinstance(addr, bool):  # bool is an int; never a sensible address
        raise TypeError("address must not be a bool")
    if isinstance(addr, ipaddress.IPv4Address | ipaddress.IPv6Address):
        return addr.packed
    if isinstance(addr, int):
        return ipaddress.IPv4Address(addr).packed  # an int is IPv4's numeric value
    if isinstance(addr, bytes):
        if len(addr) not in (4, 16):
            raise ValueError(f"a packed address is 4 or 16 bytes, got {len(addr)}")
        return addr
    if isinstance(addr, str):
        return ipaddress.ip_address(addr).packed
    raise TypeError(
        "address must be str, int, bytes, IPv4Address or IPv6Address, "
        f"not {type(addr).__name__}"
    )


def _check_range(name: str, value: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    v = int(value)
    if not 0 <= v <= hi:
        raise ValueError(f"{name} must be in 0..{hi}, got {v}")
    return v


def _flow_fields(
    saddr: Address, daddr: Address, sport: int, dport: int, proto: int
) -> tuple[bytes, bytes, int, int, int]:
    s, d = _addr_bytes(saddr), _addr_bytes(daddr)
    if len(s) != len(d):
        raise ValueError("saddr and daddr must be of one family (both IPv4 or both IPv6)")
    return (
        s,
        d,
        _check_range("sport", sport, 0xFFFF),
        _check_range("dport", dport, 0xFFFF),
        _check_range("proto", proto, 0xFF),
    )


def flow_key_bytes(saddr: Address, daddr: Address, sport: int, dport: int, proto: int) -> bytes:
    """The 40 bytes of ``struct lb_flow_key`` for a 5-tuple, as the data planes store it.

    Addresses and ports are stored in network order (as they sit in the packet,
    so the fast path never swaps bytes); an IPv4 address fills the first 4
    bytes of its 16 and the rest is zero; the family byte is 4 or 6; the two
    pad bytes are zero.
    """
    s, d, sp, dp, pr = _flow_fields(saddr, daddr, sport, dport, proto)
    family = FAMILY_V4 if len(s) == 4 else FAMILY_V6
    return _FLOW_KEY.pack(s, d, sp, dp, pr, family)


def flow_hash_message(
    saddr: Address, daddr: Address, sport: int, dport: int, proto: int
) -> bytes:
    """The bytes ``lb_flow_hash`` feeds to SipHash for a 5-tuple.

    IPv4: protocol 1's 16-byte tuple (so every IPv4 flow keeps its ring slot);
    IPv6: the whole 40-byte ``struct lb_flow_key``.
    """
    s, d, sp, dp, pr = _flow_fields(saddr, daddr, sport, dport, proto)
    if len(s) == 4:
        return _FLOW_TUPLE_V4.pack(s, d, sp, dp, pr)
    return _FLOW_KEY.pack(s, d, sp, dp, pr, FAMILY_V6)


def flow_hash(
    key: BytesLike, saddr: Address, daddr: Address, sport: int, dport: int, proto: int
) -> int:
    """``lb_flow_hash(key, &flow)``: the unsigned 64-bit hash of a 5-tuple."""
    return siphash24(key, flow_hash_message(saddr, daddr, sport, dport, proto))


def _check_ring(ring_size: int) -> int:
    # lb_probe_slot divides by ring_size - 1; a ring of one slot would be a
    # division by zero in C, so it is refused here rather than mirrored.
    r = _check_range("ring_size", ring_size, _U32_MAX)
    if r < 2:
        raise ValueError(f"ring_size must be at least 2, got {r}")
    return r


def flow_slot(
    key: BytesLike,
    saddr: Address,
    daddr: Address,
    sport: int,
    dport: int,
    proto: int,
    ring_size: int,
) -> int:
    """``lb_flow_slot``: the ring slot a new flow lands on (``hash % ring_size``)."""
    r = _check_ring(ring_size)
    return flow_hash(key, saddr, daddr, sport, dport, proto) % r


def probe_slot(hash_value: int, ring_size: int, n: int) -> int:
    """``lb_probe_slot``: the slot tried on the ``n``-th probe when a slot's backend is down.

    Computed with the C code's unsigned 64-bit arithmetic (the sum is taken
    modulo 2**64 before the final ``% ring_size``), so it agrees with the data
    planes for every input the C types can hold, not only for small ``n``.
    """
    h = _check_range("hash", hash_value, _MASK64)
    r = _check_ring(ring_size)
    k = _check_range("n", n, _U32_MAX)
    step = (h >> 32) % (r - 1) + 1
    return (((h % r) + step * k) & _MASK64) % r


def probe_slots(hash_value: int, ring_size: int, probes: int = RING_PROBES) -> list[int]:
    """The slots a data plane tries for one flow, in order (probe 0 is the flow's slot)."""
    return [probe_slot(hash_value, ring_size, n) for n in range(probes)]


# ---- vectorised --------------------------------------------------------------


def _u64(x: int) -> np.uint64:
    return np.uint64(x)


def _np_rotl(x: NDArray[np.uint64], b: int) -> NDArray[np.uint64]:
    return (x << _u64(b)) | (x >> _u64(64 - b))


def _np_sipround(
    v0: NDArray[np.uint64], v1: NDArray[np.uint64], v2: NDArray[np.uint64], v3: NDArray[np.uint64]
) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]:
    # numpy's uint64 arithmetic on arrays wraps modulo 2**64, exactly like C.
    v0 = v0 + v1
    v1 = _np_rotl(v1, 13) ^ v0
    v0 = _np_rotl(v0, 32)
    v2 = v2 + v3
    v3 = _np_rotl(v3, 16) ^ v2
    v0 = v0 + v3
    v3 = _np_rotl(v3, 21) ^ v0
    v2 = v2 + v1
    v1 = _np_rotl(v1, 17) ^ v2
    v2 = _np_rotl(v2, 32)
    return v0, v1, v2, v3


def _as_u64(name: str, values: ArrayLike, hi: int) -> NDArray[np.uint64]:
    a = np.asarray(values)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, not {a.dtype}")
    if a.size and (int(a.min()) < 0 or int(a.max()) > hi):
        raise ValueError(f"{name} values must be in 0..{hi}")
    return a.astype(np.uint64)


def _bswap32(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    out: NDArray[np.uint64] = (
        ((x & _u64(0xFF)) << _u64(24))
        | ((x & _u64(0xFF00)) << _u64(8))
        | ((x >> _u64(8)) & _u64(0xFF00))
        | ((x >> _u64(24)) & _u64(0xFF))
    )
    return out


def _bswap16(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    return ((x & _u64(0xFF)) << _u64(8)) | ((x >> _u64(8)) & _u64(0xFF))


def flow_hash_many(
    key: BytesLike,
    saddr: ArrayLike,
    daddr: ArrayLike,
    sport: ArrayLike,
    dport: ArrayLike,
    proto: ArrayLike,
) -> NDArray[np.uint64]:
    """:func:`flow_hash` over arrays of IPv4 5-tuples at once (same result, element by element).

    IPv4 only. Addresses are the numeric (host-order) values, ``int(IPv4Address(...))``;
    arrays broadcast against each other. Meant for the reference model and for
    checking a ring's flow spread over a large synthetic corpus, where a Python
    loop over millions of tuples would dominate the run time.
    """
    kb = _check_key(key)
    s, d, sp, dp, pr = np.broadcast_arrays(
        _as_u64("saddr", saddr, _U32_MAX),
        _as_u64("daddr", daddr, _U32_MAX),
        _as_u64("sport", sport, 0xFFFF),
        _as_u64("dport", dport, 0xFFFF),
        _as_u64("proto", proto, 0xFF),
    )
    # Little-endian loads of the struct's two words; its fields are big-endian.
    m0 = _bswap32(s) | (_bswap32(d) << _u64(32))
    m1 = _bswap16(sp) | (_bswap16(dp) << _u64(16)) | (pr << _u64(32))
    k0 = int.from_bytes(kb[:8], "little")
    k1 = int.from_bytes(kb[8:], "little")
    shape = m0.shape
    v0 = np.full(shape, k0 ^ _C0, dtype=np.uint64)
    v1 = np.full(shape, k1 ^ _C1, dtype=np.uint64)
    v2 = np.full(shape, k0 ^ _C2, dtype=np.uint64)
    v3 = np.full(shape, k1 ^ _C3, dtype=np.uint64)
    last = _u64(FLOW_TUPLE_V4_LEN << 56)
    for m in (m0, m1):
        v3 = v3 ^ m
        v0, v1, v2, v3 = _np_sipround(v0, v1, v2, v3)
        v0, v1, v2, v3 = _np_sipround(v0, v1, v2, v3)
        v0 = v0 ^ m
    v3 = v3 ^ last
    v0, v1, v2, v3 = _np_sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = _np_sipround(v0, v1, v2, v3)
    v0 = v0 ^ last
    v2 = v2 ^ _u64(0xFF)
    for _ in range(4):
        v0, v1, v2, v3 = _np_sipround(v0, v1, v2, v3)
    out: NDArray[np.uint64] = v0 ^ v1 ^ v2 ^ v3
    return out
