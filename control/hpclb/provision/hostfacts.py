"""Read-only facts about the host that provisioning decides from.

Two sources: a sysfs tree (``/sys`` on a host, a fake tree in tests) for what
hardware is there (PCI functions, their driver, NUMA node and IOMMU group; the
CPUs of each node; the hugepage pools; whether vfio-pci is loaded), and
netlink (pyroute2, in the calling thread's network namespace) for what the
operator uses: each link's addresses and which links carry a default route.

Links are listed from netlink, not from ``/sys/class/net``: a sysfs mount
shows the devices of the namespace it was mounted in, so a thread that stepped
into another namespace (tests, ``hpclb.host.netns.inside``) would otherwise see
the wrong ones. Sysfs only adds the device details, by name.

Nothing here changes anything.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from ipaddress import ip_address, ip_interface
from pathlib import Path

PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
HUGEPAGE_2M = "hugepages-2048kB"
# PCI class 0x02xxxx: network controllers (Ethernet 0x0200, others 0x0280...).
NETWORK_CLASS = 0x02


@dataclass(frozen=True)
class Nic:
    """A kernel network interface as the operator sees it."""

    name: str
    mac: str = ""
    pci: str | None = None  # its PCI function, None for virtual or non-PCI devices
    driver: str | None = None
    numa_node: int | None = None  # None: unknown (-1 in sysfs, or no device)
    # Global-scope addresses ("192.0.2.5/24", "2001:db8::5/64"); link-local
    # ones are left out (every IPv6 link has one: nobody "uses" it).
    addresses: tuple[str, ...] = ()
    default_v4: bool = False
    default_v6: bool = False

    @property
    def default_route(self) -> bool:
        return self.default_v4 or self.default_v6


@dataclass(frozen=True)
class PciNic:
    """A network-class PCI function, with or without a kernel interface (one
    bound to vfio-pci has none)."""

    address: str
    driver: str | None = None
    numa_node: int | None = None
    iommu_group: str | None = None
    netdevs: tuple[str, ...] = ()


@dataclass(frozen=True)
class HugePool:
    nr: int
    free: int


@dataclass(frozen=True)
class NetState:
    """What netlink says, in a form tests can write by hand."""

    links: Mapping[str, str] = field(default_factory=dict)  # name -> MAC
    addresses: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # global scope only
    default_v4: frozenset[str] = frozenset()
    default_v6: frozenset[str] = frozenset()


@dataclass(frozen=True)
class HostFacts:
    nics: dict[str, Nic]
    pci_nics: dict[str, PciNic]
    cpus_by_node: dict[int, tuple[int, ...]]
    iommu_groups: int = 0
    # IOMMU group -> ((PCI address, driver or None), ...): vfio-pci takes a
    # whole group or nothing.
    group_devices: dict[str, tuple[tuple[str, str | None], ...]] = field(default_factory=dict)
    vfio_pci: bool = False  # loaded, built in, or a module the kernel can load
    noiommu: bool = False  # vfio's unsafe no-IOMMU mode is on (never turned on by hpclb)
    # 2 MB pools per NUMA node; node 0 holds the global pool on a host without NUMA.
    hugepages_2m: dict[int, HugePool] = field(default_factory=dict)
    numa: bool = False  # /sys/devices/system/node exists
    systemd: bool = False  # systemd is PID 1 (/run/systemd/system)
    ssh_address: str | None = None  # the server side of $SSH_CONNECTION
    kernel_cmdline: str = ""
    thread_siblings: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(c for cpus in self.cpus_by_node.values() for c in cpus))

    def node_of_cpu(self, cpu: int) -> int | None:
        for node, cpus in self.cpus_by_node.items():
            if cpu in cpus:
                return node
        return None

    def nic_of_address(self, address: str) -> str | None:
        """The interface holding ``address`` (no prefix length), or None."""
        want = ip_address(address)
        for nic in self.nics.values():
            if any(ip_interface(a).ip == want for a in nic.addresses):
                return nic.name
        return None

    def ssh_nic(self) -> str | None:
        """The interface the operator's SSH connection arrived on."""
        if not self.ssh_address:
            return None
        address, _, zone = self.ssh_address.partition("%")
        if zone:  # fe80::1%eth0: a link-local address names its interface
            return zone if zone in self.nics else None
        try:
            return self.nic_of_address(address)
        except ValueError:
            return None

    def knows(self, name_or_pci: str) -> bool:
        """Whether the port exists here: an interface, or a network PCI function."""
        netdev, pci = self.resolve(name_or_pci)
        return (netdev is not None and netdev in self.nics) or (pci is not None
                                                                 and pci in self.pci_nics)

    def resolve(self, name_or_pci: str) -> tuple[str | None, str | None]:
        """(kernel interface, PCI address) of a port named either way; either
        may be None (a virtual interface has no PCI address, a function bound
        to vfio-pci has no interface)."""
        if PCI_ADDRESS.match(name_or_pci):
            pci = name_or_pci.lower()
            fn = self.pci_nics.get(pci)
            netdevs = (fn.netdevs if fn else ()) or tuple(
                n.name for n in self.nics.values() if n.pci == pci)
            return (netdevs[0] if netdevs else None), pci
        nic = self.nics.get(name_or_pci)
        return name_or_pci, (nic.pci if nic else None)

    def numa_node_of(self, name_or_pci: str) -> int | None:
        netdev, pci = self.resolve(name_or_pci)
        if pci and pci in self.pci_nics:
            return self.pci_nics[pci].numa_node
        nic = self.nics.get(netdev or "")
        return nic.numa_node if nic else None


