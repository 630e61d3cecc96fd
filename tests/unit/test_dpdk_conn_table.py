"""The DPDK forwarder's NAT connection table (fwd_conn.c) on a real rte_hash,
through tests/unit/conn_selftest.c: exact capacity, FIFO eviction of the
oldest embryonic connection (never an established one), expiry by state
timeout, SNAT port probing, the figures, and deferred reuse with several
workers. Built against Debian's DPDK; runs under a small EAL without
hugepages."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclb.contract.tables import CONN_TABLE_MAX, CONN_TABLE_MIN
from hpclb.dataplane.dpdk import DpdkLaunch, DpdkPort, forwarder_argv

from .dpdk_selftest import run_dpdk_selftest


def test_conn_table_capacity_eviction_expiry(tmp_path: Path) -> None:
    run_dpdk_selftest(tmp_path, "conn_selftest", ["fwd_conn.c"])


def _launch(**kw: object) -> DpdkLaunch:
    return DpdkLaunch(ports=(DpdkPort(0, "af_xdp", iface="eth0"),), socket="ipc:///s",
                      binary="/opt/hpclb-dpdk", **kw)


def test_the_launch_passes_the_table_size_only_when_set() -> None:
    argv = forwarder_argv(_launch(conn_table_size=1024))
    assert argv[-2:] == ["--conn-table-size", "1024"]
    assert argv.index("--conn-table-size") > argv.index("--")  # the forwarder's, not the EAL's
    assert "--conn-table-size" not in forwarder_argv(_launch())  # the forwarder's default


@pytest.mark.parametrize("size", [CONN_TABLE_MIN - 2, CONN_TABLE_MAX + 2, 1025])
def test_the_launch_refuses_a_table_the_forwarder_would(size: int) -> None:
    with pytest.raises(ValueError, match="conn_table_size must be an even number"):
        _launch(conn_table_size=size)
