"""control/hpclb/contract/flowhash.py agrees bit for bit with dataplane/common/lb_hash.h.

The reference model predicts a flow's backend with the Python hash and the
conformance suite compares that with what the data planes did, so a Python/C
difference would read as a data-plane bug. The C side is the real header,
compiled here into a small harness (tests/unit/flowhash_harness.c) that hashes
the same corpus: more than 10,000 seeded random 5-tuples under many keys and
ring sizes, every probe slot included. The primitive itself is checked against
the published SipHash-2-4 test vectors, in Python and in C.
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
    """The header's specialised 16-byte SipHash gives the published value too."""
    (line,) = run_harness(harness, [f"R {REF_KEY.hex()} {bytes(range(16)).hex()}"])
    assert int(line, 16) == REF_VECTORS[16]


def test_flow_key_layout() -> None:
    raw = flow_key_bytes("1.2.3.4", "5.6.7.8", 0x1234, 0x5678, 6)
    assert raw == bytes.fromhex("0102030405060708" "1234" "5678" "06" "000000")
    assert len(raw) == tables.FLOW_KEY_DTYPE.itemsize == flowhash.FLOW_KEY_LEN
    rec = np.frombuffer(raw, dtype=tables.FLOW_KEY_DTYPE)[0]
    assert bytes(rec["saddr"]) == bytes([1, 2, 3, 4])
    assert int(rec["sport"]) == 0x1234 and int(rec["proto"]) == 6


def test_address_forms_agree() -> None:
    a = ipaddress.IPv4Address("10.1.2.3")
    forms: list[flowhash.Address] = ["10.1.2.3", int(a), a, a.packed]
    hashes = {flow_hash(REF_KEY, f, "192.0.2.1", 1000, 80, 6) for f in forms}
    assert len(hashes) == 1


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
