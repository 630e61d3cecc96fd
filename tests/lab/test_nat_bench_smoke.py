"""`hpclb bench --mode nat` runs every phase (packets/s with NAT and DSR kinds, the
SYN flood's connections/s, memory per entry) briefly and cleans up; the pure parts
(the SYN generator's configuration, the DPDK table's size from its structures) without
a lab. Never a speed assertion."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import pytest

from hpclb.lab.nat_bench import (
    CPS_KINDS,
    DPDK_MEMORY_SIZES,
    dpdk_conn_bytes,
    write_syn_config,
)


class _FakeLab:
    def mac(self, role: str) -> str:
        return {"lb": "02:48:4c:00:00:03", "cli": "02:48:4c:00:00:02"}[role]


def test_syn_config_every_frame_a_new_connection(tmp_path: Path) -> None:
    text = write_syn_config(_FakeLab(), tmp_path / "syn.cfg").read_text()
    assert "da=02:48:4c:00:00:03, sa=02:48:4c:00:00:02" in text
    assert "da=198.18.1.10" in text and "dp=8080" in text and "syn)" in text
    assert "sp=dinc(1024, 65535)" in text and "sa[3]=dinc(1, 254)" in text


def test_dpdk_table_bytes_from_the_structures() -> None:
    small, big = DPDK_MEMORY_SIZES
    one = {n: sum(dpdk_conn_bytes(n).values()) for n in (small, big)}
    # Power-of-two capacities: every part scales with the capacity.
    assert (one[big] - one[small]) / (big - small) == 141
    parts = dpdk_conn_bytes(big)
    assert parts["slots"] == 64 * big and parts["fifo"] == 16 * big
    assert parts["retired"] == 0
    # Several workers: headroom slots, the retired list, ext_bkt_to_free.
    shared = dpdk_conn_bytes(big, workers=2)
    assert shared["retired"] > 0 and shared["slots"] == 64 * (big + 2 * 4096)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root (network namespaces)")
def test_nat_bench_every_phase_briefly(tmp_path: Path) -> None:
    from hpclb.host import install
    from hpclb.lab.kernel_nat import nft_missing
    from hpclb.lab.nat_bench import run_nat_bench
    from hpclb.lab.topology import Lab

    for tool in ("trafgen", "conntrack", "bpftool"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (./bootstrap)")
    if (reason := nft_missing()) is not None:
        pytest.skip(reason)
    try:
        for output in ("sink.bpf.o", "pass.bpf.o", "hpclb-xdp"):
            install.find(output)
    except Exception as err:  # the data plane's build is not there
        pytest.skip(f"no data plane build: {err}")
    out, prefix = tmp_path / "bench_nat.json", "n" + secrets.token_hex(3)
    kinds = ("nftables", "xdp", "dsr_xdp")
    assert run_nat_bench(out, seconds=0.5, trials=1, flows=300, ndr_steps=0, kinds=kinds,
                         prefix=prefix, cps_seconds=0.5) == 0
    assert Lab.existing_namespaces(prefix) == []
    report = json.loads(out.read_text())
    assert report["skipped"] == {} and report["connections"]["skipped"] == {}
    assert set(report["median_forwarded_pps"]) == set(kinds)
    # Frames went through each kind (the sink's frame count): the
    # bench ran its path end to end. How fast is the JSON's business.
    for kind, trials in report["trials"].items():
        assert any(t["forwarded_frames"] >= 1 for t in trials), (kind, trials)
    # The SYN flood opened connections and their SYN-ACKs came back, translated.
    cps = report["connections"]["trials"]
    assert set(cps) == {k for k in CPS_KINDS if k in kinds}
    for kind, (t,) in cps.items():
        assert t["opened"] > 0 and t["answered"] > 0, (kind, t)
    assert cps["xdp"][0]["conn_reply"] > 0
    mem = report["memory"]
    assert mem["xdp"]["maps"]["conn_map"]["max_entries"] > 0
    assert mem["xdp"]["bytes_per_entry"] > 16
    assert mem["nftables"]["slab_object_bytes"] is None or mem["nftables"][
        "slab_object_bytes"] > 0
    ratios = report["ratio_to_nftables"]
    assert ratios["median_forwarded"]["xdp"] is not None
    assert report["ratio_nat_to_dsr"]["xdp"]["median_forwarded"] is not None
