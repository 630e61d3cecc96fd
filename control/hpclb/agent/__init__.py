"""The node agent (``hpclb-agent``): reads the node, publishes telemetry.

The readers live in their own modules (procstat: host CPU/memory/NUMA; cgroup: a
job container's CPU and memory; gpu: NVML; sources: further metrics such as PMem);
:class:`Collector` turns one round of readings into a telemetry message, and
``main`` runs the loop that publishes it at the adaptive interval.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpclb.agent import procstat
from hpclb.agent.cgroup import CgroupMeter
from hpclb.agent.gpu import NvmlGpus
from hpclb.agent.sources import MetricSource
from hpclb.telemetry.message import (
    MAX_EXTRA,
    MAX_GPUS,
    MAX_NUMA_NODES,
    METRIC_NAME_PATTERN,
    CgroupStats,
    GpuStats,
    NumaMemory,
    TelemetryMessage,
)

log = logging.getLogger("hpclb.agent")


def adaptive_interval(base: float, load: float, lo: float, hi: float) -> float:
    """The report interval: ``base x (1 + load^2)`` bounded to ``[lo, hi]``.

    A busy node reports less often (less monitoring overhead where it hurts); an
    idle one at ``base``. A load that is not a ratio (NaN, out of range) is taken
    as 0: the heartbeat must not stop because one reading went wrong.
    """
    if not math.isfinite(load) or load < 0:
        load = 0.0
    load = min(load, 1.0)
    return min(max(base * (1.0 + load * load), lo), hi)


@dataclass(frozen=True, slots=True)
class IntervalPolicy:
    """The heartbeat interval's parameters, seconds."""

    base: float = 5.0  # the default heartbeat
    lo: float = 0.1  # the fastest the control plane's probes go
    hi: float = 60.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v > 0 for v in (self.base, self.lo, self.hi)):
            raise ValueError(f"intervals must be positive numbers: base {self.base}, "
                             f"min {self.lo}, max {self.hi}")
        if self.lo > self.hi:
            raise ValueError(f"min interval {self.lo} is above max interval {self.hi}")

    def next(self, load: float) -> float:
        return adaptive_interval(self.base, load, self.lo, self.hi)


@dataclass
class Collector:
    """One telemetry message per :meth:`collect`: the host's CPU (since the previous
    call), memory and NUMA memory, and the optional cgroup, GPUs and sources."""

    node_id: str
    interval: IntervalPolicy = field(default_factory=IntervalPolicy)
    cgroup: CgroupMeter | None = None
    gpus: NvmlGpus | None = None
    sources: Sequence[MetricSource] = ()
    proc: Path = Path("/proc")
    sys_nodes: Path = procstat.SYS_NODES
    clock: Callable[[], float] = time.time
    seq: int = 0
    _cpu: procstat.CpuLoadMeter = field(init=False)
    _failing: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._cpu = procstat.CpuLoadMeter(self.proc / "stat")

    def _source_figures(self, first: Mapping[str, float] | None = None) -> dict[str, float]:
        extra: dict[str, float] = dict(first or {})
        for src in self.sources:
            try:
                figures = src.read()
            except Exception as err:  # a failing source must not stop the heartbeat
                if src.name not in self._failing:
                    self._failing.add(src.name)
                    log.warning("metric source %s failed: %s (logged again once it "
                                "recovers and fails anew)", src.name, err)
                continue
            self._failing.discard(src.name)
            for name, value in figures.items():
                if re.match(METRIC_NAME_PATTERN, name) and isinstance(value, int | float) \
                        and not isinstance(value, bool):
                    if first is None or name not in first:  # the agent's own figure wins
                        extra[name] = float(value)
                else:
                    log.warning("metric source %s: dropped %r = %r (bad name or not a "
                                "number)", src.name, name, value)
        if len(extra) > MAX_EXTRA:
            log.warning("%d extra metrics, keeping the first %d", len(extra), MAX_EXTRA)
            extra = dict(list(extra.items())[:MAX_EXTRA])
        return extra

    def collect(self, extra: Mapping[str, float] | None = None) -> TelemetryMessage:
        """Read everything once; ``interval_s`` of the message is the next interval.
        ``extra``: figures of the agent's own (``fleet_rtt_ms``), kept first
        when the sources bring more than MAX_EXTRA."""
        cpu = self._cpu.sample()
        used, total = procstat.read_memory(self.proc / "meminfo")
        numa = [n for n in procstat.read_numa(self.sys_nodes) if n.node < MAX_NUMA_NODES]
        cg = None
        load = cpu
        if self.cgroup is not None:
            c = self.cgroup.sample()
            cg = CgroupStats(path=self.cgroup.cgroup.path[:4096],
                             version=self.cgroup.cgroup.version, cpu_load=c.cpu_load,
                             cpu_limit=c.cpu_limit, mem_used=c.mem_used, mem_limit=c.mem_limit)
            if c.cpu_load is not None:
                load = c.cpu_load  # the node's load is its cgroup's (to_node_sample)
        gpus = [] if self.gpus is None else self.gpus.read()[:MAX_GPUS]
        msg = TelemetryMessage(
            node=self.node_id,
            time=self.clock(),
            seq=self.seq,
            interval_s=self.interval.next(load),
            cpu_load=cpu,
            mem_used=used,
            mem_total=total,
            numa_nodes=max(len(numa), 1),
            numa=tuple(NumaMemory(node=n.node, mem_used=n.used, mem_total=n.total)
                       for n in numa),
            cgroup=cg,
            gpus=tuple(GpuStats(index=g.index, name=g.name, uuid=g.uuid, mem_used=g.mem_used,
                                mem_total=g.mem_total, util=g.util,
                                numa_node=g.numa_node if g.numa_node is None
                                or g.numa_node < MAX_NUMA_NODES else None)
                       for g in gpus),
            extra=self._source_figures(extra),
        )
        self.seq += 1
        return msg

    def close(self) -> None:
        if self.gpus is not None:
            self.gpus.close()
        for src in self.sources:
            src.close()
