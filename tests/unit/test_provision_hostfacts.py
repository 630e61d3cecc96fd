"""Host facts from fake sysfs trees (and, once, this host's netlink)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclb.provision.hostfacts import (
    FakePci,
    NetState,
    format_cpulist,
    gather,
    parse_cpulist,
    read_netlink,
    write_fake_sysfs,
)

NET = NetState(
    links={"lo": "00:00:00:00:00:00", "eno1": "02:00:00:00:00:01", "ens1f0": "02:00:00:00:00:02",
           "ens1f1": "02:00:00:00:00:03", "veth0": "02:00:00:00:00:04"},
    addresses={"eno1": ("192.0.2.5/24", "2001:db8::5/64")},
    default_v4=frozenset({"eno1"}), default_v6=frozenset({"eno1"}))


def two_node_host(tmp_path: Path) -> Path:
    return write_fake_sysfs(
        tmp_path / "sys", nodes={0: "0-3,8-11", 1: "4-7,12-15"},
        pci=[FakePci("0000:00:19.0", "eno1", "e1000e", 0, 1),
             FakePci("0000:3b:00.0", "ens1f0", "ixgbe", 1, 20),
             FakePci("0000:3b:00.1", "ens1f1", "ixgbe", 1, 21),
             FakePci("0000:5e:00.0", None, "vfio-pci", 1, 30)],
        virtual=["veth0", "lo"], hugepages={0: 0, 1: 256}, vfio_loaded=True,
        siblings={0: "0,8", 8: "0,8"})


def test_cpulists_round_trip() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("") == ()
    assert format_cpulist([5, 1, 2, 3, 8, 9]) == "1-3,5,8-9"
    assert format_cpulist([4]) == "4"


def test_two_node_host(tmp_path: Path) -> None:
    facts = gather(two_node_host(tmp_path), net=NET, run=tmp_path / "run",
                   proc=tmp_path / "proc", modules=tmp_path / "modules",
                   ssh_connection="198.51.100.7 50022 192.0.2.5 22")
    assert facts.numa and facts.cpus_by_node == {0: (0, 1, 2, 3, 8, 9, 10, 11),
                                                 1: (4, 5, 6, 7, 12, 13, 14, 15)}
    assert facts.node_of_cpu(12) == 1 and facts.node_of_cpu(99) is None
    assert facts.iommu_groups == 4 and facts.vfio_pci and not facts.noiommu
    assert facts.hugepages_2m[1].nr == 256 and facts.hugepages_2m[0].nr == 0
    assert not facts.systemd  # no run/systemd/system in the fake root
    assert facts.thread_siblings[8] == (0, 8)
    eno1, f0 = facts.nics["eno1"], facts.nics["ens1f0"]
    assert (eno1.pci, eno1.driver, eno1.numa_node) == ("0000:00:19.0", "e1000e", 0)
    assert eno1.default_route and eno1.addresses == ("192.0.2.5/24", "2001:db8::5/64")
    assert (f0.pci, f0.numa_node, f0.default_route, f0.addresses) == ("0000:3b:00.0", 1, False, ())
    assert facts.nics["veth0"].pci is None and facts.nics["veth0"].numa_node is None
    # Both ways of naming a port; a function bound to vfio-pci has no interface.
    assert facts.resolve("ens1f1") == ("ens1f1", "0000:3b:00.1")
    assert facts.resolve("0000:3B:00.1") == ("ens1f1", "0000:3b:00.1")
    assert facts.resolve("0000:5e:00.0") == (None, "0000:5e:00.0")
    assert facts.pci_nics["0000:5e:00.0"].driver == "vfio-pci"
    assert facts.numa_node_of("0000:5e:00.0") == 1 and facts.numa_node_of("veth0") is None
    assert facts.ssh_address == "192.0.2.5" and facts.ssh_nic() == "eno1"
    assert facts.nic_of_address("2001:db8::5") == "eno1"
    assert facts.nic_of_address("10.9.9.9") is None


def test_no_numa_virtio_host_without_vfio(tmp_path: Path) -> None:
    # What a cloud VM looks like: no node directory, a virtio NIC whose
    # interface hangs under virtio0, no IOMMU, no vfio-pci module.
    sysfs = write_fake_sysfs(tmp_path / "sys", pci=[
        FakePci("0000:00:03.0", "eth0", "virtio-pci", -1, None, virtio=True)],
        hugepages={0: 8})
    modules = tmp_path / "modules" / "6.1.0-test"
    modules.mkdir(parents=True)
    (modules / "modules.dep").write_text("kernel/drivers/net/veth.ko:\n")
    facts = gather(sysfs, net=NetState(links={"eth0": "02:00:00:00:00:09"}),
                   run=tmp_path, proc=tmp_path, modules=tmp_path / "modules",
                   ssh_connection="", release="6.1.0-test")
    assert not facts.numa and facts.cpus_by_node == {0: (0, 1)}
    assert facts.hugepages_2m == {0: facts.hugepages_2m[0]} and facts.hugepages_2m[0].nr == 8
    assert facts.nics["eth0"].pci == "0000:00:03.0" and facts.nics["eth0"].driver == "virtio_net"
    assert facts.pci_nics["0000:00:03.0"].netdevs == ("eth0",)
    assert facts.iommu_groups == 0 and not facts.vfio_pci and facts.ssh_nic() is None


def test_vfio_as_a_loadable_module(tmp_path: Path) -> None:
    modules = tmp_path / "modules" / "6.1.0-test"
    modules.mkdir(parents=True)
    (modules / "modules.dep").write_text(
        "kernel/drivers/vfio/pci/vfio-pci.ko: kernel/drivers/vfio/vfio.ko\n")
    facts = gather(write_fake_sysfs(tmp_path / "sys"), net=NetState(), run=tmp_path,
                   proc=tmp_path, modules=tmp_path / "modules", ssh_connection="",
                   release="6.1.0-test")
    assert facts.vfio_pci


def test_systemd_and_cmdline(tmp_path: Path) -> None:
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cmdline").write_text("BOOT_IMAGE=/vmlinuz isolcpus=2-3\n")
    facts = gather(write_fake_sysfs(tmp_path / "sys"), net=NetState(), run=tmp_path / "run",
                   proc=tmp_path / "proc", ssh_connection="")
    assert facts.systemd and facts.kernel_cmdline == "BOOT_IMAGE=/vmlinuz isolcpus=2-3"


def test_netlink_of_this_namespace() -> None:
    # Only that it reads: every namespace has lo, which has no global address
    # (127.0.0.1 is host scope) and no default route.
    try:
        net = read_netlink()
    except OSError as err:  # pragma: no cover - a sandbox without netlink
        pytest.skip(f"no netlink here: {err}")
    assert "lo" in net.links
    assert "lo" not in net.addresses and "lo" not in net.default_v4
