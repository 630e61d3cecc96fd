"""``prepare`` (hpclb-prepare.service) against a fake root: sysfs, /proc,
bpffs and /dev/vfio under a temporary directory, a fake dpdk-devbind.py."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import yaml

from hpclb.provision import prepare
from hpclb.provision.hostfacts import FakePci, NetState, write_fake_sysfs
from hpclb.provision.plan import EXIT_ERROR, EXIT_OK, EXIT_REFUSED

EXAMPLE = Path(__file__).resolve().parents[2] / "appliance/examples/lab.yaml"
F0, F1 = "0000:3b:00.0", "0000:3b:00.1"
NET = NetState(links={"eno1": "02:00:00:00:00:01", "ens1f0": "02:00:00:00:00:02",
                      "ens1f1": "02:00:00:00:00:03"},
               addresses={"eno1": ("10.0.0.5/24",)}, default_v4=frozenset({"eno1"}))
HPCLB_UID = 990


def make_root(tmp_path: Path, *, iommu: bool = True) -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text(f"root:x:0:0::/root:/bin/sh\n"
                                     f"hpclb:x:{HPCLB_UID}:{HPCLB_UID}::/:/usr/sbin/nologin\n")
    (root / "etc/group").write_text(f"root:x:0:\nhpclb:x:{HPCLB_UID}:\n")
    write_fake_sysfs(root / "sys", nodes={0: "0-3"}, hugepages={0: 0},
                     pci=[FakePci("0000:00:19.0", "eno1", "e1000e", 0, 1 if iommu else None),
                          FakePci(F0, "ens1f0", "ixgbe", 0, 20 if iommu else None),
                          FakePci(F1, "ens1f1", "ixgbe", 0, 21 if iommu else None)],
                     vfio_loaded=True)
    bpf = root / "sys/fs/bpf"
    bpf.mkdir(parents=True)
    bpf.chmod(0o700)  # as systemd mounts it
    (root / "proc").mkdir()
    (root / "proc/mounts").write_text(
        "bpf /sys/fs/bpf bpf rw,mode=700 0 0\nhugetlbfs /dev/hugepages hugetlbfs rw 0 0\n")
    return root


def config(tmp_path: Path, **appliance: object) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["appliance"].update({"netns": None, **appliance})
    path = tmp_path / "hpclb.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class FakeDevbind:
    """Relinks the driver and makes /dev/vfio/GROUP appear, as binding does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> None:
        self.calls.append(list(argv))
        if argv[0].endswith("dpdk-devbind.py"):
            dev = (self.root / "sys/bus/pci/devices" / argv[2]).resolve()
            vfio = self.root / "sys/bus/pci/drivers/vfio-pci"
            vfio.mkdir(parents=True, exist_ok=True)
            (dev / "driver").unlink()
            (dev / "driver").symlink_to(os.path.relpath(vfio, dev))
            group = Path(os.readlink(dev / "iommu_group")).name
            (self.root / "dev/vfio").mkdir(parents=True, exist_ok=True)
            (self.root / f"dev/vfio/{group}").write_text("")


def run(root: Path, cfg: Path, devbind: FakeDevbind, lines: list[str], **kw: object) -> int:
    return prepare.run(cfg, root=root, sysfs=root / "sys", proc=root / "proc", net=NET,
                       runner=devbind, out=lines.append, **kw)  # type: ignore[arg-type]


