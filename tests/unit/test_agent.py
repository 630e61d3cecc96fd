"""The node agent's readers, the adaptive interval and the command line.

Real where the real thing runs here: /proc/stat under busy subprocesses, /proc/meminfo
against ``free``, cgroup v1 (this machine mounts cpu, cpuacct and memory as v1
hierarchies: a real cgroup with a CPU quota and a memory limit holds a busy child),
the v2 tree (mounted here in hybrid mode with no controller enabled, so only its
core CPU accounting is real: cpu.max and the memory files are tested on fixture
directories), and NVML's absence (no GPU here). PMem tools are absent too: their
parsers run on fixture text and a stand-in executable on PATH.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest
import zmq.auth

from hpclb.agent import Collector, IntervalPolicy, adaptive_interval
from hpclb.agent import main as agent_main
from hpclb.agent.cgroup import (
    CgroupError,
    CgroupMeter,
    CgroupV1,
    CgroupV2,
    find_cgroup,
    parse_mountinfo,
)
from hpclb.agent.gpu import NvmlGpus, pci_numa_node, sysfs_pci_address
from hpclb.agent.procstat import (
    CpuLoadMeter,
    CpuTimes,
    cpu_load,
    parse_meminfo,
    parse_proc_stat,
    read_memory,
    read_numa,
)
from hpclb.agent.sources import (
    PmemBandwidth,
    PmemCapacity,
    SourceError,
    available_sources,
    parse_ipmctl_performance,
    run_tool,
)
from hpclb.telemetry.message import decode, encode

MiB = 2**20
CLK_TCK = os.sysconf("SC_CLK_TCK")
IS_ROOT = os.geteuid() == 0


def wait_for(cond: object, timeout: float = 30.0, every: float = 0.05) -> bool:
    """Poll ``cond()`` until true or timeout (generous: the machine is shared)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(every)
    return bool(cond())  # type: ignore[operator]


# --- /proc/stat ---------------------------------------------------------------------

STAT_A = "cpu  100 10 50 800 40 5 5 0 30 0\ncpu0 1 1 1 1 1 1 1 1 0 0\nintr 1\n"
STAT_B = "cpu  200 10 90 900 60 5 5 10 80 0\ncpu0 1 1 1 1 1 1 1 1 0 0\nintr 1\n"


def test_proc_stat_formula_is_mpstats() -> None:
    a, b = parse_proc_stat(STAT_A), parse_proc_stat(STAT_B)
    # total leaves guest out (it is inside user): 100+10+50+800+40+5+5+0 = 1010
    assert a == CpuTimes(busy=1010 - 800 - 40, total=1010)
    # deltas: user 100, system 40, idle 100, iowait 20, steal 10 -> total 270,
    # busy = 270 - idle - iowait = 150
    assert cpu_load(a, b) == pytest.approx(150 / 270)
    assert cpu_load(b, b) is None  # no tick passed
    # iowait going backwards (a known tickless-kernel quirk) stays within 0..1
    back = CpuTimes(busy=a.busy + 20, total=a.total + 10)
    assert cpu_load(a, back) == 1.0


def test_proc_stat_old_kernel_and_garbage() -> None:
    assert parse_proc_stat("cpu 1 2 3 4\n") == CpuTimes(busy=6, total=10)
    from hpclb.agent.procstat import ProcError
    with pytest.raises(ProcError, match="no cpu line"):
        parse_proc_stat("intr 1\n")
    with pytest.raises(ProcError, match="bad cpu line"):
        parse_proc_stat("cpu 1 x 3 4\n")


def _ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


def test_host_cpu_load_rises_under_busy_loops() -> None:
    """One spinner per CPU: the host is at least as busy as the spinners measure
    themselves to be (other work on the machine can only add to it)."""
    n = os.cpu_count() or 1
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)  # past interpreter start-up
        meter = CpuLoadMeter()
        t0, ticks0 = time.monotonic(), _ticks([p.pid for p in spinners])
        time.sleep(2.0)
        load = meter.sample()
        ticks = _ticks([p.pid for p in spinners]) - ticks0
        share = ticks / CLK_TCK / ((time.monotonic() - t0) * n)
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
    assert share > 0.2, f"spinners barely ran ({share:.2f})"
    assert load >= share - 0.05, (load, share)
    assert load >= 0.5


