"""2 MB hugepages for the DPDK forwarder: reserved now, at every boot, and mounted.

Where the pages go: DPDK's EAL spreads the ``-m`` memory it preallocates
(``dpdk.hugepages_mb``) over the NUMA nodes of its lcores, in proportion to
how many lcores each node has (22.11: ``eal_dynmem_calc_num_pages_per_socket``
in lib/eal/common/eal_common_dynmem.c). So each node gets
``ceil(hugepages_mb / 2 x lcores on the node / all lcores)`` pages, and with
:mod:`hpclb.provision.cores` putting every lcore on the NICs' node, that is
one node.

Across reboots, two mechanisms, because ``vm.nr_hugepages`` is only the global
pool (the kernel spreads it round-robin over every node with memory):

* a host without NUMA, or with one node: ``vm.nr_hugepages`` in
  ``/etc/sysctl.d/60-hpclb-hugepages.conf``, applied by systemd-sysctl early
  in boot, when memory is least fragmented;
* a host with several nodes: the file holds the per-node numbers as comments
  only, and ``hpclb-prepare.service`` (``python -m hpclb.provision prepare``,
  before hpclb.service) writes each node's
  ``/sys/devices/system/node/nodeN/hugepages/hugepages-2048kB/nr_hugepages``
  at every boot. The kernel command line (``hugepagesz=2M hugepages=N``) was
  not chosen: it also spreads over all nodes, and editing the boot loader's
  configuration is the operator's call.

Pools are grown, never shrunk (something else on the host may use them). The
kernel may grant fewer pages than asked when memory is fragmented: the report
says how many it granted.

hugetlbfs: systemd's own ``dev-hugepages.mount`` mounts it at /dev/hugepages
on every boot (a static unit, nothing to enable), so no fstab line is written;
``prepare`` mounts it there when it is missing (a host without systemd). The
forwarder runs ``--in-memory`` (memfd hugepages), which does not need the
mount; other DPDK tools (dpdk-testpmd, dpdk-proc-info) do.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpclb.provision import actions as generic
from hpclb.provision.actions import WriteFile
from hpclb.provision.hostfacts import HUGEPAGE_2M, HostFacts
from hpclb.provision.plan import Action, BaseAction, Context

CONF = "/etc/sysctl.d/60-hpclb-hugepages.conf"
MOUNTPOINT = "/dev/hugepages"
PAGE_MB = 2

Runner = Callable[[Sequence[str]], None]


def _run(argv: Sequence[str]) -> None:
    generic.run(argv, argv[0])


def pages_per_node(facts: HostFacts, lcores: Sequence[int], hugepages_mb: int) -> dict[int, int]:
    """2 MB pages to reserve on each node, as DPDK's EAL will take them."""
    pages = math.ceil(hugepages_mb / PAGE_MB)
    lowest = min(facts.cpus_by_node) if facts.cpus_by_node else 0
    nodes: Counter[int] = Counter()
    for cpu in lcores:
        node = facts.node_of_cpu(cpu)
        nodes[lowest if node is None else node] += 1  # a CPU not online: the lowest node
    if not nodes:
        nodes[lowest] = 1
    total = sum(nodes.values())
    return {node: math.ceil(pages * count / total) for node, count in sorted(nodes.items())}


def render_conf(facts: HostFacts, per_node: Mapping[int, int], hugepages_mb: int) -> str:
    head = [
        "# hpclb: 2 MB hugepages for the DPDK forwarder (dpdk.hugepages_mb: "
        f"{hugepages_mb} MB).",
        "# Written by hpclb provisioning (python -m hpclb.provision) and rewritten on",
        "# each run. DPDK takes its memory on the NUMA nodes of its lcores (dpdk.lcores).",
    ]
    if not facts.numa or len(facts.cpus_by_node) <= 1:
        total = sum(per_node.values())
        return "\n".join([
            *head,
            "# One NUMA node: the global pool is that node's. Applied early in boot by",
            "# systemd-sysctl, when memory is least fragmented; hpclb-prepare.service",
            "# grows the pool again if the kernel granted fewer.",
            f"vm.nr_hugepages = {total}",
            "",
        ])
    lines = [
        *head,
        "# Several NUMA nodes: vm.nr_hugepages would spread the pages over all of them,",
        "# so no setting here. hpclb-prepare.service writes, at every boot, before",
        "# hpclb.service:",
    ]
    lines += [f"#   /sys/devices/system/node/node{node}/hugepages/{HUGEPAGE_2M}/nr_hugepages "
              f"= {pages}" for node, pages in sorted(per_node.items())]
    return "\n".join([*lines, ""])


