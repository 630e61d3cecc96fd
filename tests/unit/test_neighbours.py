"""Backend MAC resolution in real network namespaces: ARP and NDP for a
backend on a connected network, the next hop's MAC for a routed one (tunnel
mode), and errors that say which protocol went unanswered.

    appliance (lb)                 backend (bk)
      a0 10.1.0.1 fd00:1::1  ----  b0 10.1.0.2 fd00:1::2        02:00:00:00:01:02
      a1 10.2.0.1 fd00:2::1  ----  r0 10.2.0.2 fd00:2::2 fe80::2 02:00:00:00:02:02
                                  router (gw)
    lb's routes: 10.3.0.0/24 via 10.2.0.2, fd00:3::/64 via fd00:2::2,
                 fd00:4::/64 via fe80::2 dev a1 (a link-local next hop)
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from hpclb.host.neighbours import NeighbourError, next_hop, resolve_mac

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces")

BACKEND_MAC = "02:00:00:00:01:02"
ROUTER_MAC = "02:00:00:00:02:02"


@dataclass(frozen=True)
class Lab:
    lb: str
    bk: str
    gw: str


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=10)


def neighbours(ns: str, family: str) -> str:
    return subprocess.run(["ip", "-n", ns, family, "neigh", "show"], check=True,
                          capture_output=True, text=True, timeout=10).stdout


@pytest.fixture
def lab() -> Iterator[Lab]:
    tag = uuid.uuid4().hex[:6]
    lab = Lab(f"hlbn-lb-{tag}", f"hlbn-bk-{tag}", f"hlbn-gw-{tag}")
    made: list[str] = []
    try:
        for ns in (lab.lb, lab.bk, lab.gw):
            sh("ip", "netns", "add", ns)
            made.append(ns)
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=0")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        for mine, peer, ns, mac in (("a0", "b0", lab.bk, BACKEND_MAC),
                                    ("a1", "r0", lab.gw, ROUTER_MAC)):
            sh("ip", "-n", lab.lb, "link", "add", mine, "type", "veth", "peer", "name", peer,
               "netns", ns)
            sh("ip", "-n", ns, "link", "set", peer, "address", mac)
            sh("ip", "-n", lab.lb, "link", "set", mine, "up")
            sh("ip", "-n", ns, "link", "set", peer, "up")
        for ns, dev, addrs in ((lab.lb, "a0", ("10.1.0.1/24", "fd00:1::1/64")),
                               (lab.bk, "b0", ("10.1.0.2/24", "fd00:1::2/64")),
                               (lab.lb, "a1", ("10.2.0.1/24", "fd00:2::1/64")),
                               (lab.gw, "r0", ("10.2.0.2/24", "fd00:2::2/64", "fe80::2/64"))):
            for addr in addrs:
                sh("ip", "-n", ns, "addr", "add", addr, "dev", dev, "nodad")
        sh("ip", "-n", lab.lb, "route", "add", "10.3.0.0/24", "via", "10.2.0.2")
        sh("ip", "-n", lab.lb, "-6", "route", "add", "fd00:3::/64", "via", "fd00:2::2")
        sh("ip", "-n", lab.lb, "-6", "route", "add", "fd00:4::/64", "via", "fe80::2", "dev", "a1")
        yield lab
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False, timeout=10)


def test_an_ipv6_backend_is_resolved_over_ndp(lab: Lab) -> None:
    assert "fd00:1::2 " not in neighbours(lab.lb, "-6")  # nothing cached: it must solicit
    mac = resolve_mac(ipaddress.IPv6Address("fd00:1::2"), lab.lb)
    assert mac == BACKEND_MAC
    assert "fd00:1::2 dev a0 lladdr 02:00:00:00:01:02" in neighbours(lab.lb, "-6")


def test_an_ipv4_backend_is_still_resolved_over_arp(lab: Lab) -> None:
    assert resolve_mac(ipaddress.IPv4Address("10.1.0.2"), lab.lb) == BACKEND_MAC
    # routed changes nothing for a backend on a connected network
    assert resolve_mac(ipaddress.IPv4Address("10.1.0.2"), lab.lb, routed=True) == BACKEND_MAC


@pytest.mark.parametrize(("backend", "gateway"), [
    ("10.3.0.7", "10.2.0.2"),
    ("fd00:3::7", "fd00:2::2"),
    ("fd00:4::7", "fe80::2"),  # a link-local next hop: solicited on its interface
])
def test_a_routed_backend_gets_its_next_hops_mac(lab: Lab, backend: str, gateway: str) -> None:
    addr = ipaddress.ip_address(backend)
    hop = next_hop(addr, lab.lb)
    assert (str(hop.gateway), hop.ifname) == (gateway, "a1")
    # the backend itself answers nothing (it does not exist): only the router is asked
    assert resolve_mac(addr, lab.lb, routed=True) == ROUTER_MAC


@pytest.mark.parametrize("backend", ["10.3.0.7", "fd00:3::7"])
def test_a_routed_backend_is_refused_outside_tunnel_mode(lab: Lab, backend: str) -> None:
    with pytest.raises(NeighbourError, match=r"is not on a connected network \(its route goes "
                       r"through .* on a1\): only a tunnel VIP"):
        resolve_mac(ipaddress.ip_address(backend), lab.lb)


@pytest.mark.parametrize(("backend", "words"), [
    ("10.1.0.99", "no MAC address for backend 10.1.0.99: it did not answer ARP"),
    ("fd00:1::99", "no MAC address for backend fd00:1::99: it did not answer NDP"),
])
def test_a_silent_backend_names_the_protocol(lab: Lab, backend: str, words: str) -> None:
    with pytest.raises(NeighbourError) as info:
        resolve_mac(ipaddress.ip_address(backend), lab.lb, tries=1)
    assert str(info.value) == words


def test_a_silent_next_hop_is_named(lab: Lab) -> None:
    sh("ip", "-n", lab.lb, "-6", "route", "add", "fd00:5::/64", "via", "fd00:2::99")
    with pytest.raises(NeighbourError) as info:
        resolve_mac(ipaddress.IPv6Address("fd00:5::1"), lab.lb, tries=1, routed=True)
    assert str(info.value) == ("no MAC address for backend fd00:5::1's next hop fd00:2::99 "
                               "on a1: it did not answer NDP")


@pytest.mark.parametrize(("backend", "words"), [
    ("fd00:99::1", "no route to backend fd00:99::1"),  # lb has no default route
    ("10.1.0.1", "backend 10.1.0.1 is an address of the appliance itself"),
])
def test_no_route_and_own_addresses_are_errors(lab: Lab, backend: str, words: str) -> None:
    with pytest.raises(NeighbourError, match=words):
        resolve_mac(ipaddress.ip_address(backend), lab.lb, routed=True)
