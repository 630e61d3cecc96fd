"""vfio-pci binding on fake sysfs trees: the refusals, the fallback to XDP,
and a bind that happens once (a fake dpdk-devbind.py relinks the driver)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from hpclb.provision import nics
from hpclb.provision.hostfacts import FakePci, HostFacts, NetState, gather, write_fake_sysfs
from hpclb.provision.plan import Context, Note, ProvisionError, ProvisionRefused, run_plan

MGMT, F0, F1, F2 = "0000:00:19.0", "0000:3b:00.0", "0000:3b:00.1", "0000:3b:00.2"


def net(**extra: object) -> NetState:
    base: dict[str, object] = dict(
        links={"eno1": "02:00:00:00:00:01", "ens1f0": "02:00:00:00:00:02",
               "ens1f1": "02:00:00:00:00:03", "ens1f2": "02:00:00:00:00:04",
               "veth0": "02:00:00:00:00:05"},
        addresses={"eno1": ("192.0.2.5/24",)},
        default_v4=frozenset({"eno1"}), default_v6=frozenset())
    base.update(extra)
    return NetState(**base)  # type: ignore[arg-type]


def host(tmp_path: Path, *, iommu: bool = True, vfio: bool = True,
         state: NetState | None = None, ssh: str = "") -> tuple[HostFacts, Path]:
    group = (lambda g: g) if iommu else (lambda g: None)
    sysfs = write_fake_sysfs(
        tmp_path / "sys", nodes={0: "0-3", 1: "4-7"}, vfio_loaded=vfio,
        pci=[FakePci(MGMT, "eno1", "e1000e", 0, group(1)),
             FakePci(F0, "ens1f0", "ixgbe", 1, group(20)),
             FakePci(F1, "ens1f1", "ixgbe", 1, group(21)),
             FakePci(F2, "ens1f2", "ixgbe", 1, group(22))],
        virtual=["veth0"])
    facts = gather(sysfs, net=state or net(), run=tmp_path, proc=tmp_path,
                   modules=tmp_path / "no-modules", ssh_connection=ssh)
    return facts, sysfs


class FakeDevbind:
    """Records every command; ``dpdk-devbind.py --bind=vfio-pci ADDR``
    relinks the function's driver in the fake tree, as the real one would."""

    def __init__(self, sysfs: Path) -> None:
        self.sysfs = sysfs
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> None:
        self.calls.append(list(argv))
        if argv[0].endswith("dpdk-devbind.py"):
            dev = (self.sysfs / "bus/pci/devices" / argv[2]).resolve()
            vfio = self.sysfs / "bus/pci/drivers/vfio-pci"
            vfio.mkdir(parents=True, exist_ok=True)
            (dev / "driver").unlink()
            (dev / "driver").symlink_to(os.path.relpath(vfio, dev))
        elif argv[:2] == ["modprobe", "vfio-pci"]:
            (self.sysfs / "module/vfio_pci").mkdir(parents=True, exist_ok=True)


def ctx(tmp_path: Path, *, live: bool = True, check: bool = False) -> Context:
    lines: list[str] = []
    return Context(root=tmp_path / "root", live=live, check=check, src=tmp_path,
                   out=lines.append)


def test_binds_each_port_once(tmp_path: Path) -> None:
    facts, sysfs = host(tmp_path, vfio=False)
    facts = HostFacts(**{**facts.__dict__, "vfio_pci": True})  # loadable, not loaded
    devbind = FakeDevbind(sysfs)
    plan = nics.plan_nics(facts, "ens1f0", ["ens1f1"], dataplane="dpdk", management="eno1",
                          sysfs=sysfs, runner=devbind)
    assert (plan.dataplane, plan.ingress, plan.egress, plan.pci) == ("dpdk", F0, [F1], True)
    assert plan.numa_nodes == [1, 1] and plan.message is None
    c = ctx(tmp_path)
    assert run_plan(plan.actions, c) == 3
    assert devbind.calls == [["modprobe", "vfio-pci"],
                             ["dpdk-devbind.py", "--bind=vfio-pci", F0],
                             ["dpdk-devbind.py", "--bind=vfio-pci", F1]]
    assert f"changed: bind {F0} (ens1f0) to vfio-pci: driver ixgbe -> vfio-pci" in c.lines
    assert nics.pci_driver(sysfs, F0) == nics.pci_driver(sysfs, F1) == "vfio-pci"
    assert nics.pci_driver(sysfs, F2) == "ixgbe"  # not asked for, untouched
    # Again: in place, nothing run.
    again = ctx(tmp_path)
    assert run_plan(plan.actions, again) == 0 and again.lines == ["provision: no change"]
    assert len(devbind.calls) == 3


