"""Further metric sources: anything that yields named numbers for ``extra``.

A source implements :class:`MetricSource`; its figures travel in the telemetry
message's ``extra`` map (metric names: lower case, digits, underscores). A source
that cannot run on a node is simply not created (:func:`available_sources`); one
that fails while running loses its figures for that message only (the collector
logs it once), it never stops the heartbeat.

The first ones are for persistent memory:

* :class:`PmemBandwidth` reads the media read/write counters of every PMem module
  through ``ipmctl show -dimm -performance`` and reports bytes per second between
  two readings (the counters count 64-byte accesses);
* :class:`PmemCapacity` reads App Direct regions through ``ndctl list --regions``
  (ndctl has no bandwidth counters; what it knows is how much PMem is in App
  Direct mode and how much of it is still unallocated).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Protocol

log = logging.getLogger("hpclb.agent")

#: Wall-clock limit for one run of a helper tool: a hung ipmctl must not hold the
#: heartbeat back for long.
TOOL_TIMEOUT_S = 5.0
_ACCESS_BYTES = 64  # ipmctl's MediaReads/MediaWrites count 64-byte accesses


class SourceError(Exception):
    """A source could not produce its figures this time."""


class MetricSource(Protocol):
    """A producer of extra metrics."""

    #: Short name, for logs.
    name: str

    def read(self) -> dict[str, float]:
        """Current figures (may be empty, e.g. before a rate has two points);
        raises SourceError (or OSError) when it cannot read them."""
        ...

    def close(self) -> None:
        """Release what the source holds."""
        ...


Runner = Callable[[Sequence[str]], str]


def run_tool(argv: Sequence[str]) -> str:
    """stdout of a helper tool; SourceError on failure, timeout or a missing tool."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True,
                              timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SourceError(f"{argv[0]}: {err}") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise SourceError(f"{' '.join(argv)} exited {done.returncode}"
                          + (f": {detail[-1]}" if detail else ""))
    return done.stdout


def parse_ipmctl_performance(text: str) -> dict[str, dict[str, int]]:
    """``ipmctl show -dimm -performance`` text: {DimmID: {metric: value}}.

    Blocks look like ``---DimmID=0x0001---`` followed by ``   MediaReads=0x...``
    lines (values in hex or decimal).
    """
    dimms: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in text.splitlines():
        line = line.strip()
        head = re.fullmatch(r"-+\s*DimmID\s*=\s*(\S+?)\s*-+", line)
        if head:
            current = dimms.setdefault(head.group(1), {})
            continue
        m = re.fullmatch(r"(\w+)\s*=\s*(0[xX][0-9A-Fa-f]+|\d+)", line)
        if m and current is not None:
            current[m.group(1)] = int(m.group(2), 0)
    return dimms


class PmemBandwidth:
    """PMem media bandwidth (bytes/s, read and write) from ipmctl's counters."""

    name = "pmem-bandwidth"

    def __init__(self, ipmctl: str = "ipmctl", run: Runner = run_tool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._argv = [ipmctl, "show", "-dimm", "-performance"]
        self._run = run
        self._clock = clock
        self._last: tuple[float, int, int] | None = None

    def read(self) -> dict[str, float]:
        dimms = parse_ipmctl_performance(self._run(self._argv))
        if not dimms:
            raise SourceError("ipmctl reported no PMem module")
        reads = sum(d.get("MediaReads", 0) for d in dimms.values())
        writes = sum(d.get("MediaWrites", 0) for d in dimms.values())
        now = self._clock()
        last, self._last = self._last, (now, reads, writes)
        if last is None or now <= last[0] or reads < last[1] or writes < last[2]:
            return {}  # first reading, or counters reset (power cycle): no rate yet
        dt = now - last[0]
        return {
            "pmem_dimms": float(len(dimms)),
            "pmem_read_bytes_per_s": (reads - last[1]) * _ACCESS_BYTES / dt,
            "pmem_write_bytes_per_s": (writes - last[2]) * _ACCESS_BYTES / dt,
        }

    def close(self) -> None:
        pass


class PmemCapacity:
    """PMem in App Direct mode (bytes, total and unallocated) from ndctl."""

    name = "pmem-capacity"

    def __init__(self, ndctl: str = "ndctl", run: Runner = run_tool) -> None:
        self._argv = [ndctl, "list", "--regions"]
        self._run = run

    def read(self) -> dict[str, float]:
        text = self._run(self._argv).strip()
        if not text:
            return {"pmem_appdirect_bytes": 0.0, "pmem_appdirect_free_bytes": 0.0}
        try:
            data = json.loads(text)
        except ValueError as err:
            raise SourceError(f"ndctl list: not JSON: {err}") from None
        # One region prints as an object, several as a list.
        regions = data if isinstance(data, list) else [data]
        pmem = [r for r in regions if isinstance(r, dict) and r.get("type") == "pmem"]
        return {
            "pmem_appdirect_bytes": float(sum(int(r.get("size", 0)) for r in pmem)),
            "pmem_appdirect_free_bytes": float(sum(int(r.get("available_size", 0))
                                                   for r in pmem)),
        }

    def close(self) -> None:
        pass


def available_sources(which: Callable[[str], str | None] = shutil.which) -> list[MetricSource]:
    """The sources whose tools are on PATH; a missing tool is no error, just a
    debug line (most nodes have no PMem)."""
    sources: list[MetricSource] = []
    if (ipmctl := which("ipmctl")) is not None:
        sources.append(PmemBandwidth(ipmctl))
    else:
        log.debug("no ipmctl on PATH: no PMem bandwidth")
    if (ndctl := which("ndctl")) is not None:
        sources.append(PmemCapacity(ndctl))
    else:
        log.debug("no ndctl on PATH: no PMem capacity")
    return sources
