"""The data NICs: binding them to vfio-pci for DPDK, or falling back to XDP.

Binding takes a NIC away from the kernel: its addresses and routes go with it.
So a NIC is refused (:class:`~hpclb.provision.plan.ProvisionRefused`, exit 3,
nothing changed) when it is

* the management NIC (named with ``--management``, or holding the
  configuration's management address),
* carrying a default route (IPv4 or IPv6, any table but ``local``),
* holding a global address (the operator reaches something through it),
* the NIC the operator's SSH connection came in on (``$SSH_CONNECTION``).

``dpdk-devbind.py`` itself refuses an "Active" interface (one with routes)
unless ``--force`` is given; hpclb never gives it.

A Mellanox/NVIDIA ConnectX function (``mlx5_core``, ``mlx4_core``) is not
bound at all: DPDK's driver for it works beside the kernel's (bifurcated), so
it needs neither vfio-pci nor an IOMMU; the refusals hold for it all the same
(DPDK would take the traffic the host relies on). Every other NIC
needs vfio-pci and an IOMMU. Without them the plan falls back to XDP and
says why: hpclb never turns on vfio's ``enable_unsafe_noiommu_mode`` (a
device could then DMA anywhere in memory). ``dataplane: auto`` also falls back
where ``dpdk`` would be refused, or where a port is not a PCI function.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import ip_address
from pathlib import Path
from typing import Any, Literal

from hpclb.provision import actions as generic
from hpclb.provision.hostfacts import PCI_ADDRESS, HostFacts
from hpclb.provision.plan import Action, BaseAction, Context, Note, ProvisionError, ProvisionRefused

Runner = Callable[[Sequence[str]], None]
VFIO = "vfio-pci"
#: What may share an IOMMU group with a bound port: nothing bound, vfio-pci or
#: pci-stub, and PCIe ports (bridges, which vfio allows in a group).
GROUP_NEIGHBOURS = frozenset({None, "vfio-pci", "pci-stub", "pcieport"})
#: Drivers that leave a function without a kernel interface on purpose.
UNCLAIMED = frozenset({None, "vfio-pci", "pci-stub", "uio_pci_generic", "igb_uio"})
#: Kernel drivers DPDK works beside (its mlx4/mlx5 drivers use them): never unbound.
BIFURCATED = frozenset({"mlx4_core", "mlx5_core"})
DEVBIND = "dpdk-devbind.py"  # Debian's dpdk package installs it in /usr/bin


def run_checked(argv: Sequence[str]) -> None:
    """Run a command; a failure is a ProvisionError with its last line."""
    generic.run(argv, argv[0])


@dataclass(frozen=True)
class NicPlan:
    """What the written configuration says about the data ports, and the
    actions that make it true."""

    # What the written configuration should say: "auto" only where the
    # configuration's DPDK vdev driver (af_xdp, af_packet) needs no binding.
    dataplane: Literal["dpdk", "xdp", "auto"]
    ingress: str  # a PCI address when ``pci``, else a kernel interface name
    egress: list[str]
    pci: bool  # the ports are PCI functions bound to vfio-pci (dpdk.driver: pci)
    numa_nodes: list[int | None]  # per port, ingress first
    message: str | None = None  # why DPDK was not possible (the fallback's reason)
    actions: list[Action] = field(default_factory=list)


def refusal_reasons(facts: HostFacts, port: str, *, management: str | None = None,
                    management_address: str | None = None) -> list[str]:
    """Why binding ``port`` (an interface name or a PCI address) would cut
    something off; [] when it may be bound."""
    netdev, pci = facts.resolve(port)
    reasons: list[str] = []
    if management:
        m_netdev, m_pci = facts.resolve(management)
        if (netdev and netdev == m_netdev) or (pci and pci == m_pci):
            reasons.append("it is the management NIC")
    if management_address:
        holder = facts.nic_of_address(str(ip_address(management_address)))
        if holder and holder == netdev:
            reasons.append(f"it holds the management address {management_address}")
    fn = facts.pci_nics.get(pci or "")
    if netdev is None and fn is not None and fn.driver not in UNCLAIMED:
        # A kernel driver holds it, yet no interface of it is visible here:
        # moved to another network namespace. Its addresses cannot be checked.
        reasons.append(f"its driver {fn.driver} holds it but its interface is not in this "
                       "network namespace (moved to another?): its addresses cannot be checked")
    nic = facts.nics.get(netdev or "")
    if nic is not None:
        if nic.default_v4:
            reasons.append("it carries the IPv4 default route")
        if nic.default_v6:
            reasons.append("it carries the IPv6 default route")
        if nic.addresses:
            reasons.append(f"it holds {', '.join(nic.addresses)}")
        if netdev and netdev == facts.ssh_nic():
            reasons.append(f"the SSH connection ({facts.ssh_address}) came in on it")
    return reasons


def _label(facts: HostFacts, port: str) -> str:
    netdev, pci = facts.resolve(port)
    if netdev and pci and netdev != port:
        return f"{port} ({netdev})"
    if netdev and pci:
        return f"{port} ({pci})"
    return port


def check_bindable(facts: HostFacts, ports: Sequence[str], *, management: str | None = None,
                   management_address: str | None = None) -> None:
    """Raise ProvisionRefused naming every port that must not be bound, and why."""
    problems = []
    for port in ports:
        reasons = refusal_reasons(facts, port, management=management,
                                  management_address=management_address)
        if reasons:
            problems.append(f"{_label(facts, port)}: {'; '.join(reasons)}")
    if problems:
        raise ProvisionRefused("refusing to bind to vfio-pci (the host would lose what it "
                               "reaches through it): " + " | ".join(problems))


def bifurcated(facts: HostFacts, port: str) -> bool:
    """Whether DPDK drives the port's function in place, beside its kernel
    driver (Mellanox/NVIDIA ConnectX: mlx5_core, mlx4_core). Such a function
    must NOT be bound to vfio-pci: DPDK's mlx5 driver talks to mlx5_core."""
    _, pci = facts.resolve(port)
    fn = facts.pci_nics.get(pci or "")
    return fn is not None and fn.driver in BIFURCATED