def test_check_and_root_change_nothing(tmp_path: Path) -> None:
    facts, sysfs = host(tmp_path)
    devbind = FakeDevbind(sysfs)
    plan = nics.plan_nics(facts, F0, [], dataplane="dpdk", sysfs=sysfs, runner=devbind)
    checked = ctx(tmp_path, check=True)
    assert run_plan(plan.actions, checked) == 1
    assert checked.lines[-1] == "provision: 1 change would be made (--check)"
    rooted = ctx(tmp_path, live=False)
    assert run_plan(plan.actions, rooted) == 0
    assert f"skipped (--root): bind {F0} (ens1f0) to vfio-pci" in rooted.lines
    assert devbind.calls == [] and nics.pci_driver(sysfs, F0) == "ixgbe"


@pytest.mark.parametrize(("ports", "kwargs", "state", "ssh", "reason"), [
    (["eno1"], {"management": "eno1"}, None, "", "it is the management NIC"),
    ([MGMT], {"management": "eno1"}, None, "", "it is the management NIC"),
    (["ens1f0"], {"management": F0}, None, "", "it is the management NIC"),
    (["ens1f0"], {"management_address": "10.0.0.5"},
     net(addresses={"ens1f0": ("10.0.0.5/24",)}), "", "it holds the management address 10.0.0.5"),
    (["ens1f1"], {}, net(default_v4=frozenset({"ens1f1"})), "", "the IPv4 default route"),
    (["ens1f1"], {}, net(default_v6=frozenset({"ens1f1"})), "", "the IPv6 default route"),
    ([F1], {}, net(addresses={"ens1f1": ("2001:db8:1::9/64",)}), "", "it holds 2001:db8:1::9/64"),
    (["ens1f2"], {}, net(addresses={"ens1f2": ("198.51.100.2/24",)}),
     "203.0.113.9 40000 198.51.100.2 22", "the SSH connection (198.51.100.2) came in on it"),
])
def test_refusals(tmp_path: Path, ports: list[str], kwargs: dict[str, str],
                  state: NetState | None, ssh: str, reason: str) -> None:
    facts, sysfs = host(tmp_path, state=state, ssh=ssh)
    devbind = FakeDevbind(sysfs)
    with pytest.raises(ProvisionRefused) as err:
        nics.plan_nics(facts, ports[0], ports[1:], dataplane="dpdk", sysfs=sysfs,
                       runner=devbind, **kwargs)  # type: ignore[arg-type]
    assert reason in str(err.value) and "refusing to bind" in str(err.value)
    assert devbind.calls == []


def test_refusal_names_every_port(tmp_path: Path) -> None:
    facts, _ = host(tmp_path, state=net(addresses={"eno1": ("192.0.2.5/24",),
                                                   "ens1f1": ("10.1.1.1/24",)}))
    with pytest.raises(ProvisionRefused) as err:
        nics.check_bindable(facts, ["ens1f0", "ens1f1", "eno1"])
    text = str(err.value)
    assert "ens1f1 (0000:3b:00.1): it holds 10.1.1.1/24" in text
    assert "eno1 (0000:00:19.0): it carries the IPv4 default route; it holds 192.0.2.5/24" in text
    assert "ens1f0" not in text


def test_auto_falls_back_where_dpdk_would_be_refused(tmp_path: Path) -> None:
    facts, _ = host(tmp_path)
    plan = nics.plan_nics(facts, "eno1", ["ens1f0"], dataplane="auto")
    assert (plan.dataplane, plan.ingress, plan.egress, plan.pci) == ("xdp", "eno1", ["ens1f0"],
                                                                    False)
    assert plan.message and "falls back to xdp" in plan.message
    assert "IPv4 default route" in plan.message
    assert len(plan.actions) == 1 and isinstance(plan.actions[0], Note)


@pytest.mark.parametrize(("iommu", "vfio", "ports", "expect"), [
    (False, True, ["ens1f0"], "no IOMMU (/sys/kernel/iommu_groups is empty)"),
    (True, False, ["ens1f0"], "the vfio-pci module is not available"),
    (True, True, ["veth0"], "veth0 is not a PCI function"),
])
def test_dpdk_falls_back_to_xdp(tmp_path: Path, iommu: bool, vfio: bool, ports: list[str],
                                expect: str) -> None:
    facts, sysfs = host(tmp_path, iommu=iommu, vfio=vfio)
    devbind = FakeDevbind(sysfs)
    plan = nics.plan_nics(facts, ports[0], [], dataplane="dpdk", sysfs=sysfs, runner=devbind)
    assert plan.dataplane == "xdp" and not plan.pci and plan.ingress == ports[0]
    assert plan.message is not None and expect in plan.message
    c = ctx(tmp_path)
    assert run_plan(plan.actions, c) == 0
    assert c.lines[0] == f"fallback: {plan.message}" and devbind.calls == []


