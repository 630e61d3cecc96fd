"""Hugepages and a process's memory, from /proc and /sys.

Every reader takes its root as a parameter so a test can point it at files of
its own; every reader answers None (or leaves a figure out) instead of raising
when the kernel does not have the file: a missing figure is not a fault here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
HUGEPAGES_SYSFS = Path("/sys/kernel/mm/hugepages")

_SIZE_DIR = re.compile(r"^hugepages-(\d+)kB$")


@dataclass(frozen=True)
class HugepagePool:
    """One page size's pool (/sys/kernel/mm/hugepages/hugepages-<size>kB)."""

    size_kb: int
    total: int  # nr_hugepages (+ surplus)
    free: int
    reserved: int = 0  # promised to a mapping, not yet faulted in
    surplus: int = 0

    @property
    def total_bytes(self) -> int:
        return self.total * self.size_kb * 1024

    @property
    def free_bytes(self) -> int:
        return self.free * self.size_kb * 1024


@dataclass(frozen=True)
class Hugepages:
    """/proc/meminfo's HugePages_* (default page size) and every size's pool."""

    default_size_kb: int
    total: int
    free: int
    reserved: int
    surplus: int
    pools: dict[int, HugepagePool] = field(default_factory=dict)  # by size in kB

    @property
    def total_bytes(self) -> int:
        return sum(p.total_bytes for p in self.pools.values()) if self.pools else \
            self.total * self.default_size_kb * 1024

    @property
    def free_bytes(self) -> int:
        return sum(p.free_bytes for p in self.pools.values()) if self.pools else \
            self.free * self.default_size_kb * 1024

    def as_dict(self) -> dict[str, object]:
        return {"default_size_kb": self.default_size_kb, "total": self.total,
                "free": self.free, "reserved": self.reserved, "surplus": self.surplus,
                "total_bytes": self.total_bytes, "free_bytes": self.free_bytes,
                "pools": {str(s): {"total": p.total, "free": p.free, "reserved": p.reserved,
                                   "surplus": p.surplus}
                          for s, p in sorted(self.pools.items())}}


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _fields(path: Path) -> dict[str, str]:
    """"Key:   value unit" lines (/proc/meminfo, /proc/PID/status) as {key: "value unit"}."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _kb(value: str | None) -> int | None:
    """ "1234 kB" -> 1234; a bare count stays as it is."""
    if not value:
        return None
    try:
        return int(value.split()[0])
    except (ValueError, IndexError):
        return None


def hugepages(proc: Path = PROC, sysfs: Path = HUGEPAGES_SYSFS) -> Hugepages | None:
    """The hugepage pools; None when the kernel has no hugepage support."""
    info = _fields(proc / "meminfo")
    size = _kb(info.get("Hugepagesize"))
    if size is None:
        return None
    pools: dict[int, HugepagePool] = {}
    try:
        dirs = sorted(sysfs.iterdir())
    except OSError:
        dirs = []
    for d in dirs:
        m = _SIZE_DIR.match(d.name)
        if not m:
            continue
        nr, free = _read_int(d / "nr_hugepages"), _read_int(d / "free_hugepages")
        if nr is None or free is None:
            continue
        surplus = _read_int(d / "surplus_hugepages") or 0
        pools[int(m[1])] = HugepagePool(size_kb=int(m[1]), total=nr + surplus, free=free,
                                        reserved=_read_int(d / "resv_hugepages") or 0,
                                        surplus=surplus)
    return Hugepages(default_size_kb=size, total=_kb(info.get("HugePages_Total")) or 0,
                     free=_kb(info.get("HugePages_Free")) or 0,
                     reserved=_kb(info.get("HugePages_Rsvd")) or 0,
                     surplus=_kb(info.get("HugePages_Surp")) or 0, pools=pools)


def rss_bytes(pid: int | str = "self", proc: Path = PROC) -> int | None:
    """A process's resident memory (VmRSS; hugetlb pages are not in it); None
    when the process is gone or has no address space (a kernel thread)."""
    kb = _kb(_fields(proc / str(pid) / "status").get("VmRSS"))
    return None if kb is None else kb * 1024


def hugetlb_bytes(pid: int | str = "self", proc: Path = PROC) -> int | None:
    """The hugetlb pages a process maps (HugetlbPages, Linux >= 4.4): what a
    DPDK process holds and gives back when it exits."""
    kb = _kb(_fields(proc / str(pid) / "status").get("HugetlbPages"))
    return None if kb is None else kb * 1024