def test_dpdk_pci_boot_then_nothing_to_do(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    cfg = config(tmp_path, dataplane="dpdk", interfaces={"ingress": F0, "egress": [F1]},
                 dpdk={"lcores": [1, 2, 3], "hugepages_mb": 300})
    devbind = FakeDevbind(root)
    lines: list[str] = []
    assert run(root, cfg, devbind, lines) == EXIT_OK
    assert [c[-1] for c in devbind.calls] == [F0, F1]
    pool = root / "sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages"
    assert pool.read_text().strip() == "150"
    for group in ("20", "21"):
        st = (root / f"dev/vfio/{group}").stat()
        assert st.st_uid == HPCLB_UID and stat.S_IMODE(st.st_mode) == 0o600
    pins = (root / "sys/fs/bpf/hpclb").stat()
    assert pins.st_uid == HPCLB_UID and stat.S_IMODE(pins.st_mode) == 0o700
    assert stat.S_IMODE((root / "sys/fs/bpf").stat().st_mode) == 0o711
    assert not (root / "etc/sysctl.d").exists()  # prepare writes nothing persistent
    # node 0 grown, 2 bound, 2 groups handed over, /sys/fs/bpf searchable, the pin dir
    assert lines[-1] == "provision: 7 changes"
    again: list[str] = []
    assert run(root, cfg, devbind, again) == EXIT_OK
    assert again == ["provision: no change"] and len(devbind.calls) == 2


def test_pins_left_by_a_root_control_plane_are_handed_over(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    pins = root / "sys/fs/bpf/hpclb/lab-lb"
    pins.mkdir(parents=True)
    (pins / "lb_vips").write_text("")  # a map pinned by hpclb when it ran as root
    cfg = config(tmp_path, dataplane="xdp", interfaces={"ingress": "ens1f0"})
    lines: list[str] = []
    assert run(root, cfg, FakeDevbind(root), lines) == EXIT_OK
    assert any("2 pinned object(s) -> hpclb:hpclb" in line for line in lines)
    assert (pins / "lb_vips").stat().st_uid == HPCLB_UID and pins.stat().st_uid == HPCLB_UID
    again: list[str] = []
    assert run(root, cfg, FakeDevbind(root), again) == EXIT_OK
    assert again == ["prepare: dataplane xdp: no hugepages, no NIC binding",
                     "provision: no change"]


def test_xdp_skips_hugepages_and_binding(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    cfg = config(tmp_path, dataplane="xdp", interfaces={"ingress": "ens1f0"})
    devbind = FakeDevbind(root)
    lines: list[str] = []
    assert run(root, cfg, devbind, lines) == EXIT_OK
    assert "prepare: dataplane xdp: no hugepages, no NIC binding" in lines
    assert devbind.calls == [] and (root / "sys/fs/bpf/hpclb").is_dir()
    pool = root / "sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages"
    assert pool.read_text().strip() == "0"


def test_refused_nic_changes_nothing(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    cfg = config(tmp_path, dataplane="dpdk", interfaces={"ingress": "0000:00:19.0"},
                 management_address="10.0.0.5")
    devbind = FakeDevbind(root)
    lines: list[str] = []
    assert run(root, cfg, devbind, lines) == EXIT_REFUSED
    assert any("it holds the management address 10.0.0.5" in line for line in lines)
    assert lines[-1] == "provision: nothing was changed"
    assert devbind.calls == [] and not (root / "sys/fs/bpf/hpclb").exists()
    pool = root / "sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages"
    assert pool.read_text().strip() == "0"


def test_pci_ports_without_iommu_are_an_error(tmp_path: Path) -> None:
    root = make_root(tmp_path, iommu=False)
    cfg = config(tmp_path, dataplane="auto", interfaces={"ingress": F0})
    devbind = FakeDevbind(root)
    lines: list[str] = []
    assert run(root, cfg, devbind, lines) == EXIT_ERROR
    assert "no IOMMU" in lines[-1] and "XDP needs interface names" in lines[-1]
    assert devbind.calls == [] and not (root / "sys/fs/bpf/hpclb").exists()


def test_check_reports_without_changing(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    cfg = config(tmp_path, dataplane="dpdk", interfaces={"ingress": F0})
    devbind = FakeDevbind(root)
    lines: list[str] = []
    assert run(root, cfg, devbind, lines, check=True) == EXIT_OK
    assert lines[-1].endswith("would be made (--check)")
    assert devbind.calls == [] and not (root / "sys/fs/bpf/hpclb").exists()


def test_a_broken_configuration_is_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("appliance: {name: x}\n")
    lines: list[str] = []
    assert prepare.run(bad, root=tmp_path, sysfs=tmp_path, proc=tmp_path, net=NET,
                       out=lines.append) == EXIT_ERROR
    assert lines[-1].startswith(f"provision: error: {bad}")


def test_a_pci_port_this_host_lacks_is_an_error(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    cfg = config(tmp_path, dataplane="dpdk", interfaces={"ingress": "0000:99:00.0"})
    devbind = FakeDevbind(root)
    lines: list[str] = []
    assert run(root, cfg, devbind, lines) == EXIT_ERROR
    assert "no network PCI function 0000:99:00.0 on this host" in lines[-1]
    assert devbind.calls == [] and not (root / "sys/fs/bpf/hpclb").exists()