# --- memory ---------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("free") is None, reason="procps free not installed")
def test_memory_matches_free() -> None:
    out = subprocess.run(["free", "-b"], capture_output=True, text=True, check=True).stdout
    header, mem = out.splitlines()[0].split(), out.splitlines()[1].split()
    total = int(mem[1])
    available = int(mem[1 + header.index("available")])
    used, our_total = read_memory()
    assert our_total == total
    # Read a moment apart on a shared machine: close, not equal.
    assert abs(used - (total - available)) < 256 * MiB


def test_meminfo_parsing_and_fallback(tmp_path: Path) -> None:
    info = parse_meminfo("MemTotal: 1000 kB\nMemFree: 100 kB\nMemAvailable: 600 kB\n"
                         "HugePages_Total: 4\nActive(anon): 3 kB\n")
    assert info == {"MemTotal": 1024000, "MemFree": 102400, "MemAvailable": 614400,
                    "HugePages_Total": 4, "Active(anon)": 3072}
    f = tmp_path / "meminfo"
    f.write_text("MemTotal: 1000 kB\nMemFree: 100 kB\nMemAvailable: 600 kB\n")
    assert read_memory(f) == (400 * 1024, 1000 * 1024)
    f.write_text("MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 50 kB\nCached: 250 kB\n")
    assert read_memory(f) == (600 * 1024, 1000 * 1024)  # pre-3.14 kernels


def test_numa_nodes_from_sysfs(tmp_path: Path) -> None:
    for n, (total, free, files, slab) in {0: (1000, 100, 200, 50), 1: (2000, 1500, 0, 0)}.items():
        d = tmp_path / f"node{n}"
        d.mkdir()
        (d / "meminfo").write_text(
            f"Node {n} MemTotal: {total} kB\nNode {n} MemFree: {free} kB\n"
            f"Node {n} FilePages: {files} kB\nNode {n} SReclaimable: {slab} kB\n"
            f"Node {n} HugePages_Total:     0\n")
    (tmp_path / "node_junk").mkdir()
    (tmp_path / "possible").write_text("0-1\n")
    nodes = read_numa(tmp_path)
    assert [(x.node, x.used, x.total) for x in nodes] == [
        (0, (1000 - 100 - 200 - 50) * 1024, 1000 * 1024), (1, 500 * 1024, 2000 * 1024)]
    assert read_numa(tmp_path / "absent") == []


def test_numa_nodes_of_this_machine() -> None:
    nodes = read_numa()
    if not nodes:
        pytest.skip("kernel without NUMA sysfs")
    assert all(0 <= x.used <= x.total and x.total > 0 for x in nodes)


# --- cgroups: real v1 -------------------------------------------------------------------

CHILD = """
import sys, time
sys.stdin.readline()              # wait until the test moved us into the cgroup
block = bytearray(64 << 20)       # allocated after the move: charged to the cgroup
block[::4096] = b"x" * len(block[::4096])
print("ready", flush=True)
if sys.argv[1] == "spin":
    while True:
        pass
sys.stdin.readline()
"""


def _v1_mounts() -> dict[str, tuple[Path, PurePosixPath]]:
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    return {c: (m.mount_point, m.root) for m in mounts if m.version == 1
            for c in m.controllers}


def _remove_cgroup(d: Path) -> None:
    """rmdir, once the killed children have left (the kernel takes a moment)."""
    for _ in range(100):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    d.rmdir()  # raise with the real error


