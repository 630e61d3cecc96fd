"""The DPDK forwarder's per-frame decisions (fwd_packet.c) through
tests/unit/packet_selftest.c, where the wire cannot reach: tunnel mode with
too little headroom, Neighbor Advertisements that need tailroom or come out
shorter than the solicitation, IPv6 flows pinned and the IPv6 verdicts that
go to the kernel. Built against Debian's DPDK; runs under a small EAL without
hugepages. The wire-level checks are test_dpdk_forwarder.py's."""

from __future__ import annotations

from pathlib import Path

from .dpdk_selftest import run_dpdk_selftest


def test_packet_decisions_within_the_frames_room(tmp_path: Path) -> None:
    run_dpdk_selftest(tmp_path, "packet_selftest",
                      ["fwd_packet.c", "fwd_tables.c", "fwd_flow.c", "fwd_conn.c"])
