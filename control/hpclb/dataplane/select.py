"""Which data plane an appliance runs, and its command line.

``dataplane: auto`` picks DPDK when DPDK can own the ports: they are NICs
bound to vfio-pci, or a vdev driver (af_xdp, af_packet) is configured for
them, and enough hugepages are free. Otherwise it picks XDP, whose daemon
attaches natively when the driver can and falls back to generic mode.
``hpclb run`` logs the choice and the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from hpclb.config import Dataplane, DpdkDriver, HpclbConfig
from hpclb.dataplane import exception_path
from hpclb.dataplane.dpdk import (
    DpdkLaunch,
    DpdkPort,
    find_dpdk_forwarder,
    forwarder_argv,
    free_hugepages_mb,
    reserve_hugepages,
    vfio_bound,
)
from hpclb.dataplane.supervisor import find_xdp_daemon

log = logging.getLogger("hpclb.select")


@dataclass(frozen=True)
class Choice:
    kind: Dataplane  # XDP or DPDK, never AUTO
    reason: str


def _dpdk_blocker(config: HpclbConfig) -> str | None:
    """Why DPDK cannot run here, or None when it can."""
    app = config.appliance
    try:
        find_dpdk_forwarder()
    except FileNotFoundError as exc:
        return str(exc)
    names = [app.interfaces.ingress, *app.interfaces.egress]
    if app.pci_ports:
        unbound = [n for n in names if not vfio_bound(n)]
        if unbound:
            return f"{', '.join(unbound)} not bound to vfio-pci"
    elif app.dpdk.driver is None:
        return "the ports are kernel interfaces and no DPDK vdev driver is configured"
    free = free_hugepages_mb()
    if free < app.dpdk.hugepages_mb and app.dpdk.reserve_hugepages:
        free = reserve_hugepages(app.dpdk.hugepages_mb)
    if free < app.dpdk.hugepages_mb:
        return (f"{free} MB of 2 MB hugepages free, {app.dpdk.hugepages_mb} MB needed "
                "(reserve them at boot, or set dpdk.reserve_hugepages)")
    return None


def choose_dataplane(config: HpclbConfig) -> Choice:
    app = config.appliance
    if app.dataplane == Dataplane.XDP:
        return Choice(Dataplane.XDP, "configured")
    blocker = _dpdk_blocker(config)
    if app.dataplane == Dataplane.DPDK and blocker:
        raise RuntimeError(f"dataplane: dpdk cannot run: {blocker}")
    if app.pci_ports and blocker:
        raise RuntimeError(f"no data plane can run: DPDK cannot ({blocker}) and XDP needs "
                           "kernel interface names, not PCI addresses")
    if app.dataplane == Dataplane.DPDK:
        return Choice(Dataplane.DPDK, "configured")
    if blocker is None:
        how = "ports bound to vfio-pci" if app.pci_ports else f"{app.dpdk.driver} vdev configured"
        return Choice(Dataplane.DPDK, f"auto: {how}, hugepages reserved")
    return Choice(Dataplane.XDP, f"auto: DPDK cannot run ({blocker}); XDP "
                  f"{app.xdp.mode.value} (the daemon falls back to generic when native fails)")


def xdp_argv(config: HpclbConfig) -> list[str]:
    """Command line of the XDP daemon for this configuration."""
    app = config.appliance
    argv = [
        find_xdp_daemon(),
        "--iface", app.interfaces.ingress,
        "--socket", app.control_socket,
        "--ring-size", str(app.ring_size),
        "--flow-table-size", str(app.xdp.flow_table_size),
        "--xdp-mode", app.xdp.mode.value,
        "--pin-dir", f"/sys/fs/bpf/hpclb/{app.name}",
    ]
    for egress in app.interfaces.egress:
        argv += ["--egress", egress]
    if app.netns:
        argv += ["--netns", app.netns]
    return argv


def dpdk_launch(config: HpclbConfig) -> DpdkLaunch:
    app = config.appliance
    d = app.dpdk
    driver = DpdkDriver.PCI if app.pci_ports else (d.driver or DpdkDriver.AF_XDP)
    ports = []
    for i, name in enumerate([app.interfaces.ingress, *app.interfaces.egress]):
        tap = f"{d.tap_prefix}{i}" if d.exception_path else None
        if driver == DpdkDriver.PCI:
            ports.append(DpdkPort(i, "pci", pci=name, tap=tap))
        else:
            ports.append(DpdkPort(i, driver.value, iface=name, tap=tap))  # type: ignore[arg-type]
    return DpdkLaunch(
        ports=tuple(ports), socket=app.control_socket, lcores=tuple(d.lcores),
        netns=app.netns, ring_size=app.ring_size, flow_table_size=d.flow_table_size,
        flow_timeout_s=d.flow_timeout_s, idle_sleep_us=d.idle_sleep_us, numa=d.numa.value,
        socket_mem_mb=d.hugepages_mb, file_prefix=f"hpclb-{app.name}",
    )


def dataplane_argv(config: HpclbConfig, choice: Choice) -> list[str]:
    if choice.kind == Dataplane.DPDK:
        return forwarder_argv(dpdk_launch(config))
    return xdp_argv(config)


@dataclass(frozen=True)
class DpdkHost:
    """What the control plane does around each start of the forwarder."""

    config: HpclbConfig
    run_dir: Path

    def _record(self, port: DpdkPort) -> Path:
        return self.run_dir / f"{self.config.appliance.name}.{port.tap}.addresses.json"

    def before_start(self) -> None:
        launch = dpdk_launch(self.config)
        for port in launch.ports:
            if port.driver == "af_xdp" and port.iface:
                exception_path.detach_xdp(port.iface, launch.netns)

    def after_ready(self) -> None:
        launch = dpdk_launch(self.config)
        for port in launch.ports:
            if port.tap and port.iface:
                exception_path.hand_over(port.iface, port.tap, self._record(port), launch.netns)

    def after_stop(self) -> None:
        launch = dpdk_launch(self.config)
        for port in launch.ports:
            if port.tap:
                exception_path.give_back(self._record(port), launch.netns)