def _pool_file(sysfs: Path, facts: HostFacts, node: int) -> Path:
    if facts.numa:
        return sysfs / f"devices/system/node/node{node}/hugepages/{HUGEPAGE_2M}/nr_hugepages"
    return sysfs / f"kernel/mm/hugepages/{HUGEPAGE_2M}/nr_hugepages"


@dataclass
class ReservePages(BaseAction):
    """At least ``pages`` 2 MB pages on ``node`` now (live only; never shrinks)."""

    node: int = 0
    pages: int = 0
    path: Path = Path("/")
    live_only: bool = True

    def describe(self) -> str:
        return f"reserve {self.pages} hugepages of 2 MB on NUMA node {self.node}"

    def _have(self) -> int:
        try:
            return int(self.path.read_text())
        except (OSError, ValueError):
            return 0

    def pending(self, ctx: Context) -> list[str]:
        have = self._have()
        return [] if have >= self.pages else [f"{have} -> {self.pages}"]

    def apply(self, ctx: Context) -> None:
        self.path.write_text(f"{self.pages}\n")
        granted = self._have()
        if granted < self.pages:
            # Fragmented memory: the kernel gave what it could. Say so now;
            # hpclb run reports the shortfall when DPDK cannot start.
            ctx.say(f"warning: NUMA node {self.node}: the kernel granted {granted} of "
                    f"{self.pages} hugepages (memory fragmented: reboot, hpclb-prepare "
                    "reserves them early)")


def hugetlbfs_mounted(mounts: str, where: str = MOUNTPOINT) -> bool:
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == where and parts[2] == "hugetlbfs":
            return True
    return False


@dataclass
class MountHugetlbfs(BaseAction):
    """hugetlbfs at /dev/hugepages (systemd's dev-hugepages.mount does it
    at boot; this covers a host where it did not run). Live only."""

    proc: Path = Path("/proc")
    runner: Runner = _run
    live_only: bool = True

    def describe(self) -> str:
        return f"mount hugetlbfs at {MOUNTPOINT}"

    def pending(self, ctx: Context) -> list[str]:
        try:
            mounts = (self.proc / "mounts").read_text()
        except OSError:
            mounts = ""
        return [] if hugetlbfs_mounted(mounts) else ["not mounted"]

    def apply(self, ctx: Context) -> None:
        Path(MOUNTPOINT).mkdir(mode=0o755, exist_ok=True)
        self.runner(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "hugetlbfs", MOUNTPOINT])


def hugepage_actions(facts: HostFacts, lcores: Sequence[int], hugepages_mb: int, *,
                     sysfs: Path = Path("/sys"), proc: Path = Path("/proc"),
                     persistent: bool = True, live: bool = True,
                     runner: Runner = _run) -> list[Action]:
    """The boot-time file (``persistent``) and the live reservation and
    mount (``live``: live-only actions, skipped under --root)."""
    per_node = pages_per_node(facts, lcores, hugepages_mb)
    out: list[Action] = []
    if persistent:
        out.append(WriteFile(CONF, render_conf(facts, per_node, hugepages_mb), 0o644))
    if live:
        out += [ReservePages(node=node, pages=pages, path=_pool_file(sysfs, facts, node))
                for node, pages in sorted(per_node.items())]
        out.append(MountHugetlbfs(proc=proc, runner=runner))
    return out


# --- from a configuration (a plain mapping, as H1's gateway plan holds it) ----

def uses_dpdk(config: Mapping[str, Any]) -> bool:
    """Whether the configuration runs (or, ``auto``, can run) the DPDK forwarder:
    ``dpdk``, or ``auto`` with PCI ports or a vdev driver configured."""
    app = config.get("appliance") or {}
    dataplane = app.get("dataplane", "auto")
    if dataplane == "dpdk":
        return True
    if dataplane != "auto":
        return False
    from hpclb.provision.hostfacts import PCI_ADDRESS
    ingress = str((app.get("interfaces") or {}).get("ingress", ""))
    return bool(PCI_ADDRESS.match(ingress)) or bool((app.get("dpdk") or {}).get("driver"))


def dpdk_settings(config: Mapping[str, Any]) -> tuple[list[int], int]:
    """(lcores, hugepages_mb) with the schema's defaults."""
    dpdk = (config.get("appliance") or {}).get("dpdk") or {}
    return list(dpdk.get("lcores", [0, 1])), int(dpdk.get("hugepages_mb", 512))


def actions(ctx: Context, facts: HostFacts, config: Mapping[str, Any], *,
            sysfs: Path = Path("/sys"), proc: Path = Path("/proc")) -> list[Action]:
    """H1's entry: nothing for XDP; for DPDK the file, and the live steps."""
    if not uses_dpdk(config):
        return []
    lcores, mb = dpdk_settings(config)
    return hugepage_actions(facts, lcores, mb, sysfs=sysfs, proc=proc)