def vfio_ports(facts: HostFacts, ports: Sequence[str]) -> list[str]:
    """The PCI addresses of the ports that vfio-pci must take."""
    return [facts.resolve(p)[1] or p for p in ports if not bifurcated(facts, p)]


def _binding_actions(facts: HostFacts, ports: Sequence[str], devbind: str, sysfs: Path,
                     runner: Runner) -> list[Action]:
    out: list[Action] = [Note(line=f"nics: {_label(facts, p)} keeps its kernel driver "
                              f"({facts.pci_nics[facts.resolve(p)[1] or ''].driver}): DPDK "
                              "drives it in place (bifurcated), nothing to bind")
                         for p in ports if bifurcated(facts, p)]
    pcis = vfio_ports(facts, ports)
    if pcis:
        out.append(LoadVfio(sysfs=sysfs, runner=runner))
        out += [BindVfio(pci.lower(), facts.resolve(pci)[0], devbind=devbind, sysfs=sysfs,
                         runner=runner) for pci in pcis]
    return out


def vfio_blocker(facts: HostFacts, ports: Sequence[str]) -> str | None:
    """Why vfio-pci cannot take these ports here, or None."""
    for port in ports:
        _, pci = facts.resolve(port)
        if pci is None:
            return (f"{port} is not a PCI function (a virtual or platform device): "
                    "vfio-pci cannot take it")
    ports = [p for p in ports if not bifurcated(facts, p)]
    if not ports:
        return None  # all driven in place: no vfio-pci, no IOMMU needed
    if not facts.vfio_pci:
        return "the vfio-pci module is not available for this kernel"
    if facts.iommu_groups == 0:
        return ("no IOMMU (/sys/kernel/iommu_groups is empty): turn on VT-d or AMD-Vi in the "
                "firmware and add intel_iommu=on iommu=pt (Intel) to the kernel command line; "
                "hpclb never uses vfio's unsafe no-IOMMU mode")
    taken = {facts.resolve(p)[1] for p in ports}
    for port in ports:
        _, pci = facts.resolve(port)
        fn = facts.pci_nics.get(pci or "")
        if fn is None:
            continue
        if fn.iommu_group is None:
            return f"{port} has no IOMMU group"
        others = [(addr, driver) for addr, driver in facts.group_devices.get(fn.iommu_group, ())
                  if addr not in taken and driver not in GROUP_NEIGHBOURS]
        if others:
            shown = ", ".join(f"{a} ({d})" for a, d in others)
            return (f"IOMMU group {fn.iommu_group} of {port} also holds {shown}: vfio-pci "
                    "takes a whole group or nothing (make those ports data ports too, or "
                    "use a slot behind a switch with ACS)")
    return None


