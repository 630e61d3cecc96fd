"""Hugepages per NUMA node: the boot-time file, the live reservation (grown,
never shrunk) and the hugetlbfs mount, on fake sysfs trees."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hpclb.provision import hugepages
from hpclb.provision.hostfacts import HostFacts, NetState, gather, write_fake_sysfs
from hpclb.provision.plan import Context, run_plan


def facts_of(tmp_path: Path, nodes: dict[int, str] | None,
             pools: dict[int, int] | None = None) -> tuple[HostFacts, Path]:
    sysfs = write_fake_sysfs(tmp_path / "sys", nodes=nodes, hugepages=pools)
    return gather(sysfs, net=NetState(), run=tmp_path, proc=tmp_path, ssh_connection=""), sysfs


def ctx(tmp_path: Path, *, live: bool = True, check: bool = False) -> Context:
    return Context(root=tmp_path / "root", live=live, check=check, src=tmp_path,
                   out=lambda line: None)


def mounts(tmp_path: Path, text: str = "") -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "mounts").write_text(text)
    return proc


def test_pages_follow_the_lcores_nodes(tmp_path: Path) -> None:
    f, _ = facts_of(tmp_path, {0: "0-3", 1: "4-7"})
    assert hugepages.pages_per_node(f, [4, 5, 6], 2048) == {1: 1024}
    # EAL's split: in proportion to the lcores on each node, rounded up.
    assert hugepages.pages_per_node(f, [0, 4, 5], 1000) == {0: 167, 1: 334}
    assert hugepages.pages_per_node(f, [0, 99], 512) == {0: 256}  # 99: not online, lowest node


def test_single_node_file_sets_the_global_pool(tmp_path: Path) -> None:
    f, _ = facts_of(tmp_path, None)
    text = hugepages.render_conf(f, {0: 512}, 1024)
    assert "vm.nr_hugepages = 512\n" in text
    assert all(line.startswith("#") or line == "vm.nr_hugepages = 512" or not line
               for line in text.splitlines())


def test_numa_file_only_documents_what_prepare_sets(tmp_path: Path) -> None:
    f, _ = facts_of(tmp_path, {0: "0-3", 1: "4-7"})
    text = hugepages.render_conf(f, {1: 1024}, 2048)
    assert "vm.nr_hugepages" not in text.replace("# Several NUMA nodes: vm.nr_hugepages", "")
    assert "#   /sys/devices/system/node/node1/hugepages/hugepages-2048kB/nr_hugepages = 1024" \
        in text
    assert all(line.startswith("#") or not line for line in text.splitlines())


def test_live_reservation_grows_once_and_never_shrinks(tmp_path: Path) -> None:
    f, sysfs = facts_of(tmp_path, {0: "0-3", 1: "4-7"}, pools={0: 64, 1: 100})
    proc = mounts(tmp_path, "hugetlbfs /dev/hugepages hugetlbfs rw,relatime,pagesize=2M 0 0\n")
    acts = hugepages.hugepage_actions(f, [4, 5], 512, sysfs=sysfs, proc=proc)
    c = ctx(tmp_path)
    assert run_plan(acts, c) == 2  # the file, node 1 grown; the mount is in place
    node1 = sysfs / "devices/system/node/node1/hugepages/hugepages-2048kB/nr_hugepages"
    node0 = sysfs / "devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages"
    assert node1.read_text().strip() == "256" and node0.read_text().strip() == "64"
    assert "changed: reserve 256 hugepages of 2 MB on NUMA node 1: 100 -> 256" in c.lines
    assert (tmp_path / "root/etc/sysctl.d/60-hpclb-hugepages.conf").exists()
    again = ctx(tmp_path)
    assert run_plan(acts, again) == 0 and again.lines == ["provision: no change"]
    node1.write_text("300\n")  # someone else grew it further: left alone
    assert run_plan(acts, ctx(tmp_path)) == 0 and node1.read_text() == "300\n"


def test_fragmented_memory_is_reported(tmp_path: Path) -> None:
    _, sysfs = facts_of(tmp_path, None)
    pool = sysfs / "kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"

    class FragmentedKernel(hugepages.ReservePages):
        def _have(self) -> int:
            return min(super()._have(), 10)  # what the kernel could find

    c = ctx(tmp_path)
    assert run_plan([FragmentedKernel(node=0, pages=128, path=pool)], c) == 1
    assert any(line.startswith("warning: NUMA node 0: the kernel granted 10 of 128 hugepages")
               for line in c.lines)


def test_hugetlbfs_mounted_when_missing(tmp_path: Path) -> None:
    f, sysfs = facts_of(tmp_path, None)
    proc = mounts(tmp_path, "sysfs /sys sysfs rw 0 0\n")
    calls: list[list[str]] = []

    def runner(argv: Sequence[str]) -> None:
        calls.append(list(argv))

    acts = hugepages.hugepage_actions(f, [0, 1], 64, sysfs=sysfs, proc=proc, persistent=False,
                                      runner=runner)
    mount = acts[-1]
    assert isinstance(mount, hugepages.MountHugetlbfs)
    assert mount.pending(ctx(tmp_path)) == ["not mounted"]
    assert hugepages.hugetlbfs_mounted("none /dev/hugepages hugetlbfs rw 0 0")
    assert not hugepages.hugetlbfs_mounted("none /mnt/huge hugetlbfs rw 0 0")
    rooted = ctx(tmp_path, live=False)
    run_plan(acts, rooted)
    assert calls == [] and "skipped (--root): mount hugetlbfs at /dev/hugepages" in rooted.lines


def test_configuration_entry(tmp_path: Path) -> None:
    f, _ = facts_of(tmp_path, None)
    xdp = {"appliance": {"dataplane": "xdp", "interfaces": {"ingress": "eth1"}}}
    auto_names = {"appliance": {"dataplane": "auto", "interfaces": {"ingress": "eth1"}}}
    auto_pci = {"appliance": {"dataplane": "auto", "interfaces": {"ingress": "0000:00:04.0"}}}
    dpdk = {"appliance": {"dataplane": "dpdk", "interfaces": {"ingress": "0000:00:04.0"},
                          "dpdk": {"lcores": [0, 1], "hugepages_mb": 1024}}}
    c = ctx(tmp_path)
    assert hugepages.actions(c, f, xdp) == [] and hugepages.actions(c, f, auto_names) == []
    assert hugepages.uses_dpdk(auto_pci)
    acts = hugepages.actions(c, f, dpdk)
    assert [type(a).__name__ for a in acts] == ["WriteFile", "ReservePages", "MountHugetlbfs"]
    assert "vm.nr_hugepages = 512" in str(acts[0].content)  # type: ignore[attr-defined]
