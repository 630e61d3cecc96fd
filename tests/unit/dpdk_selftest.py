"""Builds and runs a C self-test of the DPDK forwarder's tables against
Debian's DPDK, under a small EAL without hugepages (one lcore, no PCI, no
shared config, no telemetry)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent


def run_dpdk_selftest(tmp_path: Path, name: str, sources: list[str]) -> None:
    """Compiles tests/unit/NAME.c with the forwarder's SOURCES (paths under
    dataplane/dpdk/) at -Werror, runs it, and asserts it said "NAME: ok"."""
    cc = shutil.which("cc")
    pkg = subprocess.run(["pkg-config", "--cflags", "--libs", "libdpdk"], capture_output=True,
                         text=True, check=False)
    if cc is None or pkg.returncode != 0:
        pytest.fail(f"needs a C compiler and libdpdk-dev (./bootstrap): {pkg.stderr}")
    exe = tmp_path / name
    build = subprocess.run(
        [cc, "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-std=gnu11",
         f"-I{REPO / 'dataplane/common'}", f"-I{REPO / 'dataplane/dpdk'}", "-o", str(exe),
         str(HERE / f"{name}.c"), *(str(REPO / "dataplane/dpdk" / s) for s in sources),
         *pkg.stdout.split()],
        capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe), "--no-huge", "-m", "64", "--no-pci", "--no-shconf",
                          "--no-telemetry", "--log-level", "error", "-l", "0"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{name}: ok" in run.stdout, run.stdout
