"""Shared helpers of the provisioning tests: a fake /sys, a tree snapshot,
the CLI run in-process with its report captured."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpclb.provision import cli

REPO = Path(__file__).resolve().parents[2]
#: The seams that make a rendered configuration the same on every run.
HASH_KEY = "0123456789abcdef0123456789abcdef"
NAME = "gw-golden"


@dataclass
class Result:
    rc: int
    lines: list[str]
    err: str

    @property
    def summary(self) -> str:
        return self.lines[-1] if self.lines else ""


@pytest.fixture
def provision(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Run ``python -m hpclb.provision ARGS`` in-process; returns a Result."""
    monkeypatch.setenv("HPCLB_PROVISION_TEST_HASH_KEY", HASH_KEY)
    monkeypatch.delenv("SSH_CONNECTION", raising=False)

    def run(*args: str) -> Result:
        lines: list[str] = []
        capsys.readouterr()
        rc = cli.main([*args, "--src", str(REPO)], out=lines.append)
        return Result(rc, lines, capsys.readouterr().err)

    return run


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: type, mode, owner, and the content's hash
    (files) or the target (links). Times are left out."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                what: str = "-> " + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                what = "dir"
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid,
                        st.st_gid, what)
    return out


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def make_sysfs(base: Path) -> Path:
    """A two-socket host: CPUs 0-3 on node 0, 4-7 on node 1; PCI NICs ens1f0,
    ens1f1 (node 0) and ens2f0 (node 1), each in its own IOMMU group; vfio-pci
    loaded; no hugepages reserved yet."""
    sysfs = base / "sys"
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        d = sysfs / f"devices/system/node/node{node}"
        _write(d / "cpulist", cpus + "\n")
        pool = d / "hugepages/hugepages-2048kB"
        _write(pool / "nr_hugepages", "0\n")
        _write(pool / "free_hugepages", "0\n")
    _write(sysfs / "devices/system/cpu/online", "0-7\n")
    for cpu in range(8):
        _write(sysfs / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list",
               f"{cpu}\n")
    pool = sysfs / "kernel/mm/hugepages/hugepages-2048kB"
    _write(pool / "nr_hugepages", "0\n")
    _write(pool / "free_hugepages", "0\n")
    (sysfs / "module/vfio_pci").mkdir(parents=True)
    (sysfs / "bus/pci/drivers/ice").mkdir(parents=True)
    for group, (pci, netdev, node) in enumerate((("0000:3b:00.0", "ens1f0", 0),
                                                 ("0000:3b:00.1", "ens1f1", 0),
                                                 ("0000:af:00.0", "ens2f0", 1)), start=10):
        dev = sysfs / "devices/pci0000:00" / pci
        _write(dev / "class", "0x020000\n")
        _write(dev / "numa_node", f"{node}\n")
        (dev / "net" / netdev).mkdir(parents=True)
        (sysfs / f"kernel/iommu_groups/{group}").mkdir(parents=True)
        os.symlink(sysfs / f"kernel/iommu_groups/{group}", dev / "iommu_group")
        os.symlink(sysfs / "bus/pci/drivers/ice", dev / "driver")
        (sysfs / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
        os.symlink(dev, sysfs / "bus/pci/devices" / pci)
        (sysfs / "class/net").mkdir(parents=True, exist_ok=True)
        os.symlink(dev / "net" / netdev, sysfs / "class/net" / netdev)
        os.symlink(dev, dev / "net" / netdev / "device")
    return sysfs


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return make_sysfs(tmp_path / "fake")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r
