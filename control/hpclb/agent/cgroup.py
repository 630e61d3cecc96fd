"""CPU and memory of one cgroup (``hpclb-agent --cgroup PATH``), v1 or v2.

A node that is a job container or a Slurm step has less than the host: its CPU
quota and memory limit. The agent then reports the cgroup's figures, which the
control plane takes as the node's (telemetry.to_node_sample).

* CPU load = CPU time the cgroup used over the interval / (interval x the CPUs its
  quota allows), the number of CPUs when it has no quota. v1: ``cpuacct.usage``
  (ns), ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; v2: ``usage_usec`` of
  ``cpu.stat``, ``cpu.max``.
* Memory used = usage minus inactive page cache (what the kernel drops first, as
  ``free`` leaves cache out), against the limit, or the host's memory when there
  is none. v1: ``memory.usage_in_bytes``, ``total_inactive_file`` of
  ``memory.stat``, ``memory.limit_in_bytes``; v2: ``memory.current``,
  ``inactive_file``, ``memory.max``.

``PATH`` is either a directory (``/sys/fs/cgroup/memory/slurm/job_1``, or a v2
directory) or a cgroup path as ``/proc/PID/cgroup`` shows it (``/slurm/job_1``),
which is looked up under each controller's mount: in v1 the cpu, cpuacct and
memory controllers may be separate hierarchies (as on the project's machines) or
joined (``cpu,cpuacct``); a hybrid host's v1 controllers win over the empty v2 tree.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MOUNTINFO = Path("/proc/self/mountinfo")
#: v1 reports "no limit" as PAGE_COUNTER_MAX pages (0x7FFFFFFFFFFFF000 with 4 KiB
#: pages); anything this large is no limit on any page size.
_V1_UNLIMITED = 1 << 62
_CONTROLLERS = ("cpu", "cpuacct", "memory")


class CgroupError(Exception):
    """The cgroup cannot be found or read; the message names the path."""


@dataclass(frozen=True, slots=True)
class CgroupReading:
    """One raw reading; None where the controller is not there for this cgroup."""

    cpu_usage_ns: int | None
    cpu_quota: float | None  # CPUs the quota allows; None = no quota
    mem_used: int | None  # bytes, inactive page cache left out
    mem_limit: int | None  # bytes; None = no limit


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as err:
        raise CgroupError(f"cannot read {path}: {err.strerror or err}") from None


def _read_int(path: Path) -> int:
    text = _read(path).strip()
    try:
        return int(text)
    except ValueError:
        raise CgroupError(f"{path}: expected a number, got {text[:40]!r}") from None


def _stat_field(path: Path, key: str) -> int:
    """A ``key value`` line of a stat file (cpu.stat, memory.stat); 0 if absent."""
    for line in _read(path).splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                raise CgroupError(f"{path}: bad {key} value {value!r}") from None
    return 0


class CgroupV1:
    """A v1 cgroup: one directory per controller (any may be None: not mounted)."""

    version = 1

    def __init__(self, path: str, cpuacct: Path | None, cpu: Path | None,
                 memory: Path | None) -> None:
        self.path = path
        self.cpuacct, self.cpu, self.memory = cpuacct, cpu, memory

    def read(self) -> CgroupReading:
        usage = quota = used = limit = None
        if self.cpuacct is not None:
            usage = _read_int(self.cpuacct / "cpuacct.usage")
        if self.cpu is not None:
            q = _read_int(self.cpu / "cpu.cfs_quota_us")
            period = _read_int(self.cpu / "cpu.cfs_period_us")
            quota = q / period if q > 0 and period > 0 else None  # -1: no quota
        if self.memory is not None:
            usage_b = _read_int(self.memory / "memory.usage_in_bytes")
            inactive = _stat_field(self.memory / "memory.stat", "total_inactive_file")
            used = max(usage_b - inactive, 0)
            lim = _read_int(self.memory / "memory.limit_in_bytes")
            limit = lim if lim < _V1_UNLIMITED else None
        return CgroupReading(usage, quota, used, limit)


class CgroupV2:
    """A v2 cgroup directory. usage_usec is always there (core accounting); cpu.max
    and the memory files only where those controllers are enabled for it."""

    version = 2

    def __init__(self, path: str, directory: Path) -> None:
        self.path = path
        self.dir = directory

    def read(self) -> CgroupReading:
        usage = _stat_field(self.dir / "cpu.stat", "usage_usec") * 1000
        quota = None
        cpu_max = self.dir / "cpu.max"
        if cpu_max.exists():
            fields = _read(cpu_max).split()
            if len(fields) != 2:
                raise CgroupError(f"{cpu_max}: expected 'QUOTA PERIOD', got {fields}")
            if fields[0] != "max":
                try:
                    quota = int(fields[0]) / int(fields[1])
                except (ValueError, ZeroDivisionError):
                    raise CgroupError(f"{cpu_max}: bad value {fields}") from None
        used = limit = None
        if (self.dir / "memory.current").exists():
            current = _read_int(self.dir / "memory.current")
            used = max(current - _stat_field(self.dir / "memory.stat", "inactive_file"), 0)
            text = _read(self.dir / "memory.max").strip()
            if text != "max":
                try:
                    limit = int(text)
                except ValueError:
                    raise CgroupError(f"{self.dir / 'memory.max'}: bad value {text!r}"
                                      ) from None
        return CgroupReading(usage, quota, used, limit)


Cgroup = CgroupV1 | CgroupV2


# --- finding a cgroup --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CgroupMount:
    root: PurePosixPath  # the hierarchy's path that is mounted (not / in a container)
    mount_point: Path
    version: int
    controllers: frozenset[str]  # v1 only


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    return field.encode().decode("unicode_escape") if "\\" in field else field


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The cgroup mounts of a /proc/PID/mountinfo."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        fstype, options = rf[0], set(rf[2].split(","))
        if fstype == "cgroup2":
            mounts.append(CgroupMount(PurePosixPath(_unescape(lf[3])), Path(_unescape(lf[4])),
                                      2, frozenset()))
        elif fstype == "cgroup":
            mounts.append(CgroupMount(PurePosixPath(_unescape(lf[3])), Path(_unescape(lf[4])),
                                      1, frozenset(options & set(_CONTROLLERS))))
    return mounts


def _under(mount: CgroupMount, rel: PurePosixPath) -> Path | None:
    """Where cgroup ``rel`` (from the hierarchy's root) is in this mount, if there."""
    try:
        inner = rel.relative_to(mount.root)
    except ValueError:
        return None  # outside the part of the hierarchy this mount shows
    d = mount.mount_point / inner
    return d if d.is_dir() else None


def _relative_spec(spec: str) -> PurePosixPath:
    rel = PurePosixPath("/") / spec.strip("/")
    if ".." in rel.parts:
        raise CgroupError(f"cgroup path {spec!r} may not contain '..'")
    return rel


def _v1_from(rel: PurePosixPath, mounts: list[CgroupMount], spec: str) -> CgroupV1 | None:
    dirs: dict[str, Path | None] = {}
    for c in _CONTROLLERS:
        dirs[c] = next((d for m in mounts if m.version == 1 and c in m.controllers
                        if (d := _under(m, rel)) is not None), None)
    if not any(dirs.values()):
        return None
    return CgroupV1(spec, dirs["cpuacct"], dirs["cpu"], dirs["memory"])


def find_cgroup(spec: str, mountinfo: Path = MOUNTINFO) -> Cgroup:
    """The cgroup named by ``spec`` (a directory or a cgroup path); CgroupError if
    it is nowhere to be found."""
    try:
        mounts = parse_mountinfo(mountinfo.read_text())
    except OSError as err:
        raise CgroupError(f"cannot read {mountinfo}: {err.strerror or err}") from None
    p = Path(spec)
    if p.is_absolute() and p.is_dir():
        if (p / "cgroup.controllers").exists():
            return CgroupV2(spec, p)
        # A v1 directory of one controller: the same cgroup in the other hierarchies.
        for m in sorted(mounts, key=lambda m: len(m.mount_point.parts), reverse=True):
            if m.version == 1 and p.is_relative_to(m.mount_point):
                rel = m.root / p.relative_to(m.mount_point)
                found = _v1_from(PurePosixPath(rel), mounts, spec)
                if found is not None:
                    return found
        # Not under a cgroup mount: a copy of cgroup files (tests, a chroot).
        has = {name for name in ("cpuacct.usage", "cpu.cfs_quota_us", "memory.usage_in_bytes")
               if (p / name).exists()}
        if has:
            return CgroupV1(spec, p if "cpuacct.usage" in has else None,
                            p if "cpu.cfs_quota_us" in has else None,
                            p if "memory.usage_in_bytes" in has else None)
        raise CgroupError(f"{spec} is a directory but not a cgroup")
    rel = _relative_spec(spec)
    found = _v1_from(rel, mounts, spec)
    if found is not None:
        return found
    for m in mounts:
        if m.version == 2 and (d := _under(m, rel)) is not None:
            return CgroupV2(spec, d)
    where = ", ".join(str(m.mount_point) for m in mounts) or "no cgroup mounts"
    raise CgroupError(f"cgroup {spec!r} not found (looked under {where})")


# --- turning readings into loads -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class CgroupLoad:
    """What the agent reports for the cgroup (telemetry.CgroupStats's figures)."""

    cpu_load: float | None  # 0..1 of the quota
    cpu_limit: float | None  # CPUs allowed
    mem_used: int | None
    mem_limit: int | None  # bytes; the host's memory when unlimited


class CgroupMeter:
    """CPU load of a cgroup since the previous :meth:`sample`, and its memory."""

    def __init__(self, cgroup: Cgroup, host_mem_total: int, cpus: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cgroup = cgroup
        self._host_mem = host_mem_total
        self._cpus = cpus or os.cpu_count() or 1
        self._clock = clock
        self._last = cgroup.read()
        self._last_t = clock()
        self._load: float | None = None
        #: The unclamped load of the last sample (for tests and debugging).
        self.last_raw: float | None = None

    def raw_cpu_load(self, before: CgroupReading, after: CgroupReading,
                     seconds: float) -> float | None:
        """Unclamped CPU load between two readings ``seconds`` apart."""
        if before.cpu_usage_ns is None or after.cpu_usage_ns is None or seconds <= 0:
            return None
        allowed = after.cpu_quota if after.cpu_quota is not None else self._cpus
        used = after.cpu_usage_ns - before.cpu_usage_ns
        return used / (seconds * 1e9 * allowed)

    def sample(self) -> CgroupLoad:
        now = self.cgroup.read()
        t = self._clock()
        raw = self.raw_cpu_load(self._last, now, t - self._last_t)
        if raw is not None:
            self.last_raw = raw
            # A cgroup at its quota measures a few percent above or below 1: CFS
            # enforces the quota per period, and our interval does not line up
            # with its periods. Above 1 is saturated, not garbage, so clamp it
            # rather than have the control plane reject a busy node's figure.
            self._load = min(max(raw, 0.0), 1.0)
            self._last, self._last_t = now, t
        allowed = now.cpu_quota if now.cpu_quota is not None else float(self._cpus)
        if now.cpu_usage_ns is None:
            allowed = None
        limit = now.mem_limit
        if now.mem_used is not None:
            # No limit, or one above the RAM there is: the host's memory is the limit.
            limit = self._host_mem if limit is None else min(limit, self._host_mem)
        return CgroupLoad(self._load, allowed, now.mem_used, limit)
