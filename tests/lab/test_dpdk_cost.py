"""hpclb.lab.dpdk_cost: the DPDK worker's cycles per frame on a memory-fed port
(net_ring fed once with --bench-frames). Behaviour only: the result is well
formed and each case really took its path in the forwarder's counters; no
speed is asserted."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from hpclb.lab import dpdk_cost


def _close(a: int, b: int) -> bool:
    """Two counts of one window read by two telemetry queries, a few ms apart
    while millions of frames a second circulate: within 2% (and a burst)."""
    return abs(a - b) <= 64 + 0.02 * max(a, b)


pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: hugepages for the DPDK EAL"),
]


@pytest.fixture(scope="module")
def result() -> dict:
    return dpdk_cost.measure_dpdk_cost(seconds=0.3, rounds=1, warmup_s=0.3)


def test_every_case_is_measured_and_well_formed(result: dict) -> None:
    assert set(result["cases"]) == set(dpdk_cost.CASES)
    cond = result["conditions"]
    assert cond["lcores"] == {"main": 0, "worker": 1} and cond["frame_bytes"] == 60
    assert cond["flow_table_size"] == 1024 and cond["new_flows"] > cond["flow_table_size"] // 2
    for case, row in result["cases"].items():
        assert row["cycles_per_frame"] > 0 and math.isfinite(row["cycles_per_frame"]), case
        assert row["ns_per_frame"] > 0, case
        assert len(row["runs"]) == 1 and row["runs"][0]["frames"] > 0, case
        assert row["ratio_to_macswap"] > 0, case
        # Full bursts: the loop never runs dry with the frames circulating.
        assert row["runs"][0]["frames_per_busy_loop"] > 1, case
    assert result["cases"]["macswap"]["over_macswap_cycles"] == 0
    json.dumps(result)  # JSON-ready


def test_flow_hit_run_counted_flow_hits(result: dict) -> None:
    run = result["cases"]["flow_hit"]["runs"][0]
    c = run["counters"]
    # Every frame of the timed window was a flow hit forwarded out.
    assert c["flow_hit"] > 0 and c["flow_new"] == 0 and c["flow_evict"] == 0
    assert _close(c["flow_hit"], run["frames"]) and _close(c["fwd_tx"], run["frames"])
    assert c["pass_not_vip"] == 0 and c["drop_no_backend"] == 0


def test_new_flow_run_met_only_new_flows(result: dict) -> None:
    run = result["cases"]["new_flow"]["runs"][0]
    c = run["counters"]
    assert c["flow_new"] > 0 and c["flow_hit"] == 0 and c["flow_evict"] == 0
    assert _close(c["flow_new"], run["frames"])


def test_not_vip_run_passed_to_the_kernel_path(result: dict) -> None:
    run = result["cases"]["not_vip"]["runs"][0]
    c = run["counters"]
    assert c["pass_not_vip"] > 0 and c["flow_hit"] == 0 and c["flow_new"] == 0
    assert _close(c["pass_not_vip"], run["frames"])


def test_macswap_run_never_entered_the_forwarding_path(result: dict) -> None:
    run = result["cases"]["macswap"]["runs"][0]
    assert run["frames"] > 0
    assert all(v == 0 for v in run["counters"].values()), run["counters"]


def test_main_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    assert dpdk_cost.main(["--out", str(out), "--seconds", "0.2", "--rounds", "1"]) == 0
    data = json.loads(out.read_text())
    assert set(data["cases"]) == set(dpdk_cost.CASES)