# --- sysfs ------------------------------------------------------------------

def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    text = _read(path)
    try:
        if text is None:
            return None
        return int(text, 16) if text.lower().startswith("0x") else int(text)
    except ValueError:
        return None


def _link_name(path: Path) -> str | None:
    """The last component of a symlink's target (a driver, a device)."""
    try:
        return Path(os.readlink(path)).name if path.is_symlink() else None
    except OSError:
        return None


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``0-3,8,10-11`` -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return tuple(sorted(set(cpus)))


def format_cpulist(cpus: Iterable[int]) -> str:
    """(1, 2, 3, 5) -> ``1-3,5``: the kernel command line's own notation."""
    out: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [cpu]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _numa(value: int | None) -> int | None:
    return value if value is not None and value >= 0 else None


def _pci_nics(sysfs: Path) -> dict[str, PciNic]:
    out: dict[str, PciNic] = {}
    devices = sysfs / "bus/pci/devices"
    if not devices.is_dir():
        return out
    for dev in sorted(devices.iterdir()):
        cls = _int(dev / "class")
        if cls is None or cls >> 16 != NETWORK_CLASS:
            continue
        # A virtio function's interface hangs one level down (0000:00:03.0/virtio2/net).
        netdevs = tuple(sorted({p.name for net in (dev / "net", *dev.glob("*/net"))
                                if net.is_dir() for p in net.iterdir()}))
        out[dev.name.lower()] = PciNic(
            address=dev.name.lower(), driver=_link_name(dev / "driver"),
            numa_node=_numa(_int(dev / "numa_node")),
            iommu_group=_link_name(dev / "iommu_group"), netdevs=netdevs)
    return out


def _nic(sysfs: Path, name: str, mac: str, net: NetState) -> Nic:
    device = sysfs / "class/net" / name / "device"
    pci = None
    numa = _numa(_int(device / "numa_node"))
    if device.exists():
        # The PCI function is the device itself or, for virtio, its parent
        # (.../0000:00:03.0/virtio2): the nearest PCI address up the path.
        real = Path(os.path.realpath(device))
        for up in (real, *real.parents):
            if PCI_ADDRESS.match(up.name):
                pci = up.name.lower()
                if numa is None:
                    numa = _numa(_int(up / "numa_node"))
                break
    return Nic(name=name, mac=mac, pci=pci, driver=_link_name(device / "driver"),
               numa_node=numa,
               addresses=tuple(net.addresses.get(name, ())),
               default_v4=name in net.default_v4, default_v6=name in net.default_v6)


def _cpus_by_node(sysfs: Path) -> tuple[dict[int, tuple[int, ...]], bool]:
    nodes = sysfs / "devices/system/node"
    out: dict[int, tuple[int, ...]] = {}
    if nodes.is_dir():
        for node in nodes.glob("node[0-9]*"):
            cpus = parse_cpulist(_read(node / "cpulist") or "")
            if cpus:
                out[int(node.name[4:])] = cpus
    if out:
        return dict(sorted(out.items())), True
    online = _read(sysfs / "devices/system/cpu/online")
    cpus = parse_cpulist(online) if online else tuple(range(os.cpu_count() or 1))
    return {0: cpus}, False