def test_no_iommu_message_never_offers_noiommu_silently(tmp_path: Path) -> None:
    facts, _ = host(tmp_path, iommu=False)
    blocker = nics.vfio_blocker(facts, ["ens1f0"])
    assert blocker is not None and "intel_iommu=on" in blocker
    assert "never uses vfio's unsafe no-IOMMU mode" in blocker


def test_xdp_keeps_names_and_binds_nothing(tmp_path: Path) -> None:
    facts, _ = host(tmp_path)
    plan = nics.plan_nics(facts, F0, [F1], dataplane="xdp", management="eno1")
    assert (plan.dataplane, plan.ingress, plan.egress, plan.actions) == (
        "xdp", "ens1f0", ["ens1f1"], [])
    # A function already bound to vfio-pci has no interface for XDP.
    sysfs = write_fake_sysfs(tmp_path / "sys2", pci=[FakePci(F0, None, "vfio-pci", 0, 3)])
    bound = gather(sysfs, net=NetState(), run=tmp_path, proc=tmp_path, ssh_connection="")
    with pytest.raises(ProvisionError, match="has no kernel interface"):
        nics.plan_nics(bound, F0, [], dataplane="xdp")


def test_configuration_entries(tmp_path: Path) -> None:
    facts, sysfs = host(tmp_path)
    draft = {"appliance": {"dataplane": "dpdk", "management_address": "192.0.2.5",
                           "interfaces": {"ingress": "ens1f0", "egress": ["ens1f1"]}}}
    plan = nics.plan_for_config(facts, draft, sysfs=sysfs)
    assert (plan.dataplane, plan.ingress, plan.egress) == ("dpdk", F0, [F1])
    # A vdev driver needs no binding and keeps the configured dataplane.
    vdev = {"appliance": {"dataplane": "auto", "dpdk": {"driver": "af_xdp"},
                          "interfaces": {"ingress": "ens1f0"}}}
    assert nics.plan_for_config(facts, vdev).dataplane == "auto"
    # The configuration in force: PCI ports are bound; names are not.
    written = {"appliance": {"dataplane": "dpdk", "interfaces": {"ingress": F0, "egress": [F1]}}}
    kinds = [type(a).__name__ for a in nics.actions(ctx(tmp_path), facts, written, sysfs=sysfs)]
    assert kinds == ["LoadVfio", "BindVfio", "BindVfio"]
    assert nics.actions(ctx(tmp_path), facts, draft) == []
    with pytest.raises(ProvisionRefused):
        nics.actions(ctx(tmp_path), facts, {"appliance": {"interfaces": {"ingress": MGMT}}})
    # A kept configuration whose PCI ports cannot be bound here: a warning, no fallback.
    no_iommu, _ = host(tmp_path / "b", iommu=False)
    notes = nics.actions(ctx(tmp_path), no_iommu, written)
    assert len(notes) == 1 and isinstance(notes[0], Note) and "warning:" in notes[0].line


def test_an_unknown_port_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    # ens1f0 after an earlier boot bound it: its name is gone, its PCI address is not.
    facts, _ = host(tmp_path)
    with pytest.raises(ProvisionError, match="no interface or network PCI function ens9f9"):
        nics.plan_nics(facts, "ens9f9", [], dataplane="dpdk")
    with pytest.raises(ProvisionError, match=r"0000:99:00\.0"):
        nics.plan_nics(facts, "ens1f0", ["0000:99:00.0"], dataplane="xdp")


def test_ssh_over_a_link_local_address_names_its_interface(tmp_path: Path) -> None:
    facts, _ = host(tmp_path, ssh="fe80::9 50000 fe80::1%ens1f2 22")
    assert facts.ssh_nic() == "ens1f2"
    with pytest.raises(ProvisionRefused, match="the SSH connection"):
        nics.check_bindable(facts, ["ens1f2"])


