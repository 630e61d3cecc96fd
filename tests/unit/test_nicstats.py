"""host/nicstats.py on real netlink and ethtool, in scratch namespaces (root),
and host/procinfo.py on the real /proc and on files of the test's own."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclb.host import procinfo
from hpclb.host.nicstats import ETHTOOL_PREFIX, NetlinkNicStats, NicStatsSource

from .exception_ns import appliance_and_client, veth_netns

root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces")


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[str, str]]:
    """An 'appliance' namespace (10.77.0.1 on d0) and a 'client' one (10.77.0.2
    on d1) joined by a veth pair; deleted even when a test fails."""
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces")
    with appliance_and_client("nicstats", "10.77.0.1/24", "10.77.0.2/24") as names:
        yield names


@root
def test_counters_move_with_traffic(pair: tuple[str, str]) -> None:
    app, cli = pair
    source: NicStatsSource = NetlinkNicStats(app)
    before = source(["d0"])["d0"]
    subprocess.run(["ip", "netns", "exec", cli, "ping", "-q", "-c", "5", "-i", "0.05", "-W", "2",
                    "10.77.0.1"], check=True, capture_output=True)
    after = source(["d0"])["d0"]
    # 5 echo requests in, 5 replies out (ARP may add one each way)
    assert after["rx_packets"] - before["rx_packets"] >= 5
    assert after["tx_packets"] - before["tx_packets"] >= 5
    for name in ("rx_errors", "rx_dropped", "rx_missed_errors", "rx_crc_errors", "tx_errors"):
        assert after[name] == 0, name
    # veth's driver statistics, under their own prefix
    assert after[f"{ETHTOOL_PREFIX}peer_ifindex"] > 0
    assert any(k.startswith(f"{ETHTOOL_PREFIX}rx_queue_0_") for k in after)


@root
def test_names_are_read_in_the_namespace_asked(pair: tuple[str, str]) -> None:
    app, cli = pair
    # d0 lives in app only; d1 in cli only; an unknown name is left out, not an error
    assert set(NetlinkNicStats(app)(["d0", "d1", "nosuch0"])) == {"d0"}
    assert set(NetlinkNicStats(cli)(["d0", "d1"])) == {"d1"}


@root
def test_a_driver_without_ethtool_statistics() -> None:
    with veth_netns("nicstats-lo") as ns:
        got = NetlinkNicStats(ns)(["lo", "d0"])
    # loopback has link statistics but no ethtool ones: read what exists
    assert "rx_packets" in got["lo"]
    assert not any(k.startswith(ETHTOOL_PREFIX) for k in got["lo"])
    assert any(k.startswith(ETHTOOL_PREFIX) for k in got["d0"])


@root
def test_the_callers_own_namespace() -> None:
    got = NetlinkNicStats(None)(["lo"])
    assert got["lo"]["rx_packets"] >= 0


# ---- procinfo ----------------------------------------------------------------------

def test_own_resident_memory() -> None:
    rss = procinfo.rss_bytes()
    assert rss is not None and rss > 1 << 20  # a Python process holds more than 1 MiB
    assert procinfo.rss_bytes(os.getpid()) is not None
    assert procinfo.hugetlb_bytes() in (0, None)  # pytest maps no hugetlb pages


def test_a_process_that_is_gone() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert procinfo.rss_bytes(proc.pid) is None
    assert procinfo.rss_bytes(1, proc=Path("/nonexistent")) is None


def test_hugepages_of_this_host() -> None:
    hp = procinfo.hugepages()
    if hp is None:
        pytest.skip("this kernel has no hugepage support (no Hugepagesize in /proc/meminfo)")
    assert hp.default_size_kb > 0
    for size, p in hp.pools.items():
        assert p.size_kb == size and 0 <= p.free <= p.total


def fake_tree(tmp: Path) -> tuple[Path, Path]:
    proc, sysfs = tmp / "proc", tmp / "hugepages"
    (proc / "77").mkdir(parents=True)
    (proc / "meminfo").write_text(
        "MemTotal:       16000000 kB\nHugePages_Total:     512\nHugePages_Free:      100\n"
        "HugePages_Rsvd:        3\nHugePages_Surp:        0\nHugepagesize:       2048 kB\n")
    (proc / "77" / "status").write_text(
        "Name:\thpclb-dpdk\nVmRSS:\t   40960 kB\nHugetlbPages:\t  823296 kB\n")
    for size, nr, free in (("2048", 512, 100), ("1048576", 1, 1)):
        d = sysfs / f"hugepages-{size}kB"
        d.mkdir(parents=True)
        for name, value in (("nr_hugepages", nr), ("free_hugepages", free),
                            ("resv_hugepages", 3 if size == "2048" else 0),
                            ("surplus_hugepages", 0)):
            (d / name).write_text(f"{value}\n")
    (sysfs / "not-a-pool").mkdir()
    return proc, sysfs


def test_hugepages_and_process_memory_from_files(tmp_path: Path) -> None:
    proc, sysfs = fake_tree(tmp_path)
    hp = procinfo.hugepages(proc, sysfs)
    assert hp is not None
    assert (hp.total, hp.free, hp.reserved, hp.default_size_kb) == (512, 100, 3, 2048)
    assert set(hp.pools) == {2048, 1048576}
    assert hp.total_bytes == 512 * 2 * (1 << 20) + (1 << 30)
    assert hp.free_bytes == 100 * 2 * (1 << 20) + (1 << 30)
    assert hp.as_dict()["pools"]["2048"] == {"total": 512, "free": 100, "reserved": 3,
                                             "surplus": 0}
    assert procinfo.rss_bytes(77, proc) == 40960 * 1024
    assert procinfo.hugetlb_bytes(77, proc) == 823296 * 1024


def test_no_hugepage_support(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal:       16000000 kB\n")
    assert procinfo.hugepages(tmp_path, tmp_path / "absent") is None
