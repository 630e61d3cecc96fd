"""Launching the DPDK forwarder (``hpclb-dpdk``): its command line, rendered
from ``templates/dpdk_eal.args.j2``, and the host facts it needs (the binary,
hugepages, ports bound to vfio-pci).

The forwarder itself is supervised like the XDP daemon
(:class:`hpclb.dataplane.supervisor.DataplaneProcess`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from jinja2 import Environment, PackageLoader, StrictUndefined

from hpclb.contract.tables import CONN_TABLE_MAX, CONN_TABLE_MIN
from hpclb.host import install

PortDriver = Literal["af_xdp", "af_packet", "pci"]
HUGEPAGE_SYSFS = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
_PCI_ADDR = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def find_dpdk_forwarder() -> str:
    """``hpclb-dpdk``: $HPCLB_DPDK_BIN, else the install manifest (hpclb.host.install)."""
    return str(install.find("hpclb-dpdk"))


@dataclass(frozen=True)
class DpdkPort:
    """One data port and, optionally, its exception TAP.

    ``driver`` af_xdp/af_packet wrap the kernel interface ``iface`` (a vdev);
    pci is a NIC bound to vfio-pci at PCI address ``pci``. ``index`` makes the
    vdev names unique (net_af_xdp0, net_tap0...).
    """

    index: int
    driver: PortDriver
    iface: str | None = None
    pci: str | None = None
    tap: str | None = None  # kernel name of the exception interface, None for none

    def __post_init__(self) -> None:
        if self.driver == "pci":
            if not self.pci or not _PCI_ADDR.match(self.pci):
                raise ValueError(f"port {self.index}: a pci port needs a PCI address "
                                 f"like 0000:3b:00.0, got {self.pci!r}")
        elif not self.iface:
            raise ValueError(f"port {self.index}: an {self.driver} port needs an interface")

    @property
    def device(self) -> str:
        """The DPDK device name the forwarder's --port names."""
        return self.pci if self.driver == "pci" else f"net_{self.driver}{self.index}"  # type: ignore[return-value]

    @property
    def tap_device(self) -> str:
        return f"net_tap{self.index}"


@dataclass(frozen=True)
class DpdkLaunch:
    """Everything the forwarder's command line says."""

    ports: tuple[DpdkPort, ...]
    socket: str
    lcores: tuple[int, ...] = (0, 1)  # the first is the main lcore, the rest workers
    netns: str | None = None
    ring_size: int = 65537
    flow_table_size: int = 262144  # per worker
    flow_timeout_s: int = 300
    #: NAT connection-table entries (two per connection), one table for all
    #: workers; None: the forwarder's default (CONN_TABLE_DEFAULT).
    conn_table_size: int | None = None
    idle_sleep_us: int = 0  # 0: busy-poll, the worker owns its core
    numa: Literal["strict", "warn"] = "warn"
    hugepages: bool = True
    socket_mem_mb: int = 512
    file_prefix: str = "hpclb"
    eal_log_level: str = "notice"
    binary: str = field(default_factory=find_dpdk_forwarder)

    def __post_init__(self) -> None:
        if not self.ports:
            raise ValueError("the DPDK forwarder needs at least one port")
        if len(self.lcores) < 2:
            raise ValueError("the DPDK forwarder needs two lcores: a main one and a worker")
        if len(set(self.lcores)) != len(self.lcores):
            raise ValueError(f"lcores repeat: {self.lcores}")
        size = self.conn_table_size
        if size is not None and (not CONN_TABLE_MIN <= size <= CONN_TABLE_MAX or size % 2):
            raise ValueError(f"conn_table_size must be an even number in {CONN_TABLE_MIN}.."
                             f"{CONN_TABLE_MAX}, got {size}")

    @property
    def workers(self) -> int:
        return len(self.lcores) - 1


def forwarder_argv(launch: DpdkLaunch) -> list[str]:
    """The forwarder's argv, rendered from the template."""
    env = Environment(loader=PackageLoader("hpclb", "templates"), undefined=StrictUndefined,
                      keep_trailing_newline=False)
    text = env.get_template("dpdk_eal.args.j2").render(
        binary=launch.binary, lcores=launch.lcores, file_prefix=launch.file_prefix,
        hugepages=launch.hugepages, socket_mem_mb=launch.socket_mem_mb,
        pci_ports=[p for p in launch.ports if p.driver == "pci"], ports=launch.ports,
        workers=launch.workers, eal_log_level=launch.eal_log_level, socket=launch.socket,
        ring_size=launch.ring_size, flow_table_size=launch.flow_table_size,
        flow_timeout_s=launch.flow_timeout_s, idle_sleep_us=launch.idle_sleep_us,
        numa=launch.numa, netns=launch.netns,
    )
    argv = [line.strip() for line in text.splitlines() if line.strip()]
    # The forwarder's own options follow "--" and end the vector: this one
    # is appended rather than templated, and only when set.
    if launch.conn_table_size is not None:
        argv += ["--conn-table-size", str(launch.conn_table_size)]
    return argv


# --- host facts ------------------------------------------------------------

def free_hugepages_mb() -> int:
    """Free 2 MB hugepages, in MB (0 where the kernel has none)."""
    try:
        return int((HUGEPAGE_SYSFS / "free_hugepages").read_text()) * 2
    except (OSError, ValueError):
        return 0


def reserve_hugepages(mb: int) -> int:
    """Grows the 2 MB hugepage pool so that at least ``mb`` MB are free.

    Returns the free MB after trying (the kernel may grant fewer pages than
    asked when memory is fragmented). Never shrinks the pool.
    """
    missing = mb - free_hugepages_mb()
    if missing <= 0:
        return free_hugepages_mb()
    nr = HUGEPAGE_SYSFS / "nr_hugepages"
    try:
        total = int(nr.read_text())
        nr.write_text(f"{total + (missing + 1) // 2}\n")
    except (OSError, ValueError):
        pass
    return free_hugepages_mb()


def vfio_bound(pci: str) -> bool:
    """True when the PCI device is bound to vfio-pci (DPDK can own it)."""
    driver = Path("/sys/bus/pci/devices") / pci / "driver"
    try:
        return driver.resolve().name == "vfio-pci"
    except OSError:
        return False
