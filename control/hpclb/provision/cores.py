"""The DPDK forwarder's lcores: a main lcore and workers on the data NICs' NUMA node.

Every worker polls a queue of every port (``hpclb-dpdk``), so all workers go on
one node: the node most ports sit on (the ingress port's on a tie). DPDK's EAL
spreads ``-m`` memory over the nodes of the lcores, in proportion to their
count, so the main lcore goes there too when the node has a CPU to spare:
then every hugepage the forwarder takes is local to its NICs.

CPU 0 is the housekeeping CPU (timers, unbound interrupts, the control plane):
never a worker. It is the main lcore (which mostly sleeps on its socket) only
when the NICs' node has no other CPU left for it. A worker avoids sharing a
physical core (thread siblings) with CPU 0 when there is a choice.

Isolating the workers from the scheduler and the tick is the operator's call
(a kernel command line change, a reboot): advice is printed, never applied.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpclb.provision.hostfacts import HostFacts, format_cpulist, parse_cpulist
from hpclb.provision.plan import Action, Note, ProvisionError

#: Workers picked when the operator does not say: enough for a 25G port of
#: small packets on most cores, few enough to leave the control plane room.
DEFAULT_MAX_WORKERS = 4


@dataclass(frozen=True)
class CorePlan:
    lcores: list[int]  # the main lcore first, then the workers
    node: int
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def workers(self) -> list[int]:
        return self.lcores[1:]


def _target_node(facts: HostFacts, nic_nodes: Sequence[int | None]) -> tuple[int, list[str]]:
    known = [n for n in nic_nodes if n is not None and n in facts.cpus_by_node]
    notes: list[str] = []
    if not known:
        # No NUMA information (a VM, a single-node host): the lowest node.
        return min(facts.cpus_by_node), notes
    counts = Counter(known)
    best = max(counts.values())
    first = nic_nodes[0]
    node = first if first in counts and counts[first] == best else \
        min(n for n, c in counts.items() if c == best)
    if len(counts) > 1:
        notes.append(f"the data NICs sit on NUMA nodes {sorted(counts)}: workers on node {node}; "
                     "ports on another node are reached across the interconnect (slower)")
    return node, notes


def pick_cores(facts: HostFacts, nic_nodes: Sequence[int | None],
               workers: int | None = None) -> CorePlan:
    """The lcores for the forwarder. ``workers`` None: up to
    :data:`DEFAULT_MAX_WORKERS`, one fewer than the node's spare CPUs when
    that leaves the main lcore one of them."""
    if len(facts.cpus) < 2:
        raise ProvisionError(f"DPDK needs two CPUs (a main lcore and a worker); this host has "
                             f"{len(facts.cpus)}: use dataplane: xdp")
    if workers is not None and workers < 1:
        raise ProvisionError(f"workers must be at least 1, got {workers}")
    node, notes = _target_node(facts, nic_nodes)
    housekeeping = set(facts.thread_siblings.get(0, (0,))) | {0}
    node_cpus = [c for c in facts.cpus_by_node[node] if c != 0]
    # Cores whose sibling is CPU 0 come last: a worker there shares a core
    # with the kernel's housekeeping.
    spare = sorted(node_cpus, key=lambda c: (c in housekeeping, c))
    if not spare:
        other = [c for c in facts.cpus if c != 0]
        notes.append(f"NUMA node {node} has no CPU but 0: the worker runs on another node")
        spare, node = other, facts.node_of_cpu(other[0]) or 0
    want = workers if workers is not None else max(1, min(DEFAULT_MAX_WORKERS, len(spare) - 1))
    if want > len(spare):
        raise ProvisionError(f"{want} workers asked, NUMA node {node} has {len(spare)} CPUs "
                             f"besides CPU 0 ({format_cpulist(spare)})")
    chosen = sorted(spare[:want])
    rest = spare[want:]
    if rest:
        # The main lcore mostly sleeps: CPU 0's sibling suits it best.
        main = next((c for c in rest if c in housekeeping), rest[0])
    else:
        main = 0
        notes.append("the main lcore shares CPU 0 with the housekeeping: no spare CPU "
                     f"on node {node}")
    return CorePlan([main, *chosen], node, isolation_advice(facts, chosen), notes)


def _cmdline_cpus(cmdline: str, key: str) -> set[int]:
    """The CPUs a kernel parameter (isolcpus=, nohz_full=) names; flags such
    as ``managed_irq,domain,`` in front are skipped."""
    m = re.search(rf"(?:^|\s){key}=(\S+)", cmdline)
    if not m:
        return set()
    cpus = ",".join(p for p in m.group(1).split(",") if p[:1].isdigit())
    try:
        return set(parse_cpulist(cpus))
    except ValueError:
        return set()


def isolation_advice(facts: HostFacts, workers: Sequence[int]) -> list[str]:
    """Kernel command line advice for the workers, [] when already in place."""
    cmdline = facts.kernel_cmdline.split(" -- ")[0]  # init's own arguments follow "--"
    missing = [key for key in ("isolcpus", "nohz_full", "rcu_nocbs")
               if not set(workers) <= _cmdline_cpus(cmdline, key)]
    if not missing:
        return []
    cpus = format_cpulist(workers)
    params = {"isolcpus": f"isolcpus=managed_irq,domain,{cpus}", "nohz_full": f"nohz_full={cpus}",
              "rcu_nocbs": f"rcu_nocbs={cpus}"}
    return [f"advice (not applied): the workers {cpus} share their CPUs with other tasks and "
            "the tick; to give them whole, add to the kernel command line (GRUB_CMDLINE_LINUX "
            f"in /etc/default/grub, then update-grub and a reboot): "
            f"{' '.join(params[k] for k in missing)}"]


def core_actions(plan: CorePlan) -> list[Action]:
    """The choice, its notes and the isolation advice, as report lines."""
    lines = [f"cores: main lcore {plan.lcores[0]}, workers {format_cpulist(plan.workers)} "
             f"(NUMA node {plan.node})"]
    return [Note(line=line) for line in [*lines, *plan.notes, *plan.advice]]


def pick(facts: HostFacts, config: Mapping[str, Any], workers: int | None = None) -> CorePlan:
    """:func:`pick_cores` for a configuration (a plain mapping): the NUMA
    nodes of ``appliance.interfaces`` (names or PCI addresses). H1 writes
    ``plan.lcores`` into ``appliance.dpdk.lcores``."""
    interfaces = (config.get("appliance") or {}).get("interfaces") or {}
    ports = [str(interfaces.get("ingress", "")), *map(str, interfaces.get("egress", []))]
    return pick_cores(facts, [facts.numa_node_of(p) for p in ports if p], workers)
