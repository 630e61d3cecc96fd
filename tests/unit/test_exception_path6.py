"""The DPDK exception path's kernel side over IPv6, in real network namespaces:
hand_over/give_back move the IPv6 addresses (not the link-local ones) and
routes to the TAP and back, claim_vips makes IPv6 VIPs silent (a /128
blackhole, their /128 addresses off lo), and records written before IPv6
(version 1, IPv4 only) are still read and given back.

The IPv4 cases are test_dpdk_forwarder.py's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclb.dataplane import exception_path

from .exception_ns import appliance_and_client, probe_vip, sh, veth_netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces"),
]

NO_DAD = ("net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0")


def addrs6(ns: str, dev: str) -> str:
    return sh("ip", "-n", ns, "-6", "-o", "addr", "show", "dev", dev)


def routes6(ns: str, prefix: str) -> str:
    return sh("ip", "-n", ns, "-6", "route", "show", prefix)


@pytest.fixture
def netns() -> Iterator[str]:
    """d0 (the kernel interface: 198.18.7.2/24 and fd00:7::2/64, a static IPv6
    route and an IPv6 default route) and its veth peer d1, all up; the TAP is
    made by each test (a veth end stands in for it)."""
    with veth_netns("hlb6") as name:
        sh("ip", "-n", name, "addr", "add", "198.18.7.2/24", "dev", "d0")
        sh("ip", "-n", name, "addr", "add", "fd00:7::2/64", "dev", "d0", "nodad")
        sh("ip", "-n", name, "route", "add", "fd01::/48", "via", "fd00:7::1", "dev", "d0")
        sh("ip", "-n", name, "route", "add", "default", "via", "fe80::1", "dev", "d0")
        yield name


def make_tap(ns: str) -> None:
    sh("ip", "-n", ns, "link", "add", "exc0", "type", "veth", "peer", "name", "exc0p")
    sh("ip", "-n", ns, "link", "set", "exc0p", "up")


def test_ipv6_addresses_and_routes_move_to_the_tap_and_back(netns: str,
                                                            tmp_path: Path) -> None:
    make_tap(netns)
    record = tmp_path / "exc0.addresses.json"
    assert exception_path.hand_over("d0", "exc0", record, netns) == 2
    tap = [line for line in addrs6(netns, "exc0").splitlines() if "fd00:7::2/64" in line]
    assert len(tap) == 1 and "tentative" not in tap[0]  # usable at once: no DAD
    d0 = addrs6(netns, "d0")
    assert "fd00:7::2" not in d0 and "fe80::" in d0  # its link-local stays on it
    assert "fe80::" not in json.dumps(json.loads(record.read_text())["addresses"])
    assert "via fd00:7::1 dev exc0" in routes6(netns, "fd01::/48")
    assert "dev d0" not in routes6(netns, "fd01::/48")
    assert "via fe80::1 dev exc0" in routes6(netns, "default")
    assert "198.18.7.2/24" in sh("ip", "-n", netns, "-4", "-o", "addr", "show", "dev", "exc0")
    # A re-created (empty) TAP gets both families back from the record.
    sh("ip", "-n", netns, "link", "del", "exc0")
    make_tap(netns)
    assert exception_path.hand_over("d0", "exc0", record, netns) == 2
    assert "via fd00:7::1 dev exc0" in routes6(netns, "fd01::/48")
    # The forwarder stops for good (its TAP goes with it): all back on d0.
    sh("ip", "-n", netns, "link", "del", "exc0")
    exception_path.give_back(record, netns)
    assert not record.exists()
    assert "fd00:7::2/64" in addrs6(netns, "d0")
    assert "via fd00:7::1 dev d0" in routes6(netns, "fd01::/48")
    assert "via fe80::1 dev d0" in routes6(netns, "default")


def test_a_record_from_before_ipv6_is_completed_and_given_back(netns: str,
                                                               tmp_path: Path) -> None:
    """What a version 1 hand_over (IPv4 only) left: d0's IPv4 address on the
    TAP, its IPv6 ones still on d0, a record without them. The next hand_over
    (the control plane upgraded, the forwarder adopted) moves the IPv6 ones
    and keeps the IPv4 ones in the record; give_back returns everything."""
    make_tap(netns)
    sh("ip", "-n", netns, "link", "set", "exc0", "up")
    sh("ip", "-n", netns, "addr", "del", "198.18.7.2/24", "dev", "d0")
    sh("ip", "-n", netns, "addr", "add", "198.18.7.2/24", "dev", "exc0")
    sh("ip", "-n", netns, "route", "add", "198.19.0.0/16", "via", "198.18.7.1", "dev", "exc0")
    record = tmp_path / "exc0.addresses.json"
    record.write_text(json.dumps({
        "iface": "d0", "addresses": [{"address": "198.18.7.2", "prefixlen": 24}],
        "routes": [{"dst_len": 16, "dst": "198.19.0.0", "gateway": "198.18.7.1"}]}))
    assert exception_path.hand_over("d0", "exc0", record, netns) == 2
    saved = json.loads(record.read_text())
    assert saved["version"] == 2
    assert saved["addresses"] == [{"address": "198.18.7.2", "prefixlen": 24},
                                  {"address": "fd00:7::2", "prefixlen": 64}]
    assert "fd00:7::2/64" in addrs6(netns, "exc0")
    exception_path.give_back(record, netns)
    v4 = sh("ip", "-n", netns, "-4", "-o", "addr", "show", "dev", "d0")
    assert "198.18.7.2/24" in v4 and "fd00:7::2/64" in addrs6(netns, "d0")
    assert "dev d0" in sh("ip", "-n", netns, "route", "show", "198.19.0.0/16")
    assert "via fd00:7::1 dev d0" in routes6(netns, "fd01::/48")


VIPS6 = ("fd00:1::10", "fd00:1::11")


@pytest.fixture
def two_namespaces() -> Iterator[tuple[str, str]]:
    """An appliance namespace (fd00:7::2/64 on d0; the VIPs fd00:1::10, ::11 and
    198.18.1.10 on lo) and a client namespace (fd00:7::1/64) routing
    fd00:1::/64 through it."""
    with appliance_and_client("hlb6v", "fd00:7::2/64", "fd00:7::1/64", "nodad",
                              sysctls=NO_DAD) as (app, cli):
        for vip in VIPS6:
            sh("ip", "-n", app, "addr", "add", f"{vip}/128", "dev", "lo")
        sh("ip", "-n", app, "addr", "add", "198.18.1.10/32", "dev", "lo")
        sh("ip", "-n", cli, "route", "add", "fd00:1::/64", "via", "fd00:7::2")
        yield app, cli


def test_the_kernel_gives_up_ipv6_vips_silently_and_gets_them_back(
        two_namespaces: tuple[str, str], tmp_path: Path) -> None:
    app, cli = two_namespaces

    def probe(vip: str) -> str:
        return probe_vip(cli, vip)

    def lo() -> str:
        return sh("ip", "-n", app, "-o", "addr", "show", "dev", "lo")

    def blackholes() -> str:
        return (sh("ip", "-n", app, "-6", "route", "show", "type", "blackhole")
                + sh("ip", "-n", app, "-4", "route", "show", "type", "blackhole"))

    assert probe(VIPS6[0]) == "udp-icmp tcp-rst"  # the kernel holds the VIP
    record = tmp_path / "gw.vips.addresses.json"
    done = exception_path.claim_vips([*VIPS6, "198.18.1.10"], record, app)
    assert sorted(done["taken"]) == ["198.18.1.10@lo", "fd00:1::10@lo", "fd00:1::11@lo"]
    assert "fd00:1::" not in lo() and "198.18.1.10" not in lo()
    assert all(v in blackholes() for v in (*VIPS6, "198.18.1.10"))
    for forwarding in ("0", "1"):
        sh("ip", "netns", "exec", app, "sysctl", "-qw",
           f"net.ipv6.conf.all.forwarding={forwarding}")
        assert probe(VIPS6[0]) == "udp-silent tcp-silent", forwarding
    # Idempotent, whatever the spelling of the addresses.
    assert exception_path.claim_vips(["FD00:1:0::11", "198.18.1.10", "fd00:1::10"], record,
                                     app) == {"taken": [], "blackholed": [], "released": []}
    # A reload drops fd00:1::10: its address comes back, its blackhole goes.
    done = exception_path.claim_vips([VIPS6[1], "198.18.1.10"], record, app)
    assert done["released"] == ["fd00:1::10"]
    assert "fd00:1::10/128" in lo() and "fd00:1::10" not in blackholes()
    assert "fd00:1::11/128" not in lo() and "fd00:1::11" in blackholes()
    assert {"iface": "lo", "address": "fd00:1::11", "prefixlen": 128} in json.loads(
        record.read_text())["addresses"]
    # The appliance's own subnet address as a VIP is left alone.
    done = exception_path.claim_vips([VIPS6[1], "198.18.1.10", "fd00:7::2"], record, app)
    assert done == {"taken": [], "blackholed": [], "released": []}
    assert "fd00:7::2/64" in addrs6(app, "d0")
    # The forwarder stops for good: all back, no blackhole, no record.
    exception_path.give_back(record, app)
    assert not record.exists()
    assert all(f"{v}/128" in lo() for v in VIPS6) and "198.18.1.10/32" in lo()
    assert blackholes().strip() == ""
    assert probe(VIPS6[1]) == "udp-icmp tcp-rst"


def test_a_vip_record_from_before_ipv6_is_given_back(two_namespaces: tuple[str, str],
                                                      tmp_path: Path) -> None:
    """A version 1 VIP record (IPv4 only, no version) as that code left the
    kernel: the address off lo, a /32 blackhole."""
    app, _ = two_namespaces
    sh("ip", "-n", app, "addr", "del", "198.18.1.10/32", "dev", "lo")
    sh("ip", "-n", app, "route", "add", "blackhole", "198.18.1.10/32")
    record = tmp_path / "gw.vips.addresses.json"
    record.write_text(json.dumps({
        "kind": "vips", "addresses": [{"iface": "lo", "address": "198.18.1.10",
                                       "prefixlen": 32}],
        "blackholes": ["198.18.1.10"]}))
    exception_path.give_back(record, app)
    assert not record.exists()
    assert "198.18.1.10/32" in sh("ip", "-n", app, "-4", "-o", "addr", "show", "dev", "lo")
    assert sh("ip", "-n", app, "-4", "route", "show", "type", "blackhole").strip() == ""
