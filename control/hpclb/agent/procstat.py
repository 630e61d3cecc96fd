"""Host CPU load and memory, read the way ``mpstat 1`` and ``free`` read them.

* CPU load over an interval is ``1 - (idle + iowait) / total`` of the ``cpu`` line
  deltas of ``/proc/stat`` (the classic ``1 - idle/100``; iowait is idle
  time spent waiting, which mpstat shows apart but which a new job could use).
* Memory used is ``MemTotal - MemAvailable`` of ``/proc/meminfo`` (what ``free``
  of procps-ng 4 prints as used): page cache the kernel can drop is not "used".
* Per NUMA node, ``/sys/devices/system/node/node*/meminfo``; the kernel keeps no
  MemAvailable per node, so used there is ``MemTotal - MemFree - FilePages -
  SReclaimable`` (the same idea: what can be reclaimed is not counted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
PROC_MEMINFO = Path("/proc/meminfo")
SYS_NODES = Path("/sys/devices/system/node")


class ProcError(Exception):
    """A /proc or /sys file is missing or not in the expected format."""


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Cumulative CPU time of all CPUs, in clock ticks."""

    busy: int
    total: int


def parse_proc_stat(text: str) -> CpuTimes:
    """The aggregate ``cpu`` line of /proc/stat."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            try:
                ticks = [int(f) for f in fields[1:11]]
            except ValueError:
                raise ProcError(f"/proc/stat: bad cpu line {line!r}") from None
            if len(ticks) < 4:
                raise ProcError(f"/proc/stat: short cpu line {line!r}")
            ticks += [0] * (10 - len(ticks))  # older kernels have fewer columns
            user, nice, system, idle, iowait, irq, softirq, steal, _guest, _guest_nice = ticks
            # guest and guest_nice are already inside user and nice: adding them
            # would count a VM's time twice (mpstat leaves them out of the total too).
            total = user + nice + system + idle + iowait + irq + softirq + steal
            return CpuTimes(busy=total - idle - iowait, total=total)
    raise ProcError("/proc/stat has no cpu line")


def read_cpu_times(path: Path = PROC_STAT) -> CpuTimes:
    try:
        return parse_proc_stat(path.read_text())
    except OSError as err:
        raise ProcError(f"cannot read {path}: {err}") from None


def cpu_load(before: CpuTimes, after: CpuTimes) -> float | None:
    """Busy share of the time between two readings, 0..1; None when no tick passed."""
    elapsed = after.total - before.total
    if elapsed <= 0:
        return None
    # Clamped because iowait is known to go backwards on tickless kernels, which
    # can push a delta a tick outside 0..elapsed.
    return min(max((after.busy - before.busy) / elapsed, 0.0), 1.0)


class CpuLoadMeter:
    """Host CPU load since the previous :meth:`sample` (the first since creation)."""

    def __init__(self, path: Path = PROC_STAT) -> None:
        self._path = path
        self._last = read_cpu_times(path)
        self._load = 0.0

    def sample(self) -> float:
        now = read_cpu_times(self._path)
        load = cpu_load(self._last, now)
        if load is not None:  # no tick passed: keep the previous figure
            self._last = now
            self._load = load
        return self._load


def parse_meminfo(text: str) -> dict[str, int]:
    """``Key: value kB`` lines (both /proc/meminfo and a node's meminfo, whose lines
    start with ``Node N``) as a dict of bytes; lines without kB are plain counts."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^(?:Node\s+\d+\s+)?([\w()]+):\s+(\d+)(\s+kB)?\s*$", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def memory_used_total(info: dict[str, int]) -> tuple[int, int]:
    """(used, total) bytes from /proc/meminfo fields, as ``free`` computes them."""
    try:
        total = info["MemTotal"]
    except KeyError:
        raise ProcError("meminfo has no MemTotal") from None
    available = info.get("MemAvailable")
    if available is None:  # kernels before 3.14: free's own fallback
        available = info.get("MemFree", 0) + info.get("Buffers", 0) + info.get("Cached", 0)
    return max(total - available, 0), total


def read_memory(path: Path = PROC_MEMINFO) -> tuple[int, int]:
    """(used, total) bytes of the host."""
    try:
        return memory_used_total(parse_meminfo(path.read_text()))
    except OSError as err:
        raise ProcError(f"cannot read {path}: {err}") from None


@dataclass(frozen=True, slots=True)
class NodeMemory:
    node: int
    used: int  # bytes
    total: int  # bytes


def read_numa(root: Path = SYS_NODES) -> list[NodeMemory]:
    """Memory per NUMA node, sorted by node; empty when the kernel has no NUMA
    sysfs (a non-NUMA build), which counts as one node."""
    nodes = []
    for d in root.glob("node[0-9]*"):
        if not d.name[4:].isdigit():
            continue
        try:
            info = parse_meminfo((d / "meminfo").read_text())
        except OSError:
            continue  # a node going offline under us
        total = info.get("MemTotal", 0)
        reclaimable = (info.get("MemFree", 0) + info.get("FilePages", 0)
                       + info.get("SReclaimable", 0))
        nodes.append(NodeMemory(int(d.name[4:]), max(total - reclaimable, 0), total))
    return sorted(nodes, key=lambda n: n.node)