@pytest.fixture
def v1_cgroup() -> Iterator[dict[str, Path]]:
    """A fresh cgroup in the cpu, cpuacct and memory v1 hierarchies (one directory
    per hierarchy; a joined cpu,cpuacct mount has one for both), removed after."""
    if not IS_ROOT:
        pytest.skip("creating cgroups needs root")
    mounts = _v1_mounts()
    if not all(c in mounts for c in ("cpu", "cpuacct", "memory")):
        pytest.skip("cpu, cpuacct and memory are not all mounted as cgroup v1 here")
    name = f"hpclb-test-{os.getpid()}-{secrets.token_hex(3)}"
    dirs = {c: mounts[c][0] / name for c in ("cpu", "cpuacct", "memory")}
    created: list[Path] = []
    try:
        for d in dict.fromkeys(dirs.values()):
            d.mkdir()
            created.append(d)
        yield dirs
    finally:
        for d in reversed(created):
            _remove_cgroup(d)


@pytest.fixture
def child_in() -> Iterator[object]:
    """Starts CHILD ('spin' or 'idle') inside given cgroup dirs; kills it after."""
    procs: list[subprocess.Popen[str]] = []

    def start(mode: str, dirs: list[Path]) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        for d in dict.fromkeys(dirs):
            (d / "cgroup.procs").write_text(str(p.pid))
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ready"
        return p

    try:
        yield start
    finally:
        for p in procs:
            p.kill()
            p.communicate()  # reaps it and closes its pipes


@pytest.mark.root
def test_v1_cgroup_at_its_quota_reads_full_load(v1_cgroup: dict[str, Path],
                                                child_in: object) -> None:
    (v1_cgroup["cpu"] / "cpu.cfs_period_us").write_text("100000")
    (v1_cgroup["cpu"] / "cpu.cfs_quota_us").write_text("20000")  # 20% of one CPU
    (v1_cgroup["memory"] / "memory.limit_in_bytes").write_text(str(256 * MiB))
    child_in("spin", list(v1_cgroup.values()))  # type: ignore[operator]

    cg = find_cgroup(str(v1_cgroup["memory"]))  # an absolute dir of one hierarchy...
    assert isinstance(cg, CgroupV1)
    assert (cg.cpu, cg.cpuacct, cg.memory) == (  # ...finds the cgroup in the others
        v1_cgroup["cpu"], v1_cgroup["cpuacct"], v1_cgroup["memory"])
    if all(root == PurePosixPath("/") for _, root in _v1_mounts().values()):
        name = v1_cgroup["cpu"].name
        for spec in (name, "/" + name):  # the /proc/PID/cgroup form
            found = find_cgroup(spec)
            assert isinstance(found, CgroupV1) and found.memory == v1_cgroup["memory"]

    host_total = read_memory()[1]
    meter = CgroupMeter(cg, host_mem_total=host_total)
    time.sleep(3.0)
    s = meter.sample()
    assert meter.last_raw is not None
    # At its quota: used CPU time / (time x 0.2 CPU) is 1, give or take CFS periods
    # cut by our window; a starved child on a busy machine can only read lower.
    assert 0.6 <= meter.last_raw <= 1.15, meter.last_raw
    assert s.cpu_load is not None and 0.6 <= s.cpu_load <= 1.0
    assert s.cpu_limit == pytest.approx(0.2)
    assert s.mem_limit == 256 * MiB
    assert s.mem_used is not None and 60 * MiB <= s.mem_used < 256 * MiB


@pytest.mark.root
def test_v1_cgroup_idle_and_unlimited(v1_cgroup: dict[str, Path], child_in: object) -> None:
    child_in("idle", list(v1_cgroup.values()))  # type: ignore[operator]
    host_total = read_memory()[1]
    meter = CgroupMeter(find_cgroup(str(v1_cgroup["cpuacct"])), host_mem_total=host_total)
    time.sleep(1.5)
    s = meter.sample()
    assert s.cpu_load is not None and s.cpu_load < 0.2
    assert s.cpu_limit == os.cpu_count()  # no quota: the host's CPUs
    assert s.mem_limit == host_total  # no limit: the host's memory
    assert s.mem_used is not None and s.mem_used >= 60 * MiB