def test_connectx_is_driven_in_place_never_bound(tmp_path: Path) -> None:
    # mlx5: DPDK works beside the kernel driver; no vfio-pci, no IOMMU needed.
    mlx = "0000:d8:00.0"
    sysfs = write_fake_sysfs(tmp_path / "sys", nodes={0: "0-3"},
                             pci=[FakePci(mlx, "ens6f0np0", "mlx5_core", 0, None),
                                  FakePci(F0, "ens1f0", "ixgbe", 0, None)], vfio_loaded=True)
    state = NetState(links={"ens6f0np0": "02:00:00:00:00:07", "ens1f0": "02:00:00:00:00:02"})
    facts = gather(sysfs, net=state, run=tmp_path, proc=tmp_path, ssh_connection="")
    devbind = FakeDevbind(sysfs)
    plan = nics.plan_nics(facts, "ens6f0np0", [], dataplane="dpdk", sysfs=sysfs, runner=devbind)
    assert (plan.dataplane, plan.ingress, plan.pci) == ("dpdk", mlx, True)
    assert [type(a).__name__ for a in plan.actions] == ["Note"]
    assert "keeps its kernel driver (mlx5_core)" in plan.actions[0].describe()
    assert run_plan(plan.actions, ctx(tmp_path)) == 0 and devbind.calls == []
    # Beside an ixgbe port on a host without IOMMU: the ixgbe port needs vfio.
    mixed = nics.plan_nics(facts, "ens6f0np0", ["ens1f0"], dataplane="dpdk")
    assert mixed.dataplane == "xdp" and mixed.message and "no IOMMU" in mixed.message
    # The refusals hold for it all the same.
    used = gather(sysfs, net=NetState(links=state.links,
                                      addresses={"ens6f0np0": ("192.0.2.9/24",)}),
                  run=tmp_path, proc=tmp_path, ssh_connection="")
    with pytest.raises(ProvisionRefused, match=r"it holds 192\.0\.2\.9/24"):
        nics.plan_nics(used, "ens6f0np0", [], dataplane="dpdk")


def test_vfio_takes_a_whole_iommu_group(tmp_path: Path) -> None:
    # Both ports of a dual-port NIC in one group (no ACS), and a PCIe bridge.
    sysfs = write_fake_sysfs(tmp_path / "sys", nodes={0: "0-3"}, vfio_loaded=True,
                             pci=[FakePci(F0, "ens1f0", "ixgbe", 0, 20),
                                  FakePci(F1, "ens1f1", "ixgbe", 0, 20)])
    bridge = sysfs / "devices/pci0000:00/0000:00:01.0"
    (bridge / "driver").parent.mkdir(parents=True)
    (sysfs / "bus/pci/drivers/pcieport").mkdir(parents=True)
    (bridge / "driver").symlink_to(os.path.relpath(sysfs / "bus/pci/drivers/pcieport", bridge))
    (sysfs / "kernel/iommu_groups/20/devices/0000:00:01.0").symlink_to(
        os.path.relpath(bridge, sysfs / "kernel/iommu_groups/20/devices"))
    facts = gather(sysfs, net=NetState(links={"ens1f0": "02:00:00:00:00:02",
                                              "ens1f1": "02:00:00:00:00:03"}),
                   run=tmp_path, proc=tmp_path, ssh_connection="")
    assert facts.group_devices["20"] == (("0000:00:01.0", "pcieport"), (F0, "ixgbe"),
                                         (F1, "ixgbe"))
    one = nics.plan_nics(facts, "ens1f0", [], dataplane="dpdk")
    assert one.dataplane == "xdp" and one.message is not None
    assert f"IOMMU group 20 of ens1f0 also holds {F1} (ixgbe)" in one.message
    both = nics.plan_nics(facts, "ens1f0", ["ens1f1"], dataplane="dpdk")
    assert both.dataplane == "dpdk" and both.egress == [F1]  # the bridge may stay


def test_a_nic_whose_interface_is_in_another_namespace_is_refused(tmp_path: Path) -> None:
    # ixgbe holds 0000:3b:00.3, but its interface is not among this namespace's links.
    sysfs = write_fake_sysfs(tmp_path / "sys", nodes={0: "0-3"}, vfio_loaded=True,
                             pci=[FakePci("0000:3b:00.3", None, "ixgbe", 0, 7),
                                  FakePci("0000:3b:00.4", None, "vfio-pci", 0, 8)])
    facts = gather(sysfs, net=NetState(), run=tmp_path, proc=tmp_path, ssh_connection="")
    with pytest.raises(ProvisionRefused, match="not in this network namespace"):
        nics.check_bindable(facts, ["0000:3b:00.3"])
    nics.check_bindable(facts, ["0000:3b:00.4"])  # already bound: nothing to check
