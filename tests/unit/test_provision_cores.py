"""Worker cores on the data NICs' NUMA node, never CPU 0; isolation advice only."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclb.provision import cores
from hpclb.provision.hostfacts import FakePci, HostFacts, NetState, gather, write_fake_sysfs
from hpclb.provision.plan import Context, ProvisionError, run_plan


def facts_of(tmp_path: Path, nodes: dict[int, str] | None, cmdline: str = "",
             siblings: dict[int, str] | None = None, pci: list[FakePci] | None = None) -> HostFacts:
    (tmp_path / "proc").mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc/cmdline").write_text(cmdline + "\n")
    sysfs = write_fake_sysfs(tmp_path / "sys", nodes=nodes, siblings=siblings, pci=pci or [])
    links = {p.netdev: "02:00:00:00:00:01" for p in pci or [] if p.netdev}
    return gather(sysfs, net=NetState(links=links), run=tmp_path, proc=tmp_path / "proc",
                  ssh_connection="")


def test_workers_on_the_nic_node_main_beside_them(tmp_path: Path) -> None:
    f = facts_of(tmp_path, {0: "0-7", 1: "8-15"})
    plan = cores.pick_cores(f, [1, 1])
    assert plan.node == 1 and plan.workers == [8, 9, 10, 11] and plan.lcores[0] == 12
    assert all(f.node_of_cpu(c) == 1 for c in plan.lcores)
    plan0 = cores.pick_cores(f, [0], workers=2)
    assert plan0.lcores == [3, 1, 2] and 0 not in plan0.lcores


def test_two_cpu_vm_main_on_cpu0_worker_on_1(tmp_path: Path) -> None:
    f = facts_of(tmp_path, None)  # no NUMA directory, CPUs 0-1
    plan = cores.pick_cores(f, [None])
    assert plan.lcores == [0, 1] and plan.node == 0
    assert any("shares CPU 0" in n for n in plan.notes)


def test_one_cpu_is_refused(tmp_path: Path) -> None:
    f = facts_of(tmp_path, {0: "0"})
    with pytest.raises(ProvisionError, match="DPDK needs two CPUs"):
        cores.pick_cores(f, [0])


def test_cpu0_siblings_hold_the_main_lcore_not_a_worker(tmp_path: Path) -> None:
    # CPU 4 is CPU 0's hyperthread: it suits the (mostly idle) main lcore.
    f = facts_of(tmp_path, {0: "0-7"}, siblings={0: "0,4", 4: "0,4"})
    plan = cores.pick_cores(f, [0], workers=3)
    assert plan.workers == [1, 2, 3] and plan.lcores[0] == 4
    crowded = cores.pick_cores(f, [0], workers=7)
    assert 4 in crowded.workers and crowded.lcores[0] == 0 and 0 not in crowded.workers


def test_nics_on_two_nodes(tmp_path: Path) -> None:
    f = facts_of(tmp_path, {0: "0-3", 1: "4-7"})
    tie = cores.pick_cores(f, [1, 0])  # a tie: the ingress port's node
    assert tie.node == 1 and any("NUMA nodes [0, 1]" in n for n in tie.notes)
    assert cores.pick_cores(f, [0, 1, 1]).node == 1  # most ports
    with pytest.raises(ProvisionError, match="NUMA node 1 has 4 CPUs"):
        cores.pick_cores(f, [1], workers=5)


def test_isolation_is_advice_and_never_applied(tmp_path: Path) -> None:
    f = facts_of(tmp_path, {0: "0-7"}, cmdline="BOOT_IMAGE=/vmlinuz root=/dev/sda1")
    plan = cores.pick_cores(f, [0], workers=2)
    assert len(plan.advice) == 1
    advice = plan.advice[0]
    assert advice.startswith("advice (not applied):")
    assert "isolcpus=managed_irq,domain,1-2 nohz_full=1-2 rcu_nocbs=1-2" in advice
    c = Context(root=tmp_path / "root", live=True, check=False, src=tmp_path,
                out=lambda line: None)
    assert run_plan(cores.core_actions(plan), c) == 0  # said, not a change
    assert c.lines[0] == "cores: main lcore 3, workers 1-2 (NUMA node 0)" and advice in c.lines
    assert not (tmp_path / "root").exists()


def test_no_advice_when_already_isolated(tmp_path: Path) -> None:
    f = facts_of(tmp_path, {0: "0-7"},
                 cmdline="isolcpus=managed_irq,domain,1-6 nohz_full=1-6 rcu_nocbs=1-7 -- init")
    assert cores.pick_cores(f, [0], workers=2).advice == []
    partly = facts_of(tmp_path / "b", {0: "0-7"}, cmdline="isolcpus=1-2")
    advice = cores.pick_cores(partly, [0], workers=2).advice[0]
    assert "isolcpus" not in advice.split(":", 2)[2] and "nohz_full=1-2 rcu_nocbs=1-2" in advice


def test_from_a_configuration(tmp_path: Path) -> None:
    f = facts_of(tmp_path, {0: "0-3", 1: "4-7"},
                 pci=[FakePci("0000:af:00.0", "ens5f0", numa_node=1, iommu_group=9)])
    by_name = cores.pick(f, {"appliance": {"interfaces": {"ingress": "ens5f0"}}})
    by_pci = cores.pick(f, {"appliance": {"interfaces": {"ingress": "0000:af:00.0"}}})
    assert by_name.lcores == by_pci.lcores and by_name.node == 1
