"""control/hpclb/contract/flowhash.py agrees bit for bit with dataplane/common/lb_hash.h.

The reference model predicts a flow's backend with the Python hash and the
conformance suite compares that with what the data planes did, so a Python/C
difference would read as a data-plane bug. The C side is the real header,
compiled here into a small harness (tests/unit/flowhash_harness.c) that hashes
the same corpus: more than 10,000 seeded random 5-tuples under many keys and
ring sizes, every probe slot included, and an IPv6 corpus the same way. The
primitive itself is checked against the published SipHash-2-4 test vectors, in
Python and in C. IPv4 hashes are pinned to the values of table protocol 1
(GOLDEN_V4): the family-aware key of protocol 2 moves no IPv4 flow.
"""

from __future__ import annotations

import ipaddress
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpclb.contract import flowhash, tables
from hpclb.contract.flowhash import (
    flow_hash,
    flow_hash_many,
    flow_hash_message,
    flow_key_bytes,
    flow_slot,
    probe_slot,
    probe_slots,
    siphash24,
)

HERE = Path(__file__).resolve().parent
COMMON = HERE.parents[1] / "dataplane" / "common"

REF_KEY = bytes(range(16))
# Reference outputs of SipHash-2-4 with key 00..0f on message 00..(n-1), from
# the reference implementation's vectors.h (vectors_sip64), as little-endian ints.
REF_VECTORS = {
    0: 0x726FDB47DD0E0E31,  # 31 0e 0e dd 47 db 6f 72
    15: 0xA129CA6149BE45E5,  # the SipHash paper's appendix A example
    16: 0x3F2ACC7F57C29BDB,  # db 9b c2 57 7f cc 2a 3f: exactly one struct lb_flow_key
}

# IPv4 flows hashed by table protocol 1 (16-byte struct lb_flow_key) under
# REF_KEY: protocol 2 hashes them to exactly these values.
GOLDEN_V4 = {
    ("10.0.0.1", "192.0.2.10", 40000, 80, 6): 0xEBF1E1FAB32C41E1,
    ("198.51.100.7", "203.0.113.1", 53, 53, 17): 0xB18A27B66E5D9927,
    ("0.0.0.0", "255.255.255.255", 0, 65535, 6): 0x1D7D91238B8AA8C3,
}

# Ring sizes: the default, the largest the data planes take, tiny primes (the
# probe step is 1), and the largest 32-bit prime (the C arithmetic's edges).
RING_SIZES = (2, 3, 7, 251, tables.RING_SIZE_DEFAULT, tables.RING_SIZE_MAX, 4294967291)
CORPUS_SIZE = 12_000
SEED = 20_240_601


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the lb_hash.h harness")
    exe = tmp_path_factory.mktemp("flowhash") / "flowhash_harness"
    subprocess.run(
        [cc, "-O2", "-Wall", "-Wextra", "-Werror", f"-I{COMMON}",
         "-o", str(exe), str(HERE / "flowhash_harness.c")],
        check=True,
    )
    return exe


