"""GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``).

Per GPU: memory used/total, utilisation, and the NUMA node it hangs off (the
scheduler prefers the GPU on the data's NUMA node). NVML has no reliable NUMA call on
every driver, so the node comes from the PCI device in sysfs, like ``nvidia-smi
topo -m`` shows it.

A node without the library, the driver or a GPU is an ordinary CPU node: the
reader is simply absent, with one log line saying why.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger("hpclb.agent")

SYS_PCI = Path("/sys/bus/pci/devices")


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    name: str
    uuid: str
    mem_used: int  # bytes
    mem_total: int  # bytes
    util: float | None  # 0..1; None when the device does not report it
    numa_node: int | None


def sysfs_pci_address(bus_id: str | bytes) -> str:
    """NVML's bus id (``00000000:3B:00.0``, 8-digit domain, upper case) as sysfs
    names the device (``0000:3b:00.0``)."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    m = re.fullmatch(r"([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])",
                     text.strip().rstrip("\x00"))
    if m is None:
        raise ValueError(f"not a PCI bus id: {text!r}")
    return f"{int(m.group(1), 16):04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


def pci_numa_node(bus_id: str | bytes, sysfs: Path = SYS_PCI) -> int | None:
    """The NUMA node of a PCI device; None when unknown (-1 in sysfs: one node, or
    firmware that does not say)."""
    try:
        node = int((sysfs / sysfs_pci_address(bus_id) / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlGpus:
    """An initialised NVML. Use :meth:`open`; :meth:`close` when done."""

    def __init__(self, nvml: ModuleType, sysfs: Path = SYS_PCI) -> None:
        self._nvml = nvml
        self._sysfs = sysfs
        self._warned: set[str] = set()

    @classmethod
    def open(cls, sysfs: Path = SYS_PCI) -> NvmlGpus | None:
        """NVML if the library, the driver and at least one GPU are there; else
        None, after one log line."""
        try:
            import pynvml
        except ImportError:
            log.info("no GPUs: nvidia-ml-py (pynvml) is not installed")
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            log.info("no GPUs: NVML is not available (%s)", err)
            return None
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as err:
            log.info("no GPUs: NVML cannot count devices (%s)", err)
            pynvml.nvmlShutdown()
            return None
        if count == 0:
            log.info("no GPUs: NVML found none")
            pynvml.nvmlShutdown()
            return None
        log.info("NVML: %d GPU(s), driver %s", count,
                 _text(pynvml.nvmlSystemGetDriverVersion()))
        return cls(pynvml, sysfs)

    def _warn_once(self, what: str, err: Exception) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s: %s (not reported again)", what, err)

    def read(self) -> list[GpuReading]:
        """Every GPU NVML can read now; a GPU that fails (fallen off the bus) is
        left out and logged once, the others are still reported."""
        nvml = self._nvml
        out = []
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as err:
            self._warn_once("NVML device count", err)
            return []
        for i in range(count):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                name = _text(nvml.nvmlDeviceGetName(h))
                uuid = _text(nvml.nvmlDeviceGetUUID(h))
                bus_id = nvml.nvmlDeviceGetPciInfo(h).busId
            except nvml.NVMLError as err:
                self._warn_once(f"GPU {i}", err)
                continue
            try:
                util: float | None = nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
            except nvml.NVMLError as err:  # NotSupported on some boards (MIG, vGPU)
                self._warn_once(f"GPU {i} utilisation", err)
                util = None
            out.append(GpuReading(index=i, name=name[:96], uuid=uuid[:96],
                                  mem_used=int(mem.used), mem_total=int(mem.total), util=util,
                                  numa_node=pci_numa_node(bus_id, self._sysfs)))
        return out

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as err:
            log.debug("nvmlShutdown: %s", err)
