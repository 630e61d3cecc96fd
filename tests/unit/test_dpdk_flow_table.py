"""The DPDK forwarder's per-worker flow-affinity table (fwd_flow.c) on a real
rte_hash, through tests/unit/flow_selftest.c: lookups, expiry, eviction when
full. Built against Debian's DPDK; runs under a small EAL without hugepages."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_flow_table_pins_expires_and_evicts(tmp_path: Path) -> None:
    cc = shutil.which("cc")
    pkg = subprocess.run(["pkg-config", "--cflags", "--libs", "libdpdk"], capture_output=True,
                         text=True, check=False)
    if cc is None or pkg.returncode != 0:
        pytest.fail(f"needs a C compiler and libdpdk-dev (./bootstrap): {pkg.stderr}")
    exe = tmp_path / "flow_selftest"
    build = subprocess.run(
        [cc, "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-std=gnu11",
         f"-I{REPO / 'dataplane/common'}", f"-I{REPO / 'dataplane/dpdk'}", "-o", str(exe),
         str(Path(__file__).with_name("flow_selftest.c")), str(REPO / "dataplane/dpdk/fwd_flow.c"),
         *pkg.stdout.split()],
        capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe), "--no-huge", "-m", "64", "--no-pci", "--no-shconf",
                          "--no-telemetry", "--log-level", "error", "-l", "0"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "flow_selftest: ok" in run.stdout, run.stdout