def _siblings(sysfs: Path, cpus: Iterable[int]) -> dict[int, tuple[int, ...]]:
    out = {}
    for cpu in cpus:
        text = _read(sysfs / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        out[cpu] = parse_cpulist(text) if text else (cpu,)
    return out


def _hugepages(sysfs: Path, numa: bool) -> dict[int, HugePool]:
    out: dict[int, HugePool] = {}
    if numa:
        for node in (sysfs / "devices/system/node").glob("node[0-9]*"):
            pool = node / "hugepages" / HUGEPAGE_2M
            nr, free = _int(pool / "nr_hugepages"), _int(pool / "free_hugepages")
            if nr is not None:
                out[int(node.name[4:])] = HugePool(nr, free or 0)
    if not out:
        pool = sysfs / "kernel/mm/hugepages" / HUGEPAGE_2M
        nr, free = _int(pool / "nr_hugepages"), _int(pool / "free_hugepages")
        if nr is not None:
            out[0] = HugePool(nr, free or 0)
    return dict(sorted(out.items()))


def _group_devices(sysfs: Path) -> dict[str, tuple[tuple[str, str | None], ...]]:
    out: dict[str, tuple[tuple[str, str | None], ...]] = {}
    groups = sysfs / "kernel/iommu_groups"
    if not groups.is_dir():
        return out
    for group in sorted(groups.iterdir(), key=lambda g: g.name):
        devices = group / "devices"
        members = sorted(devices.iterdir()) if devices.is_dir() else []
        out[group.name] = tuple((d.name.lower(), _link_name(d / "driver")) for d in members)
    return out


def _vfio_available(sysfs: Path, modules: Path, release: str) -> bool:
    if (sysfs / "module/vfio_pci").exists():
        return True  # loaded or built in
    for name in ("modules.dep", "modules.builtin"):
        text = _read(modules / release / name)
        if text and re.search(r"(^|/)vfio-pci\.ko", text, re.MULTILINE):
            return True
    return False


# --- netlink ----------------------------------------------------------------

def read_netlink() -> NetState:
    """Links, global addresses and default-route interfaces of the calling
    thread's network namespace."""
    from pyroute2 import IPRoute  # imported here: unit tests never need netlink

    links: dict[str, str] = {}
    names: dict[int, str] = {}
    addresses: dict[str, list[str]] = {}
    defaults: dict[int, set[str]] = {socket.AF_INET: set(), socket.AF_INET6: set()}
    with IPRoute() as ipr:
        for link in ipr.get_links():
            name = link.get_attr("IFLA_IFNAME")
            names[link["index"]] = name
            links[name] = link.get_attr("IFLA_ADDRESS") or ""
        for addr in ipr.get_addr():
            if addr["scope"] != 0:  # RT_SCOPE_UNIVERSE only: not host, not link
                continue
            value = addr.get_attr("IFA_LOCAL") or addr.get_attr("IFA_ADDRESS")
            name = names.get(addr["index"])
            if name and value:
                addresses.setdefault(name, []).append(f"{value}/{addr['prefixlen']}")
        for family, routes in defaults.items():
            for route in ipr.get_routes(family=family):
                # Any table but local (255): a policy-routing table's default
                # route carries traffic just the same.
                if route["dst_len"] != 0 or route.get_attr("RTA_TABLE") == 255:
                    continue
                if route["type"] != 1:  # RTN_UNICAST: not unreachable/blackhole
                    continue
                oif = route.get_attr("RTA_OIF")
                if oif in names:
                    routes.add(names[oif])
                for hop in route.get_attr("RTA_MULTIPATH") or []:
                    if hop["oif"] in names:
                        routes.add(names[hop["oif"]])
    return NetState(links=links, addresses={k: tuple(v) for k, v in addresses.items()},
                    default_v4=frozenset(defaults[socket.AF_INET]),
                    default_v6=frozenset(defaults[socket.AF_INET6]))


# --- all of it --------------------------------------------------------------

def gather(sysfs: Path = Path("/sys"), *, net: NetState | None = None, run: Path = Path("/run"),
           proc: Path = Path("/proc"), modules: Path = Path("/lib/modules"),
           ssh_connection: str | None = None, release: str | None = None) -> HostFacts:
    """The host's facts. ``net`` None reads netlink in the current namespace;
    ``ssh_connection`` None reads ``$SSH_CONNECTION`` ("client port server
    port": the server address is the one the operator came in on)."""
    if net is None:
        net = read_netlink()
    if ssh_connection is None:
        ssh_connection = os.environ.get("SSH_CONNECTION", "")
    parts = ssh_connection.split()
    cpus_by_node, numa = _cpus_by_node(sysfs)
    groups = sysfs / "kernel/iommu_groups"
    return HostFacts(
        nics={name: _nic(sysfs, name, mac, net) for name, mac in sorted(net.links.items())},
        pci_nics=_pci_nics(sysfs),
        cpus_by_node=cpus_by_node,
        iommu_groups=len(list(groups.iterdir())) if groups.is_dir() else 0,
        group_devices=_group_devices(sysfs),
        vfio_pci=_vfio_available(sysfs, modules, release or os.uname().release),
        noiommu=(_read(sysfs / "module/vfio/parameters/enable_unsafe_noiommu_mode") or "N")
        in ("Y", "1"),
        hugepages_2m=_hugepages(sysfs, numa),
        numa=numa,
        systemd=(run / "systemd/system").is_dir(),
        ssh_address=parts[2] if len(parts) >= 4 else None,
        kernel_cmdline=_read(proc / "cmdline") or "",
        thread_siblings=_siblings(sysfs, [c for cs in cpus_by_node.values() for c in cs]),
    )


# --- a fake sysfs tree (tests, golden files: H1's and H4's too) --------------

@dataclass(frozen=True)
class FakePci:
    """A network PCI function of a fake tree; ``netdev`` None: no interface
    (bound to vfio-pci); ``virtio``: the interface hangs one level down."""

    address: str
    netdev: str | None = None
    driver: str = "ixgbe"
    numa_node: int = -1
    iommu_group: int | None = None
    virtio: bool = False


def write_fake_sysfs(root: Path, *, nodes: Mapping[int, str] | None = None,
                     pci: Iterable[FakePci] = (), virtual: Iterable[str] = (),
                     hugepages: Mapping[int, int] | None = None, vfio_loaded: bool = False,
                     siblings: Mapping[int, str] | None = None) -> Path:
    """Write a sysfs-like tree under ``root`` (created) and return it.

    ``nodes``: NUMA node -> cpulist ("0-3"); None: no NUMA directory, CPUs
    0-1 online. ``pci``: network functions; ``virtual``: interfaces with no
    device (veth, bridge). ``hugepages``: node -> nr_hugepages (2 MB).
    IOMMU groups exist for functions that name one."""
    def put(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    root.mkdir(parents=True, exist_ok=True)
    if nodes is None:
        put(root / "devices/system/cpu/online", "0-1")
        nr = (hugepages or {}).get(0, 0)  # the global pool
        put(root / f"kernel/mm/hugepages/{HUGEPAGE_2M}/nr_hugepages", str(nr))
        put(root / f"kernel/mm/hugepages/{HUGEPAGE_2M}/free_hugepages", str(nr))
    else:
        for node, cpulist in nodes.items():
            base = root / f"devices/system/node/node{node}"
            put(base / "cpulist", cpulist)
            nr = (hugepages or {}).get(node, 0)
            put(base / "hugepages" / HUGEPAGE_2M / "nr_hugepages", str(nr))
            put(base / "hugepages" / HUGEPAGE_2M / "free_hugepages", str(nr))
    for cpu, text in (siblings or {}).items():
        put(root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", text)
    drivers = root / "bus/pci/drivers"
    (root / "kernel/iommu_groups").mkdir(parents=True, exist_ok=True)
    for fn in pci:
        dev = root / "devices/pci0000:00" / fn.address
        put(dev / "class", "0x020000")
        put(dev / "numa_node", str(fn.numa_node))
        (drivers / fn.driver).mkdir(parents=True, exist_ok=True)
        (dev / "driver").symlink_to(os.path.relpath(drivers / fn.driver, dev))
        if fn.iommu_group is not None:
            group = root / "kernel/iommu_groups" / str(fn.iommu_group)
            (group / "devices").mkdir(parents=True, exist_ok=True)
            (dev / "iommu_group").symlink_to(os.path.relpath(group, dev))
            (group / "devices" / fn.address).symlink_to(os.path.relpath(dev, group / "devices"))
        link = root / "bus/pci/devices" / fn.address
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(dev, link.parent))
        if fn.netdev:
            holder = dev / "virtio0" if fn.virtio else dev
            (holder / "net" / fn.netdev).mkdir(parents=True, exist_ok=True)
            cls = root / "class/net" / fn.netdev
            cls.mkdir(parents=True, exist_ok=True)
            (cls / "device").symlink_to(os.path.relpath(holder, cls))
            if fn.virtio:
                (drivers / "virtio_net").mkdir(parents=True, exist_ok=True)
                (holder / "driver").symlink_to(os.path.relpath(drivers / "virtio_net", holder))
    for name in virtual:
        (root / "class/net" / name).mkdir(parents=True, exist_ok=True)
    if vfio_loaded:
        (root / "module/vfio_pci").mkdir(parents=True, exist_ok=True)
    return root