def plan_nics(facts: HostFacts, ingress: str, egress: Sequence[str], *,
              dataplane: Literal["dpdk", "xdp", "auto"], management: str | None = None,
              management_address: str | None = None, devbind: str = DEVBIND,
              sysfs: Path = Path("/sys"), runner: Runner = run_checked) -> NicPlan:
    """Decide the data plane's ports. ``dpdk``: bind (refusals raise) or fall
    back to XDP when vfio-pci/the IOMMU is missing; ``auto``: the same, but a
    refusal is a reason to fall back too; ``xdp``: kernel names, nothing bound."""
    ports = [ingress, *egress]
    unknown = [p for p in ports if not facts.knows(p)]
    if unknown:
        raise ProvisionError(f"no interface or network PCI function {', '.join(unknown)} on "
                             "this host (a NIC already bound to vfio-pci has no interface "
                             "name: give its PCI address)")
    nodes = [facts.numa_node_of(p) for p in ports]
    if dataplane != "xdp":
        refused: str | None = None
        try:
            check_bindable(facts, ports, management=management,
                           management_address=management_address)
        except ProvisionRefused as exc:
            if dataplane == "dpdk":
                raise
            refused = str(exc)
        blocker = refused or vfio_blocker(facts, ports)
        if blocker is None:
            pcis = [facts.resolve(p)[1] or p for p in ports]
            return NicPlan("dpdk", pcis[0], pcis[1:], True, nodes, None,
                           _binding_actions(facts, ports, devbind, sysfs, runner))
        message = f"dataplane: {dataplane} falls back to xdp: {blocker}"
        return NicPlan("xdp", *_kernel_names(facts, ports), False, nodes, message,
                       [Note(line=f"fallback: {message}")])
    return NicPlan("xdp", *_kernel_names(facts, ports), False, nodes)


def _kernel_names(facts: HostFacts, ports: Sequence[str]) -> tuple[str, list[str]]:
    names = []
    for port in ports:
        netdev, pci = facts.resolve(port)
        if netdev is None:
            fn = facts.pci_nics.get(pci or "")
            raise ProvisionError(f"{port} has no kernel interface (driver "
                                 f"{fn.driver if fn else 'none'}): XDP needs one; give "
                                 "interface names, or bind it back to its kernel driver")
        names.append(netdev)
    return names[0], names[1:]


# --- actions ----------------------------------------------------------------

def pci_driver(sysfs: Path, pci: str) -> str | None:
    link = sysfs / "bus/pci/devices" / pci / "driver"
    try:
        return Path(os.readlink(link)).name
    except OSError:
        return None


@dataclass
class LoadVfio(BaseAction):
    """``modprobe vfio-pci`` unless it is loaded (or built in)."""

    sysfs: Path = Path("/sys")
    runner: Runner = run_checked
    live_only: bool = True

    def describe(self) -> str:
        return "load the vfio-pci module"

    def pending(self, ctx: Context) -> list[str]:
        return [] if (self.sysfs / "module/vfio_pci").exists() else ["modprobe vfio-pci"]

    def apply(self, ctx: Context) -> None:
        self.runner(["modprobe", VFIO])