def run_harness(exe: Path, lines: list[str]) -> list[str]:
    out = subprocess.run(
        [str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(out) == len(lines)
    return out


Tuple5 = tuple[bytes, int, int, int, int, int, int]  # key, saddr, daddr, sport, dport, proto, ring


def corpus() -> list[Tuple5]:
    """Seeded random flows, weighted towards the values real traffic and bugs like."""
    rng = random.Random(SEED)
    keys = [bytes(16), REF_KEY, b"\xff" * 16] + [rng.randbytes(16) for _ in range(29)]
    edge_addrs = [0, 1, 0x7F000001, 0xC0A80001, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
    edge_ports = [0, 1, 53, 80, 443, 0x8000, 0xFFFF]
    out: list[Tuple5] = []
    for i in range(CORPUS_SIZE):
        edgy = i % 10 == 0
        saddr = rng.choice(edge_addrs) if edgy else rng.getrandbits(32)
        daddr = rng.choice(edge_addrs) if edgy else rng.getrandbits(32)
        sport = rng.choice(edge_ports) if edgy else rng.getrandbits(16)
        dport = rng.choice(edge_ports) if edgy else rng.getrandbits(16)
        proto = rng.choice((6, 17, 6, 17, 0, 1, 255, rng.getrandbits(8)))
        out.append((rng.choice(keys), saddr, daddr, sport, dport, proto, rng.choice(RING_SIZES)))
    return out


def test_reference_vectors() -> None:
    for n, expected in REF_VECTORS.items():
        assert siphash24(REF_KEY, bytes(range(n))) == expected, n


def test_reference_vector_in_c(harness: Path) -> None:
    """The header's whole-word SipHash gives the published value too."""
    (line,) = run_harness(harness, [f"R {REF_KEY.hex()} {bytes(range(16)).hex()}"])
    assert int(line, 16) == REF_VECTORS[16]


def test_40_byte_primitive_in_c(harness: Path) -> None:
    """The five-word path (an IPv6 key's length) agrees with the general SipHash."""
    rng = random.Random(SEED + 2)
    msgs = [bytes(range(40)), bytes(40), b"\xff" * 40] + [rng.randbytes(40) for _ in range(50)]
    out = run_harness(harness, [f"R {REF_KEY.hex()} {m.hex()}" for m in msgs])
    assert [int(x, 16) for x in out] == [siphash24(REF_KEY, m) for m in msgs]


def test_ipv4_golden_vectors(harness: Path) -> None:
    """Protocol 1's hashes, unchanged, in Python and in C."""
    lines = []
    for (s, d, sp, dp, p), expected in GOLDEN_V4.items():
        assert flow_hash(REF_KEY, s, d, sp, dp, p) == expected
        lines.append(f"F {REF_KEY.hex()} {int(ipaddress.IPv4Address(s))} "
                     f"{int(ipaddress.IPv4Address(d))} {sp} {dp} {p} 65537")
    out = run_harness(harness, lines)
    assert [int(x.split()[0], 16) for x in out] == list(GOLDEN_V4.values())


def test_flow_key_layout() -> None:
    raw = flow_key_bytes("1.2.3.4", "5.6.7.8", 0x1234, 0x5678, 6)
    assert raw == bytes.fromhex(
        "01020304" + "00" * 12 + "05060708" + "00" * 12 + "1234" "5678" "06" "04" "0000"
    )
    assert len(raw) == tables.FLOW_KEY_DTYPE.itemsize == flowhash.FLOW_KEY_LEN
    rec = np.frombuffer(raw, dtype=tables.FLOW_KEY_DTYPE)[0]
    assert bytes(rec["saddr"]) == bytes([1, 2, 3, 4]) + bytes(12)
    assert int(rec["sport"]) == 0x1234 and int(rec["proto"]) == 6
    assert int(rec["family"]) == 4
    # An IPv4 flow is hashed as protocol 1's 16-byte tuple...
    assert flow_hash_message("1.2.3.4", "5.6.7.8", 0x1234, 0x5678, 6) == bytes.fromhex(
        "0102030405060708" "1234" "5678" "06" "000000"
    )
    # ...an IPv6 flow as its whole key.
    raw6 = flow_key_bytes("2001:db8::1", "2001:db8::2", 1, 2, 17)
    assert len(raw6) == 40 and raw6[37] == 6 and raw6[38:] == bytes(2)
    assert flow_hash_message("2001:db8::1", "2001:db8::2", 1, 2, 17) == raw6
    rec6 = np.frombuffer(raw6, dtype=tables.FLOW_KEY_DTYPE)[0]
    assert bytes(rec6["daddr"]) == ipaddress.IPv6Address("2001:db8::2").packed


def corpus_v6() -> list[tuple[bytes, bytes, bytes, int, int, int, int]]:
    """Seeded random IPv6 flows (key, saddr, daddr, sport, dport, proto, ring)."""
    rng = random.Random(SEED + 3)
    keys = [bytes(16), REF_KEY, b"\xff" * 16] + [rng.randbytes(16) for _ in range(9)]
    edge = [bytes(16), b"\xff" * 16, ipaddress.IPv6Address("::1").packed,
            ipaddress.IPv6Address("::ffff:10.0.0.1").packed,
            ipaddress.IPv6Address("fe80::1").packed]
    out = []
    for i in range(2_000):
        edgy = i % 10 == 0
        s = rng.choice(edge) if edgy else rng.randbytes(16)
        d = rng.choice(edge) if edgy else rng.randbytes(16)
        out.append((rng.choice(keys), s, d, rng.getrandbits(16), rng.getrandbits(16),
                    rng.choice((6, 17, rng.getrandbits(8))), rng.choice(RING_SIZES)))
    return out


def test_ipv6_corpus_matches_c(harness: Path) -> None:
    """IPv6 flows: the 40-byte key hashed, slots and probes, C against Python."""
    flows = corpus_v6()
    lines = [f"S {k.hex()} {s.hex()} {d.hex()} {sp} {dp} {p} {r}"
             for k, s, d, sp, dp, p, r in flows]
    c_out = run_harness(harness, lines)
    mismatches = []
    for (key, s, d, sp, dp, p, ring), c_line in zip(flows, c_out, strict=True):
        h = flow_hash(key, s, d, sp, dp, p)
        assert h == siphash24(key, flow_key_bytes(s, d, sp, dp, p))
        py = [f"{h:016x}", str(flow_slot(key, s, d, sp, dp, p, ring))]
        py += [str(x) for x in probe_slots(h, ring)]
        if py != c_line.split():
            mismatches.append(((s.hex(), d.hex(), sp, dp, p, ring), py, c_line))
    assert not mismatches, mismatches[:5]


def test_ipv6_golden_cases(harness: Path) -> None:
    """A few IPv6 flows by their raw 40-byte key ('K': lb_flow_hash on the struct
    as the data planes would hold it), against Python's hash of the same flow."""
    cases = [
        ("2001:db8::1", "2001:db8::10", 40000, 80, 6),
        ("fd00::7", "fd00::1", 53, 53, 17),
        ("::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 0, 65535, 6),
    ]
    lines = [f"K {REF_KEY.hex()} {flow_key_bytes(*c).hex()}" for c in cases]
    out = run_harness(harness, lines)
    assert [int(x, 16) for x in out] == [flow_hash(REF_KEY, *c) for c in cases]
    # The IPv4 struct through the same path takes the protocol-1 tuple.
    (line,) = run_harness(
        harness, [f"K {REF_KEY.hex()} {flow_key_bytes(*next(iter(GOLDEN_V4))).hex()}"])
    assert int(line, 16) == next(iter(GOLDEN_V4.values()))
    # A v4-mapped IPv6 address is IPv6: another flow than the IPv4 one.
    assert flow_hash(REF_KEY, "::ffff:10.0.0.1", "::ffff:192.0.2.10", 40000, 80, 6) != \
        GOLDEN_V4[("10.0.0.1", "192.0.2.10", 40000, 80, 6)]


def test_address_forms_agree() -> None:
    a = ipaddress.IPv4Address("10.1.2.3")
    forms: list[flowhash.Address] = ["10.1.2.3", int(a), a, a.packed]
    hashes = {flow_hash(REF_KEY, f, "192.0.2.1", 1000, 80, 6) for f in forms}
    assert len(hashes) == 1
    b = ipaddress.IPv6Address("2001:db8::3")
    forms6: list[flowhash.Address] = ["2001:db8::3", b, b.packed]
    assert len({flow_hash(REF_KEY, f, "2001:db8::1", 1000, 80, 6) for f in forms6}) == 1


def test_corpus_matches_c(harness: Path) -> None:
    flows = corpus()
    lines = [f"F {k.hex()} {s} {d} {sp} {dp} {p} {r}" for k, s, d, sp, dp, p, r in flows]
    c_out = run_harness(harness, lines)
    mismatches = []
    for flow, c_line in zip(flows, c_out, strict=True):
        key, saddr, daddr, sport, dport, proto, ring = flow
        h = flow_hash(key, saddr, daddr, sport, dport, proto)
        py = [f"{h:016x}", str(flow_slot(key, saddr, daddr, sport, dport, proto, ring))]
        py += [str(x) for x in probe_slots(h, ring)]
        if py != c_line.split():
            mismatches.append((flow, py, c_line))
    assert not mismatches, mismatches[:5]
    assert len(flows) >= 10_000


def test_vectorised_matches_c(harness: Path) -> None:
    """flow_hash_many over the same corpus, per key, against the C hashes."""
    flows = corpus()
    lines = [f"F {k.hex()} {s} {d} {sp} {dp} {p} {r}" for k, s, d, sp, dp, p, r in flows]
    c_hash = np.array([int(x.split()[0], 16) for x in run_harness(harness, lines)], np.uint64)
    cols = np.array([f[1:6] for f in flows], dtype=np.int64)
    keys = [f[0] for f in flows]
    for key in set(keys):
        idx = np.array([i for i, k in enumerate(keys) if k == key])
        got = flow_hash_many(key, *(cols[idx, j] for j in range(5)))
        assert got.dtype == np.uint64
        np.testing.assert_array_equal(got, c_hash[idx])


def test_probe_wraparound_matches_c(harness: Path) -> None:
    """Huge hash/step/n values, where the C sum wraps modulo 2**64 before the final %."""
    rng = random.Random(SEED + 1)
    cases = [(2**64 - 1, 4294967291, 2**32 - 1), (2**64 - 1, 2, 2**32 - 1), (0, 3, 0)]
    cases += [
        (rng.getrandbits(64), rng.choice(RING_SIZES), rng.choice((rng.getrandbits(32), 2**32 - 1)))
        for _ in range(500)
    ]
    c_out = run_harness(harness, [f"P {h:016x} {r} {n}" for h, r, n in cases])
    assert [probe_slot(h, r, n) for h, r, n in cases] == [int(x) for x in c_out]


@settings(max_examples=60, deadline=None)
@given(
    key=st.binary(min_size=16, max_size=16),
    rows=st.lists(
        st.tuples(
            st.integers(0, 2**32 - 1),
            st.integers(0, 2**32 - 1),
            st.integers(0, 0xFFFF),
            st.integers(0, 0xFFFF),
            st.integers(0, 0xFF),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_vectorised_matches_scalar(key: bytes, rows: list[tuple[int, int, int, int, int]]) -> None:
    cols = np.array(rows, dtype=np.uint64).T
    got = flow_hash_many(key, *cols)
    assert got.tolist() == [flow_hash(key, *r) for r in rows]


def test_vectorised_broadcasts() -> None:
    """One client against a range of ports: scalars broadcast against arrays."""
    ports = np.arange(1024, 1034)
    got = flow_hash_many(REF_KEY, 0x0A000001, 0xC6120A0A, ports, 80, 6)
    assert got.shape == (10,)
    expected = [flow_hash(REF_KEY, 0x0A000001, 0xC6120A0A, int(p), 80, 6) for p in ports]
    assert got.tolist() == expected


@settings(max_examples=40, deadline=None)
@given(h=st.integers(0, 2**64 - 1), ring=st.sampled_from((2, 3, 5, 7, 11, 13, 251)))
def test_probe_sequence_visits_every_slot(h: int, ring: int) -> None:
    """Prime ring: the probe sequence never revisits a slot within ring_size probes."""
    seq = probe_slots(h, ring, ring)
    assert seq[0] == h % ring
    assert sorted(seq) == list(range(ring))


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: flow_hash(b"short", "1.2.3.4", "5.6.7.8", 1, 2, 6), ValueError),
        (lambda: flow_hash(REF_KEY, "::1", "5.6.7.8", 1, 2, 6), ValueError),
        (lambda: flow_hash(REF_KEY, "1.2.3.4", b"\x00" * 5, 1, 2, 6), ValueError),
        (lambda: flow_hash(REF_KEY, "1.2.3.4", 2**32, 1, 2, 6), ValueError),
        (lambda: flow_hash(REF_KEY, "1.2.3.4", "5.6.7.8", 65536, 2, 6), ValueError),
        (lambda: flow_hash(REF_KEY, "1.2.3.4", "5.6.7.8", 1, -1, 6), ValueError),
        (lambda: flow_hash(REF_KEY, "1.2.3.4", "5.6.7.8", 1, 2, 256), ValueError),
        (lambda: flow_hash(REF_KEY, True, "5.6.7.8", 1, 2, 6), TypeError),
        (lambda: flow_hash(REF_KEY, 1.5, "5.6.7.8", 1, 2, 6), TypeError),  # type: ignore[arg-type]
        (lambda: flow_slot(REF_KEY, "1.2.3.4", "5.6.7.8", 1, 2, 6, 1), ValueError),
        (lambda: probe_slot(2**64, 65537, 0), ValueError),
        (lambda: probe_slot(0, 65537, 2**32), ValueError),
        (lambda: flow_hash_many(REF_KEY, [2**32], [0], [0], [0], [6]), ValueError),
        (lambda: flow_hash_many(REF_KEY, [1.0], [0], [0], [0], [6]), TypeError),
    ],
)
def test_rejects_what_c_cannot_hold(call: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        call()  # type: ignore[operator]
