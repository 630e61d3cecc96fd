"""Which data plane an appliance runs, and its command line.

``dataplane: auto`` picks DPDK when DPDK can own the ports: they are NICs
bound to vfio-pci, or a vdev driver (af_xdp, af_packet) is configured for
them, and enough hugepages are free. Otherwise it picks XDP, whose daemon
attaches natively when the driver can and falls back to generic mode.
``hpclb run`` logs the choice and the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyroute2 import NetlinkError

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

log = logging.getLogger(__name__)

# How often a starting forwarder's TAP is looked for.
TAP_POLL_S = 0.01


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
                "(reserve them at boot: hpclb-prepare.service does; or, where hpclb "
                "runs as root, set dpdk.reserve_hugepages)")
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
        "--conn-table-size", str(config.nat.conn_table_size),
        "--xdp-mode", app.xdp.mode.value,
        "--pin-dir", f"/sys/fs/bpf/hpclb/{app.name}",
    ]
    for egress in app.interfaces.egress:
        argv += ["--egress", egress]
    if app.netns:
        argv += ["--netns", app.netns]
    return argv + alive_argv(config)


ALIVE_OPTION = "--alive-interface"


def alive_argv(config: HpclbConfig) -> list[str]:
    """``--alive-interface NAME`` when the VIPs are announced through the data
    plane's liveness interface (bgp.alive_interface): a TUN device the data
    plane creates in its namespace (the speaker's) and holds for its life, so
    that BIRD withdraws the VIPs of a data plane that died, even with `hpclb
    run` dead too. Either data plane takes it last (DPDK: after "--")."""
    if config.bgp is None or config.bgp.alive_interface is None:
        return []
    return [ALIVE_OPTION, config.bgp.alive_interface]


def alive_interface_of(argv: Sequence[str]) -> str | None:
    """The liveness interface a data plane with this command line holds
    (its ``--alive-interface``), None when none."""
    for i, arg in enumerate(argv[:-1]):
        if arg == ALIVE_OPTION:
            return argv[i + 1]
    return None


def running_alive_interface(pid: int | None) -> str | None:
    """The liveness interface the running data plane ``pid`` holds, read from
    its command line (/proc/PID/cmdline): an adopted data plane may have been
    started by an older hpclb or without the `bgp:` section. None when it
    holds none or cannot be read."""
    if pid is None:
        return None
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return alive_interface_of([a.decode(errors="replace") for a in raw.split(b"\0")])


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
        conn_table_size=config.nat.conn_table_size,
    )


def dataplane_argv(config: HpclbConfig, choice: Choice) -> list[str]:
    if choice.kind == Dataplane.DPDK:
        # The forwarder's own options end the vector (after "--").
        return forwarder_argv(dpdk_launch(config)) + alive_argv(config)
    return xdp_argv(config)


def vip_addresses(config: HpclbConfig) -> list[str]:
    """The configured VIP addresses, each once."""
    return sorted({str(v.address) for v in config.vips})


@dataclass
class DpdkHost:
    """What the control plane does around each start of the forwarder.

    The kernel never answers VIP traffic: the VIPs are taken from it
    (``exception_path.claim_vips``: their addresses off its interfaces, a
    blackhole route each) when the forwarder first starts or is adopted, and
    stay taken across its restarts; ``sync_vips`` follows a reload that adds or
    removes VIPs; everything is given back when the forwarder stops for good.

    Around each start, as little as possible delays forwarding: only what must
    precede the new process runs before it (``before_start``: detach the
    AF_XDP program a killed forwarder left); the VIP check and the hand-over of
    the ports' addresses to their TAPs (which the new process creates during
    its EAL init) overlap its start-up (``while_starting``); ``after_ready``
    finishes whatever that could not (an adopted forwarder, a TAP that was
    late). The records live in ``run_dir``, so that a control plane restarted
    later (or the lab) can give back what this one took.

    One netlink socket in the appliance's namespace serves every hook (opened
    on first use, closed by ``after_stop``): entering the namespace costs some
    20 ms, which a restart should not pay.
    """

    config: HpclbConfig
    run_dir: Path
    _nl: exception_path.Netlink | None = field(default=None, repr=False)
    _claimed: tuple[str, ...] | None = field(default=None, repr=False)
    _handed: set[str] = field(default_factory=set, repr=False)  # TAPs of this process

    def _record(self, port: DpdkPort) -> Path:
        return self.run_dir / f"{self.config.appliance.name}.{port.tap}.addresses.json"

    @property
    def vip_record(self) -> Path:
        """Where the VIPs' kernel addresses are recorded (``*.addresses.json``,
        like the ports', so that whatever gives those back gives these too)."""
        return self.run_dir / f"{self.config.appliance.name}.vips.addresses.json"

    def _netlink(self) -> exception_path.Netlink:
        if self._nl is None:
            self._nl = exception_path.open_netlink(self.config.appliance.netns)
        return self._nl

    def _close(self) -> None:
        if self._nl is not None:
            self._nl.close()
            self._nl = None

    def _call(self, fn: Callable[..., Any], *args: object) -> Any:
        """``fn(*args, ipr=<the kept socket>)``; once more on a fresh socket if
        the kept one failed (one left broken by an earlier error)."""
        try:
            return fn(*args, ipr=self._netlink())
        except (OSError, NetlinkError) as err:
            log.debug("%s on the kept netlink socket: %s; again on a new one",
                      getattr(fn, "__name__", fn), err)
            self._close()
            return fn(*args, ipr=self._netlink())

    def claim_vips(self) -> None:
        vips = vip_addresses(self.config)
        self._call(exception_path.claim_vips, vips, self.vip_record, self.config.appliance.netns)
        self._claimed = tuple(vips)

    def sync_vips(self, config: HpclbConfig) -> None:
        """After a reload was pushed: the VIPs it added are taken from the
        kernel, those it removed are given back (their addresses, no blackhole)."""
        self.config = config
        self.claim_vips()

    def _hand_over(self, port: DpdkPort, netns: str | None) -> None:
        assert port.iface and port.tap
        self._call(exception_path.hand_over, port.iface, port.tap, self._record(port), netns)
        self._handed.add(port.tap)

    def before_start(self) -> None:
        self._handed = set()
        launch = dpdk_launch(self.config)
        for port in launch.ports:
            if port.driver == "af_xdp" and port.iface:
                self._call(exception_path.detach_xdp, port.iface, launch.netns)

    def while_starting(self, starting: Callable[[], bool]) -> None:
        """While the new forwarder starts: the VIPs (a check, after the first
        start), then each TAP's addresses as soon as the TAP exists."""
        if self._claimed != tuple(vip_addresses(self.config)):
            self.claim_vips()
        launch = dpdk_launch(self.config)
        for port in launch.ports:
            if not (port.tap and port.iface):
                continue
            while self._call(exception_path.link_index, port.tap) is None:
                if not starting():
                    return  # after_ready hands over, or the start failed
                time.sleep(TAP_POLL_S)
            self._hand_over(port, launch.netns)

    def after_ready(self) -> None:
        launch = dpdk_launch(self.config)
        for port in launch.ports:
            if port.tap and port.iface and port.tap not in self._handed:
                self._hand_over(port, launch.netns)
        if self._claimed != tuple(vip_addresses(self.config)):
            self.claim_vips()  # adopted: nothing ran before

    def after_stop(self) -> None:
        launch = dpdk_launch(self.config)
        try:
            for port in launch.ports:
                if port.tap:
                    self._call(exception_path.give_back, self._record(port), launch.netns)
            self._call(exception_path.give_back, self.vip_record, launch.netns)
            self._claimed = None
            self._handed = set()
        finally:
            self._close()