@dataclass
class BindVfio(BaseAction):
    """One PCI function bound to vfio-pci with dpdk-devbind.py (never --force)."""

    pci: str = ""
    netdev: str | None = None
    devbind: str = DEVBIND
    sysfs: Path = Path("/sys")
    runner: Runner = run_checked
    live_only: bool = True

    def describe(self) -> str:
        return f"bind {self.pci}" + (f" ({self.netdev})" if self.netdev else "") + " to vfio-pci"

    def pending(self, ctx: Context) -> list[str]:
        driver = pci_driver(self.sysfs, self.pci)
        return [] if driver == VFIO else [f"driver {driver or 'none'} -> {VFIO}"]

    def apply(self, ctx: Context) -> None:
        self.runner([self.devbind, f"--bind={VFIO}", self.pci])


# --- from a configuration (a plain mapping, as H1's gateway plan holds it) ----

def _ports(config: Mapping[str, Any]) -> tuple[dict[str, Any], str, list[str]]:
    app = config.get("appliance") or {}
    interfaces = app.get("interfaces") or {}
    return app, str(interfaces.get("ingress", "")), [str(e) for e in interfaces.get("egress", [])]


def plan_for_config(facts: HostFacts, config: Mapping[str, Any], *,
                    management: str | None = None, devbind: str = DEVBIND,
                    sysfs: Path = Path("/sys"), runner: Runner = run_checked) -> NicPlan:
    """:func:`plan_nics` for a draft configuration (``appliance.dataplane``,
    ``interfaces``, ``management_address``): what a new configuration should
    say (the dataplane after any fallback, the ports as PCI addresses when
    they are to be bound) and the actions."""
    app, ingress, egress = _ports(config)
    dataplane = str(app.get("dataplane", "auto"))
    if dataplane not in ("dpdk", "xdp", "auto"):
        raise ProvisionError(f"appliance.dataplane: {dataplane!r} is not dpdk, xdp or auto")
    if (app.get("dpdk") or {}).get("driver") in ("af_xdp", "af_packet") and dataplane != "xdp":
        # A vdev wraps the kernel interface: DPDK without binding anything.
        ports = [ingress, *egress]
        return NicPlan(dataplane, *_kernel_names(facts, ports), False,  # type: ignore[arg-type]
                       [facts.numa_node_of(p) for p in ports])
    address = app.get("management_address")
    return plan_nics(facts, ingress, egress, dataplane=dataplane,  # type: ignore[arg-type]
                     management=management,
                     management_address=str(address) if address else None,
                     devbind=devbind, sysfs=sysfs, runner=runner)


def actions(ctx: Context, facts: HostFacts, config: Mapping[str, Any], *,
            management: str | None = None, devbind: str = DEVBIND,
            sysfs: Path = Path("/sys"), runner: Runner = run_checked) -> list[Action]:
    """H1's entry: :func:`config_actions`."""
    del ctx
    return config_actions(facts, config, management=management, devbind=devbind, sysfs=sysfs,
                          runner=runner)


def config_actions(facts: HostFacts, config: Mapping[str, Any], *,
                   management: str | None = None, devbind: str = DEVBIND,
                   sysfs: Path = Path("/sys"), runner: Runner = run_checked) -> list[Action]:
    """The binding the configuration in force needs: vfio-pci for PCI ports
    (refusals raise ProvisionRefused), nothing for kernel interfaces. A kept
    configuration is never rewritten, so where vfio-pci cannot take its PCI
    ports this warns (hpclb.service will not start) instead of falling back."""
    app, ingress, egress = _ports(config)
    ports = [ingress, *egress]
    if not all(PCI_ADDRESS.match(p) for p in ports) or app.get("dataplane") == "xdp":
        return []
    address = app.get("management_address")
    check_bindable(facts, ports, management=management,
                   management_address=str(address) if address else None)
    blocker = vfio_blocker(facts, ports)
    if blocker:
        return [Note(line=f"warning: the configuration's PCI ports cannot be bound to vfio-pci "
                     f"here ({blocker}); the DPDK forwarder will not start: give interface "
                     "names and dataplane: xdp in /etc/hpclb/hpclb.yaml")]
    return _binding_actions(facts, ports, devbind, sysfs, runner)
