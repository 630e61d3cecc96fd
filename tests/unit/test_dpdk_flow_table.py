"""The DPDK forwarder's per-worker flow-affinity table (fwd_flow.c) on a real
rte_hash, through tests/unit/flow_selftest.c: lookups, expiry, eviction when
full. Built against Debian's DPDK; runs under a small EAL without hugepages."""

from __future__ import annotations

from pathlib import Path

from .dpdk_selftest import run_dpdk_selftest


def test_flow_table_pins_expires_and_evicts(tmp_path: Path) -> None:
    run_dpdk_selftest(tmp_path, "flow_selftest", ["fwd_flow.c"])