@pytest.mark.root
def test_v2_cgroup_real_cpu_accounting(child_in: object) -> None:
    """The v2 tree here has no controller enabled: usage_usec is real, and the
    reader must see no quota (host CPUs) and no memory figures."""
    if not IS_ROOT:
        pytest.skip("creating cgroups needs root")
    v2 = [m for m in parse_mountinfo(Path("/proc/self/mountinfo").read_text())
          if m.version == 2]
    if not v2:
        pytest.skip("no cgroup2 mount")
    d = v2[0].mount_point / f"hpclb-test-{os.getpid()}-{secrets.token_hex(3)}"
    d.mkdir()
    try:
        child_in("spin", [d])  # type: ignore[operator]
        cg = find_cgroup(str(d))
        assert isinstance(cg, CgroupV2)
        n = os.cpu_count() or 1
        meter = CgroupMeter(cg, host_mem_total=read_memory()[1])
        time.sleep(2.0)
        s = meter.sample()
        if (d / "cpu.max").exists():
            pytest.skip("this host enables the v2 cpu controller: quota path differs")
        assert s.cpu_limit == n
        # One spinner can use one CPU of n at most.
        assert s.cpu_load is not None and 0.2 / n <= s.cpu_load <= 1.0 / n + 0.05
        if not (d / "memory.current").exists():
            assert s.mem_used is None and s.mem_limit is None
    finally:
        for p in (d / "cgroup.procs").read_text().split():
            (v2[0].mount_point / "cgroup.procs").write_text(p)  # out, if still alive
        _remove_cgroup(d)


# --- cgroups: fixtures (v2 controllers are not enabled on this machine) -------------------


def _v2_dir(tmp_path: Path, usage_usec: int, cpu_max: str | None, mem: tuple[int, int, str]
            | None) -> Path:
    d = tmp_path / "v2"
    d.mkdir(exist_ok=True)
    (d / "cgroup.controllers").write_text("cpu memory\n")
    (d / "cpu.stat").write_text(f"usage_usec {usage_usec}\nuser_usec 1\nsystem_usec 1\n")
    if cpu_max is not None:
        (d / "cpu.max").write_text(cpu_max + "\n")
    if mem is not None:
        current, inactive, limit = mem
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").write_text(f"anon 5\nfile 9\ninactive_file {inactive}\n")
        (d / "memory.max").write_text(f"{limit}\n")
    return d


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_v2_quota_and_limit_from_files(tmp_path: Path) -> None:
    d = _v2_dir(tmp_path, 1_000_000, "50000 100000", (300 * MiB, 100 * MiB, str(512 * MiB)))
    cg = find_cgroup(str(d))
    assert isinstance(cg, CgroupV2)
    clock = FakeClock()
    meter = CgroupMeter(cg, host_mem_total=8192 * MiB, cpus=4, clock=clock)
    clock.t += 2.0
    _v2_dir(tmp_path, 1_500_000, "50000 100000", (300 * MiB, 100 * MiB, str(512 * MiB)))
    s = meter.sample()
    # 0.5 s of CPU in 2 s against a 0.5-CPU quota: half loaded
    assert s.cpu_load == pytest.approx(0.5)
    assert s.cpu_limit == 0.5
    assert (s.mem_used, s.mem_limit) == (200 * MiB, 512 * MiB)  # inactive cache left out


def test_v2_unlimited_and_over_quota(tmp_path: Path) -> None:
    d = _v2_dir(tmp_path, 0, "max 100000", (300 * MiB, 0, "max"))
    clock = FakeClock()
    meter = CgroupMeter(find_cgroup(str(d)), host_mem_total=8192 * MiB, cpus=4, clock=clock)
    clock.t += 1.0
    _v2_dir(tmp_path, 4_200_000, "max 100000", (300 * MiB, 0, "max"))  # 4.2 CPU-s in 1 s
    s = meter.sample()
    assert meter.last_raw == pytest.approx(1.05)
    assert s.cpu_load == 1.0  # saturated, clamped rather than rejected downstream
    assert (s.cpu_limit, s.mem_limit) == (4.0, 8192 * MiB)
    # a limit above the RAM there is means the RAM
    _v2_dir(tmp_path, 4_200_000, "max 100000", (300 * MiB, 0, str(10**15)))
    assert meter.sample().mem_limit == 8192 * MiB
    # no time passed: the previous load is kept, not a division by zero
    assert meter.sample().cpu_load == 1.0


