"""hpclb-dpdk's cost-measurement options (--bench-frames, --bench) and the
pure parts of hpclb.lab.dpdk_cost: the frames, the command line, the limits."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.utils import rdpcap

from hpclb.dataplane.dpdk import find_dpdk_forwarder
from hpclb.lab import dpdk_cost


def _run(*forwarder_args: str) -> subprocess.CompletedProcess[str]:
    """The forwarder with EAL options that are never reached: its own options
    are parsed first, and a bad one ends it with status 2."""
    return subprocess.run([find_dpdk_forwarder(), "--no-huge", "--", "--port", "net_ring0",
                           *forwarder_args], capture_output=True, text=True, timeout=30,
                          check=False)


def test_bench_needs_bench_frames() -> None:
    r = _run("--bench", "macswap")
    assert r.returncode == 2 and "--bench needs --bench-frames" in r.stderr


def test_bench_mode_must_be_known() -> None:
    r = _run("--bench-frames", "/nonexistent.pcap", "--bench", "fast")
    assert r.returncode == 2 and "--bench must be macswap or forget-flows" in r.stderr


def test_usage_lists_the_bench_options() -> None:
    r = subprocess.run([find_dpdk_forwarder(), "--", "--help"], capture_output=True, text=True,
                       timeout=30, check=False)
    assert r.returncode == 0
    assert "--bench-frames PCAP" in r.stdout and "forget-flows" in r.stdout


def test_frames_are_64_byte_udp_with_distinct_tuples(tmp_path: Path) -> None:
    frames = dpdk_cost.udp_frames(dpdk_cost.VIP, 300)
    assert len(frames) == 300 and {len(f) for f in frames} == {60}
    pkts = rdpcap(str(dpdk_cost.write_pcap(tmp_path / "f.pcap", frames)))
    tuples = {(p[IP].src, p[UDP].sport) for p in pkts}
    assert len(tuples) == 300
    assert all(p[IP].dst == dpdk_cost.VIP and p[UDP].dport == dpdk_cost.VIP_PORT
               and p[Ether].type == 0x0800 for p in pkts)


def test_forwarder_argv_feeds_a_ring_port(tmp_path: Path) -> None:
    argv = dpdk_cost.forwarder_argv("/bin/hpclb-dpdk", tmp_path / "f.pcap", "ipc://x", "p",
                                    1024, "forget-flows", (0, 1), 256)
    eal, ours = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert eal[eal.index("--vdev") + 1] == "net_ring0" and eal[eal.index("-l") + 1] == "0,1"
    assert ours[ours.index("--port") + 1] == "net_ring0"
    assert ours[ours.index("--bench-frames") + 1] == str(tmp_path / "f.pcap")
    assert ours[ours.index("--bench") + 1] == "forget-flows"
    assert ours[ours.index("--idle-sleep-us") + 1] == "0"


def test_new_flows_must_outnumber_half_the_table() -> None:
    with pytest.raises(ValueError, match="half the flow table"):
        dpdk_cost.measure_dpdk_cost(flow_table_size=1024, new_flows=512)
    with pytest.raises(ValueError, match="at most"):
        dpdk_cost.measure_dpdk_cost(flow_table_size=4096, new_flows=4000)
    with pytest.raises(ValueError, match="cases"):
        dpdk_cost.measure_dpdk_cost(cases=("warp",))
