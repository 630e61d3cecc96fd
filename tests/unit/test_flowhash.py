"""The Python flow hash is bit-identical to dataplane/common/lb_hash.h."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from hpclb.flowhash import flow_hash, probe_slot, siphash24

COMMON = Path(__file__).resolve().parents[2] / "dataplane" / "common"

HARNESS = r"""
#include <stdio.h>
#include <string.h>
#include <arpa/inet.h>
#include "lb_hash.h"

/* stdin: keyhex saddr daddr sport dport proto (host-order integers) per line;
 * stdout: the hash and the first three probe slots of a 65537 ring. */
int main(void)
{
    char keyhex[33];
    unsigned long saddr, daddr, sport, dport, proto;

    while (scanf("%32s %lu %lu %lu %lu %lu", keyhex, &saddr, &daddr, &sport, &dport,
             &proto) == 6) {
        __u8 key[LB_HASH_KEY_LEN];
        struct lb_flow_key flow;
        __u64 h;

        for (int i = 0; i < LB_HASH_KEY_LEN; i++)
            sscanf(keyhex + 2 * i, "%2hhx", &key[i]);
        memset(&flow, 0, sizeof(flow));
        flow.saddr = htonl((__u32)saddr);
        flow.daddr = htonl((__u32)daddr);
        flow.sport = htons((__u16)sport);
        flow.dport = htons((__u16)dport);
        flow.proto = (__u8)proto;
        h = lb_flow_hash(key, &flow);
        printf("%llu %u %u %u\n", (unsigned long long)h, lb_probe_slot(h, 65537, 0),
               lb_probe_slot(h, 65537, 1), lb_probe_slot(h, 65537, 7));
    }
    return 0;
}
"""


def test_reference_vectors() -> None:
    """SipHash-2-4 paper vectors, key 00..0f: empty message and 00..0e."""
    key = bytes(range(16))
    assert siphash24(key, b"") == 0x726FDB47DD0E0E31
    assert siphash24(key, bytes(range(15))) == 0xA129CA6149BE45E5
    assert siphash24(key, bytes(range(16))) == int.from_bytes(
        bytes.fromhex("db9bc2577fcc2a3f"), "little")


def test_c_and_python_agree_on_10000_random_tuples(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the lb_hash.h harness")
    (tmp_path / "harness.c").write_text(HARNESS)
    subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", f"-I{COMMON}", "-o",
                    str(tmp_path / "harness"), str(tmp_path / "harness.c")], check=True)
    rng = random.Random(20261202)
    tuples = []
    for i in range(10_000):
        key = rng.randbytes(16) if i % 100 else bytes(16)
        tuples.append((key, rng.getrandbits(32), rng.getrandbits(32), rng.getrandbits(16),
                       rng.getrandbits(16), rng.choice((6, 17, rng.getrandbits(8)))))
    stdin = "".join(f"{k.hex()} {s} {d} {sp} {dp} {p}\n" for k, s, d, sp, dp, p in tuples)
    out = subprocess.run([str(tmp_path / "harness")], input=stdin, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert len(out) == len(tuples)
    for (key, s, d, sp, dp, p), line in zip(tuples, out, strict=True):
        h = flow_hash(key, s, d, sp, dp, p)
        expected = f"{h} {probe_slot(h, 65537, 0)} {probe_slot(h, 65537, 1)} " \
                   f"{probe_slot(h, 65537, 7)}"
        assert line == expected, (key.hex(), s, d, sp, dp, p)
