"""The vfio-pci refusals against real links, addresses and routes (netlink in a
scratch network namespace): a veth carrying a default route (IPv4, IPv6), one
holding a global address, the named management NIC, the SSH connection's NIC
are all refused, and nothing changes; a clean veth would be bound.

Veths are not PCI functions: a fake sysfs tree gives each one a PCI address,
an IOMMU group and vfio-pci, so the decision is made exactly as on a host
with NICs, and a fake dpdk-devbind.py records whether anything was run.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import yaml
from pyroute2 import netns

from hpclb.host.netns import inside
from hpclb.provision import nics, prepare
from hpclb.provision.hostfacts import FakePci, HostFacts, gather, read_netlink, write_fake_sysfs
from hpclb.provision.plan import EXIT_OK, EXIT_REFUSED, ProvisionRefused

pytestmark = pytest.mark.root

if os.geteuid() != 0:
    pytest.skip("lab tests need root (network namespaces, veth)", allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[2] / "appliance/examples/lab.yaml"
# name -> (PCI address, IOMMU group); the peer of each is NAMEp.
PORTS = {"mg0": ("0000:10:00.0", 10), "dr4": ("0000:10:00.1", 11),
         "dr6": ("0000:10:00.2", 12), "ad0": ("0000:10:00.3", 13),
         "cl0": ("0000:10:00.4", 14), "ll0": ("0000:10:00.5", 15),
         "pr0": ("0000:10:00.6", 16), "mp0": ("0000:10:00.7", 17), "mp1": ("0000:11:00.0", 18)}


def ip(ns: str, *args: str) -> str:
    return subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True,
                          text=True, timeout=30).stdout


@pytest.fixture(scope="module")
def ns() -> Iterator[str]:
    name = "tprov" + secrets.token_hex(3)
    netns.create(name)
    try:
        for port in PORTS:
            ip(name, "link", "add", port, "type", "veth", "peer", "name", f"{port}p")
            ip(name, "link", "set", port, "up")
            ip(name, "link", "set", f"{port}p", "up")
        ip(name, "addr", "add", "10.77.0.5/24", "dev", "mg0")  # the management NIC
        ip(name, "route", "add", "default", "dev", "dr4")  # a default route, no address
        ip(name, "-6", "route", "add", "default", "dev", "dr6")
        ip(name, "addr", "add", "10.78.0.2/24", "dev", "ad0")  # an address, no route
        # Policy routing: a default route in another table, a multipath one.
        ip(name, "route", "add", "default", "dev", "pr0", "table", "100")
        ip(name, "route", "add", "default", "table", "101", "nexthop", "dev", "mp0",
           "nexthop", "dev", "mp1")
        ip(name, "route", "add", "unreachable", "default", "table", "102")
        yield name
    finally:
        netns.remove(name)  # the veths go with it


@pytest.fixture()
def fake_sysfs(tmp_path: Path) -> Path:
    return write_fake_sysfs(
        tmp_path / "sys", nodes={0: "0-1"}, vfio_loaded=True,
        pci=[FakePci(addr, port, "ixgbe", 0, group) for port, (addr, group) in PORTS.items()])


def facts_in(ns: str, sysfs: Path, ssh: str = "") -> HostFacts:
    with inside(ns):
        net = read_netlink()
    return gather(sysfs, net=net, run=sysfs, proc=sysfs, ssh_connection=ssh)


def snapshot(ns: str) -> tuple[object, ...]:
    """What binding would take away: links, addresses, routes (lifetimes and
    DAD flags left out: they change by themselves)."""
    links = sorted((li["ifname"], tuple(sorted(li["flags"])))
                   for li in json.loads(ip(ns, "-j", "link")))
    addrs = sorted((a["ifname"], i["family"], i["local"], i["prefixlen"])
                   for a in json.loads(ip(ns, "-j", "addr")) for i in a["addr_info"])
    routes = [sorted(json.dumps({k: v for k, v in r.items() if k != "expires"}, sort_keys=True)
                     for r in json.loads(ip(ns, "-j", *fam, "route")))
              for fam in ((), ("-6",))]
    return links, addrs, routes


class Recorder:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> None:
        self.calls.append(list(argv))


def test_netlink_sees_what_the_namespace_holds(ns: str, fake_sysfs: Path) -> None:
    facts = facts_in(ns, fake_sysfs)
    assert facts.nics["dr4"].default_v4 and not facts.nics["dr4"].addresses
    assert facts.nics["dr6"].default_v6 and not facts.nics["dr6"].default_v4
    assert facts.nics["ad0"].addresses == ("10.78.0.2/24",) and not facts.nics["ad0"].default_route
    # ll0 has only its fe80:: address: not one the operator uses.
    assert facts.nics["ll0"].addresses == () and facts.nics["cl0"].addresses == ()
    assert facts.resolve("cl0") == ("cl0", PORTS["cl0"][0])


@pytest.mark.parametrize(("port", "reason"), [
    ("mg0", "it is the management NIC"),
    ("dr4", "it carries the IPv4 default route"),
    ("pr0", "it carries the IPv4 default route"),  # table 100's
    ("mp1", "it carries the IPv4 default route"),  # a multipath hop
    ("dr6", "it carries the IPv6 default route"),
    ("ad0", "it holds 10.78.0.2/24"),
])
def test_refused_and_nothing_changed(ns: str, fake_sysfs: Path, port: str, reason: str) -> None:
    before = snapshot(ns)
    facts = facts_in(ns, fake_sysfs)
    devbind = Recorder()
    with pytest.raises(ProvisionRefused, match=reason):
        nics.plan_nics(facts, "cl0", [port], dataplane="dpdk", management="mg0",
                       sysfs=fake_sysfs, runner=devbind)
    assert devbind.calls == [] and snapshot(ns) == before
    assert nics.pci_driver(fake_sysfs, PORTS[port][0]) == "ixgbe"
    # With dataplane: auto the same NIC is a reason to fall back to XDP.
    plan = nics.plan_nics(facts, "cl0", [port], dataplane="auto", management="mg0")
    assert plan.dataplane == "xdp" and plan.message and reason in plan.message


def test_the_ssh_connections_nic_is_refused(ns: str, fake_sysfs: Path) -> None:
    facts = facts_in(ns, fake_sysfs, ssh="10.77.0.9 51000 10.78.0.2 22")
    assert facts.ssh_nic() == "ad0"
    with pytest.raises(ProvisionRefused, match=r"the SSH connection \(10.78.0.2\) came in on it"):
        nics.check_bindable(facts, ["ad0"])


def test_clean_ports_would_be_bound(ns: str, fake_sysfs: Path) -> None:
    facts = facts_in(ns, fake_sysfs)
    plan = nics.plan_nics(facts, "cl0", ["ll0"], dataplane="dpdk", management="mg0",
                          sysfs=fake_sysfs, runner=Recorder())
    assert plan.dataplane == "dpdk" and plan.ingress == PORTS["cl0"][0]
    assert [a.describe() for a in plan.actions[1:]] == [
        f"bind {PORTS['cl0'][0]} (cl0) to vfio-pci", f"bind {PORTS['ll0'][0]} (ll0) to vfio-pci"]


def test_prepare_reads_the_namespace_it_runs_in(ns: str, fake_sysfs: Path,
                                                 tmp_path: Path) -> None:
    """hpclb-prepare's refusals look at the addresses and routes of the
    namespace it runs in (the host's at boot); a refusal changes nothing."""
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    (root / "proc/mounts").write_text("bpf /sys/fs/bpf bpf rw 0 0\n")
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["appliance"].update({"netns": None, "dataplane": "dpdk",
                             "interfaces": {"ingress": PORTS["cl0"][0],
                                            "egress": [PORTS["dr4"][0]]}})
    cfg = tmp_path / "hpclb.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    before = snapshot(ns)
    devbind, lines = Recorder(), []
    with inside(ns):
        status = prepare.run(cfg, root=root, sysfs=fake_sysfs, proc=root / "proc",
                             runner=devbind, out=lines.append)
    assert status == EXIT_REFUSED, lines
    assert any("dr4" in line and "IPv4 default route" in line for line in lines)
    assert devbind.calls == [] and snapshot(ns) == before
    assert not (root / "sys/fs/bpf/hpclb").exists()
    # Without the refused port, the same run gets as far as the (fake) binding.
    doc["appliance"]["interfaces"] = {"ingress": PORTS["cl0"][0]}
    cfg.write_text(yaml.safe_dump(doc))
    check_lines: list[str] = []
    with inside(ns):
        assert prepare.run(cfg, check=True, root=root, sysfs=fake_sysfs, proc=root / "proc",
                           runner=devbind, out=check_lines.append) == EXIT_OK
    assert any(line.startswith(f"would change: bind {PORTS['cl0'][0]} (cl0)")
               for line in check_lines)
    assert devbind.calls == []


def test_live_sysctls_land_in_a_scratch_namespace() -> None:
    """The live step of the sysctls (a backend's DSR settings, the gateway's
    NAT forwarding) against a real /proc/sys: net.* is per network namespace,
    so a child in a fresh one (unshare -n) changes nothing outside it."""
    code = (
        "from pathlib import Path\n"
        "from hpclb.provision import sysctls\n"
        "from hpclb.provision.plan import Context, run_plan\n"
        "ctx = Context(root=Path('/nonexistent'), live=True, check=False, src=Path('.'))\n"
        "acts = [a for a in sysctls.sysctl_actions('node', sysctls.backend_sysctls(['dsr'])\n"
        "        + sysctls.gateway_sysctls({'vips': [{'mode': 'nat', 'address': '192.0.2.1'}]}))\n"
        "        if a.live_only]\n"
        "print('first', run_plan(acts, ctx))\n"
        "print('second', run_plan(acts, ctx))\n"
        "for k in ('net.ipv4.conf.all.arp_ignore', 'net.ipv4.conf.all.arp_announce',\n"
        "          'net.ipv4.conf.all.rp_filter', 'net.ipv4.ip_forward'):\n"
        "    print(k, sysctls.proc_path(Path('/proc'), k).read_text().strip())\n")
    before = {k: sysctls_value(k) for k in ("net.ipv4.conf.all.arp_ignore", "net.ipv4.ip_forward")}
    res = subprocess.run(["unshare", "-n", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "first 1" in out and "second 0" in out and "provision: no change" in out
    for line in ("net.ipv4.conf.all.arp_ignore 1", "net.ipv4.conf.all.arp_announce 2",
                 "net.ipv4.conf.all.rp_filter 2", "net.ipv4.ip_forward 1"):
        assert line in out
    assert {k: sysctls_value(k) for k in before} == before  # this namespace: untouched


def sysctls_value(key: str) -> str:
    return (Path("/proc/sys") / key.replace(".", "/")).read_text().strip()