def test_v2_without_controllers_and_bad_files(tmp_path: Path) -> None:
    d = _v2_dir(tmp_path, 10, None, None)
    r = CgroupV2(str(d), d).read()
    assert (r.cpu_usage_ns, r.cpu_quota, r.mem_used, r.mem_limit) == (10_000, None, None, None)
    (d / "cpu.max").write_text("lots\n")
    with pytest.raises(CgroupError, match=r"cpu\.max"):
        CgroupV2(str(d), d).read()
    (d / "cpu.max").write_text("abc 100000\n")
    with pytest.raises(CgroupError, match=r"cpu\.max: bad value"):
        CgroupV2(str(d), d).read()


def test_v1_from_files(tmp_path: Path) -> None:
    (tmp_path / "cpuacct.usage").write_text("5000000000\n")
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "memory.usage_in_bytes").write_text(f"{100 * MiB}\n")
    (tmp_path / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {30 * MiB}\n")
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    cg = find_cgroup(str(tmp_path))
    assert isinstance(cg, CgroupV1)
    r = cg.read()
    assert (r.cpu_usage_ns, r.cpu_quota, r.mem_used, r.mem_limit) == (
        5_000_000_000, None, 70 * MiB, None)
    (tmp_path / "memory.usage_in_bytes").write_text("lots\n")
    with pytest.raises(CgroupError, match="expected a number"):
        cg.read()


def test_cgroup_not_found(tmp_path: Path) -> None:
    with pytest.raises(CgroupError, match="not found"):
        find_cgroup(f"/hpclb-no-such-cgroup-{secrets.token_hex(4)}")
    with pytest.raises(CgroupError, match=r"'\.\.'"):
        find_cgroup("slurm/../../etc")
    with pytest.raises(CgroupError, match="not a cgroup"):
        find_cgroup(str(tmp_path))
    (tmp_path / "cgroup.controllers").write_text("")
    with pytest.raises(CgroupError, match="cannot read"):
        find_cgroup(str(tmp_path)).read()  # a v2 dir without cpu.stat


def test_mountinfo_joined_hierarchies_and_container_roots(tmp_path: Path) -> None:
    text = (
        "30 23 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
        "31 30 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "32 30 0:28 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "33 30 0:29 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
        "34 30 0:30 / /mnt/with\\040space rw shared:1 - cgroup cgroup rw,pids\n")
    m = parse_mountinfo(text)
    assert [(x.mount_point, x.version, sorted(x.controllers), str(x.root)) for x in m] == [
        (Path("/sys/fs/cgroup/cpu,cpuacct"), 1, ["cpu", "cpuacct"], "/"),
        (Path("/sys/fs/cgroup/memory"), 1, ["memory"], "/docker/abc"),
        (Path("/sys/fs/cgroup/unified"), 2, [], "/"),
        (Path("/mnt/with space"), 1, [], "/"),
    ]
    # A joined hierarchy and a container's mount root, on a fake tree.
    cpu = tmp_path / "cpu,cpuacct" / "docker" / "abc" / "job"
    mem = tmp_path / "memory" / "job"
    cpu.mkdir(parents=True)
    mem.mkdir(parents=True)
    info = tmp_path / "mountinfo"
    info.write_text(
        f"31 30 0:27 / {tmp_path}/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        f"32 30 0:28 /docker/abc {tmp_path}/memory rw - cgroup cgroup rw,memory\n")
    cg = find_cgroup("/docker/abc/job", mountinfo=info)
    assert isinstance(cg, CgroupV1)
    assert (cg.cpu, cg.cpuacct, cg.memory) == (cpu, cpu, mem)


# --- GPUs -------------------------------------------------------------------------------


def test_nvml_absent_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hpclb.agent")
    gpus = NvmlGpus.open()
    if gpus is not None:  # a machine with a GPU: then it must read sanely
        try:
            readings = gpus.read()
        finally:
            gpus.close()
        assert readings and all(0 < g.mem_total and 0 <= g.mem_used <= g.mem_total
                                for g in readings)
        return
    lines = [r for r in caplog.records if r.name == "hpclb.agent"]
    assert len(lines) == 1 and lines[0].getMessage().startswith("no GPUs:")
    assert lines[0].levelno == logging.INFO  # not an error


def test_nvml_library_not_installed(caplog: pytest.LogCaptureFixture,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="hpclb.agent")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # what Python does for a missing module
    assert NvmlGpus.open() is None
    assert [r.getMessage() for r in caplog.records] == [
        "no GPUs: nvidia-ml-py (pynvml) is not installed"]


def test_pci_bus_id_to_numa_node(tmp_path: Path) -> None:
    assert sysfs_pci_address("00000000:3B:00.0") == "0000:3b:00.0"
    assert sysfs_pci_address(b"00000001:AF:1F.7\x00") == "0001:af:1f.7"
    with pytest.raises(ValueError, match="not a PCI bus id"):
        sysfs_pci_address("GPU-0")
    for addr, node in (("0000:3b:00.0", "1\n"), ("0000:af:00.0", "-1\n")):
        (tmp_path / addr).mkdir()
        (tmp_path / addr / "numa_node").write_text(node)
    assert pci_numa_node("00000000:3B:00.0", tmp_path) == 1
    assert pci_numa_node("00000000:AF:00.0", tmp_path) is None  # -1: the platform does not say
    assert pci_numa_node("00000000:01:00.0", tmp_path) is None  # no such device
    assert pci_numa_node("junk", tmp_path) is None


# --- further metric sources ----------------------------------------------------------------

IPMCTL_A = """
 ---DimmID=0x0001---
    MediaReads=0x0000000000000100
    MediaWrites=0x0000000000000010
    ReadRequests=0x0000000000000200
 ---DimmID=0x0101---
    MediaReads=256
    MediaWrites=0
"""
IPMCTL_B = IPMCTL_A.replace("MediaReads=256", "MediaReads=2256").replace(
    "MediaWrites=0x0000000000000010", "MediaWrites=0x0000000000000410")


def test_ipmctl_parsing_and_bandwidth() -> None:
    assert parse_ipmctl_performance(IPMCTL_A) == {
        "0x0001": {"MediaReads": 256, "MediaWrites": 16, "ReadRequests": 512},
        "0x0101": {"MediaReads": 256, "MediaWrites": 0}}
    outputs = iter([IPMCTL_A, IPMCTL_B, IPMCTL_A])
    clock = FakeClock()
    src = PmemBandwidth(run=lambda argv: next(outputs), clock=clock)
    assert src.read() == {}  # one point: no rate yet
    clock.t += 2.0
    assert src.read() == {"pmem_dimms": 2.0, "pmem_read_bytes_per_s": 2000 * 64 / 2,
                          "pmem_write_bytes_per_s": 1024 * 64 / 2}
    clock.t += 2.0
    assert src.read() == {}  # counters went back (power cycle): no rate
    src = PmemBandwidth(run=lambda argv: "No PMem modules\n")
    with pytest.raises(SourceError, match="no PMem module"):
        src.read()


def test_ndctl_regions() -> None:
    one = json.dumps({"dev": "region0", "size": 100, "available_size": 40, "type": "pmem"})
    many = json.dumps([json.loads(one), {"dev": "region1", "size": 5, "type": "blk"},
                       {"dev": "region2", "size": 50, "available_size": 0, "type": "pmem"}])
    assert PmemCapacity(run=lambda argv: one).read() == {
        "pmem_appdirect_bytes": 100.0, "pmem_appdirect_free_bytes": 40.0}
    assert PmemCapacity(run=lambda argv: many).read() == {
        "pmem_appdirect_bytes": 150.0, "pmem_appdirect_free_bytes": 40.0}
    assert PmemCapacity(run=lambda argv: "").read()["pmem_appdirect_bytes"] == 0.0
    with pytest.raises(SourceError, match="not JSON"):
        PmemCapacity(run=lambda argv: "{oops").read()


def test_pmem_tools_absent_or_present_on_path(tmp_path: Path) -> None:
    assert available_sources(which=lambda name: None) == []
    if shutil.which("ipmctl") is None and shutil.which("ndctl") is None:
        assert available_sources() == []  # this machine: no PMem tools, no error
    # A stand-in ipmctl on PATH goes through the real subprocess path.
    tool = tmp_path / "ipmctl"
    tool.write_text(f"#!/bin/sh\ncat {tmp_path}/out.txt\n")
    tool.chmod(0o755)
    (tmp_path / "out.txt").write_text(IPMCTL_A)
    srcs = available_sources(which=lambda name: shutil.which(name, path=str(tmp_path)))
    assert [s.name for s in srcs] == ["pmem-bandwidth"]
    assert srcs[0].read() == {}
    (tmp_path / "out.txt").write_text(IPMCTL_B)
    assert srcs[0].read()["pmem_read_bytes_per_s"] > 0
    with pytest.raises(SourceError, match="exited 3: boom"):
        run_tool(["sh", "-c", "echo boom >&2; exit 3"])
    with pytest.raises(SourceError, match="No such file"):
        run_tool([str(tmp_path / "absent")])


class _Broken:
    name = "broken"

    def read(self) -> dict[str, float]:
        raise SourceError("device on fire")

    def close(self) -> None:
        pass


class _Sloppy:
    name = "sloppy"

    def read(self) -> dict[str, float]:
        return {"good_metric": 2, "Bad Name": 1.0, "not_number": "x", "flag": True}  # type: ignore[dict-item]

    def close(self) -> None:
        pass


def test_collector_real_host_and_failing_sources(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hpclb.agent")
    c = Collector(node_id="n1", interval=IntervalPolicy(base=2.0, lo=1.0, hi=3.0),
                  sources=[_Broken(), _Sloppy()])
    time.sleep(0.2)
    first, second = c.collect(), c.collect()
    assert (first.seq, second.seq) == (0, 1)
    for m in (first, second):
        assert decode(encode(m)) == m
        assert 0.0 <= m.cpu_load <= 1.0 and 0 < m.mem_used <= m.mem_total
        assert m.numa_nodes >= 1 and m.cgroup is None
        assert m.interval_s == pytest.approx(adaptive_interval(2.0, m.cpu_load, 1.0, 3.0))
        assert m.extra == {"good_metric": 2.0}
    broken = [r for r in caplog.records if "broken failed" in r.getMessage()]
    assert len(broken) == 1  # once, not every heartbeat


# --- the adaptive interval --------------------------------------------------------------


@pytest.mark.parametrize(("load", "expected"), [
    (0.0, 5.0), (0.5, 6.25), (0.7, 7.45), (1.0, 10.0),
    (math.nan, 5.0), (-3.0, 5.0), (7.0, 10.0), (math.inf, 5.0),
])
def test_adaptive_interval_formula(load: float, expected: float) -> None:
    assert adaptive_interval(5.0, load, 0.1, 60.0) == pytest.approx(expected)


def test_adaptive_interval_bounds() -> None:
    assert adaptive_interval(5.0, 1.0, 0.1, 8.0) == 8.0  # capped
    assert adaptive_interval(0.05, 0.0, 0.1, 8.0) == 0.1  # floored
    loads = [i / 100 for i in range(101)]
    intervals = [adaptive_interval(5.0, x, 0.1, 60.0) for x in loads]
    assert intervals == sorted(intervals)  # busier never reports more often
    assert IntervalPolicy(5.0, 1.0, 9.0).next(1.0) == 9.0
    with pytest.raises(ValueError, match="min interval 10"):
        IntervalPolicy(5.0, 10.0, 2.0)
    with pytest.raises(ValueError, match="positive"):
        IntervalPolicy(0.0, 0.1, 60.0)


# --- the command line -------------------------------------------------------------------


def test_keygen_writes_a_usable_keypair(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    d = tmp_path / "curve"
    assert agent_main.main(["keygen", str(d), "--name", "node01"]) == 0
    public, secret = d / "node01.key", d / "node01.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pub, sec = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (pub, None)
    assert sec is not None and len(pub) == 40
    assert "node01.key" in capsys.readouterr().out
    # no silent overwrite of a node's identity
    assert agent_main.main(["keygen", str(d), "--name", "node01"]) == 2
    assert "exists" in capsys.readouterr().err
    assert agent_main.main(["keygen", str(d), "--name", "node01", "--force"]) == 0
    assert zmq.auth.load_certificate(secret)[0] != pub
    with pytest.raises(SystemExit):
        agent_main.main(["keygen", str(d), "--name", "../evil"])


def test_run_refuses_bad_setup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    agent_main.main(["keygen", str(tmp_path), "--name", "server"])
    agent_main.main(["keygen", str(tmp_path), "--name", "n1"])
    capsys.readouterr()
    base = ["run", "--connect", "tcp://127.0.0.1:1", "--node-id", "n1",
            "--server-key", str(tmp_path / "server.key")]
    assert agent_main.main([*base, "--key", str(tmp_path / "absent")]) == 2
    assert "absent: not a readable CURVE certificate" in capsys.readouterr().err
    assert agent_main.main([*base, "--key", str(tmp_path / "n1.key")]) == 2
    assert "has no secret key" in capsys.readouterr().err
    secret = ["--key", str(tmp_path / "n1.key_secret")]
    assert agent_main.main([*base, *secret, "--cgroup", "/hpclb-no-such-cgroup"]) == 2
    assert "not found" in capsys.readouterr().err
    assert agent_main.main([*base, *secret, "--min-interval", "9", "--max-interval", "2"]) == 2
    assert "above max interval" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        agent_main.main([*base, *secret, "--base-interval", "-1"])


@pytest.mark.parametrize(("text", "endpoint"), [
    ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5557"),
    ("10.0.0.1:5557", "tcp://10.0.0.1:5557"),
    ("tcp://gateway.cluster:5557", "tcp://gateway.cluster:5557"),
    ("tcp://[fd00::1]:5557", "tcp://[fd00::1]:5557"),
    ("[::1]:1", "tcp://[::1]:1"),
])
def test_connect_endpoint_forms(text: str, endpoint: str) -> None:
    assert agent_main.endpoint(text) == endpoint


@pytest.mark.parametrize(("text", "message"), [
    ("tcp://fd00::1:5557", "an IPv6 address goes in brackets"),
    ("tcp://[fd00::zz]:5557", "not an IPv6 address in brackets"),
    ("tcp://[10.0.0.1]:5557", "not an IPv6 address in brackets"),
    ("tcp://10.0.0.1:0", "port 0 is not 1-65535"),
    ("tcp://10.0.0.1:70000", "port 70000 is not 1-65535"),
    ("ipc:///run/x", "is not tcp://HOST:PORT"),
    ("10.0.0.1", "is not tcp://HOST:PORT"),
])
def test_connect_endpoint_refused_with_a_reason(text: str, message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        agent_main.main(["run", "--connect", text, "--node-id", "n1", "--server-key", "s",
                         "--key", "k"])
    assert message in capsys.readouterr().err


def test_sample_prints_one_message(capsys: pytest.CaptureFixture[str]) -> None:
    rc = agent_main.main(["sample", "--node-id", "n1", "--window", "0.2", "--require-gpu"])
    out = json.loads(capsys.readouterr().out)
    assert out["v"] == 1 and out["node"] == "n1" and out["mem_total"] > 0
    assert rc == (0 if out["gpus"] else 1)  # --require-gpu: non-zero without a GPU
