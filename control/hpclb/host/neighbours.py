"""Backend MAC resolution from the kernel's neighbour table: ARP for IPv4,
NDP for IPv6, through the next hop for a routed (tunnel mode) backend.

DSR and tunnel forwarding write the destination MAC, so every backend's MAC
must be known before its first slot is pushed. The kernel is the source of
truth: a route lookup says whether the backend is on a connected network
(the MAC is its own) or behind a router (the MAC is the router's, the next
hop of the route to it: only a tunnel VIP's frames, whose outer destination
is the backend, may go there). When the neighbour entry is absent or
unresolved we make the kernel solicit it (one ping: ARP or a Neighbor
Solicitation) and read the table again.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute, NetNS
from pyroute2.netlink.exceptions import NetlinkError

NUD_VALID = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80  # reachable|stale|delay|probe|noarp|permanent
RTN_UNICAST = 1
RTN_LOCAL = 2

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class NeighbourError(RuntimeError):
    pass


def protocol(addr: IPAddress) -> str:
    """The neighbour protocol of an address's family, as error messages name it."""
    return "ARP" if addr.version == 4 else "NDP"


@dataclass(frozen=True)
class NextHop:
    """Where frames to a destination go: to ``gateway`` (routed) or to the
    destination itself (``gateway`` None: on a connected network), by the
    interface ``ifindex`` (``ifname``)."""

    gateway: IPAddress | None
    ifindex: int | None
    ifname: str | None


def _ipr(netns: str | None) -> Any:
    return NetNS(netns) if netns else IPRoute()


def _gateway(route: Any) -> IPAddress | None:
    gw = route.get_attr("RTA_GATEWAY")
    if gw is None:  # an IPv4 route through an IPv6 router (RFC 5549): RTA_VIA
        via = route.get_attr("RTA_VIA")
        gw = via.get("addr") if isinstance(via, dict) else None
    return ipaddress.ip_address(gw) if gw else None


def next_hop(addr: IPAddress, netns: str | None = None) -> NextHop:
    """The kernel's route to ``addr`` (``ip route get``), in ``netns``."""
    ipr = _ipr(netns)
    try:
        try:
            routes = ipr.route("get", dst=str(addr))
        except NetlinkError as err:
            raise NeighbourError(f"no route to backend {addr}: {err.args[-1]}") from None
        if not routes:
            raise NeighbourError(f"no route to backend {addr}")
        route = routes[0]
        if route["type"] == RTN_LOCAL:
            raise NeighbourError(f"backend {addr} is an address of the appliance itself")
        if route["type"] != RTN_UNICAST:
            raise NeighbourError(f"no route to backend {addr} (route type {route['type']})")
        oif = route.get_attr("RTA_OIF")
        ifname = None
        if oif is not None:
            links = ipr.get_links(oif)
            ifname = links[0].get_attr("IFLA_IFNAME") if links else None
        return NextHop(_gateway(route), oif, ifname)
    finally:
        ipr.close()


def _lookup(addr: IPAddress, ifindex: int | None, netns: str | None) -> str | None:
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    ipr = _ipr(netns)
    try:
        for entry in ipr.get_neighbours(family=family, dst=str(addr)):
            if ifindex is not None and entry["ifindex"] != ifindex:
                continue  # a link-local next hop's address is per link
            mac = entry.get_attr("NDA_LLADDR")
            if mac and entry["state"] & NUD_VALID:
                return str(mac).lower()
        return None
    finally:
        ipr.close()


def _solicit(addr: IPAddress, ifname: str | None, netns: str | None) -> None:
    """One ping: the kernel resolves the neighbour first (ARP or NDP), whether
    or not the echo is answered. By the interface when known (a link-local
    IPv6 next hop needs it)."""
    argv = ["ping", f"-{addr.version}", "-c", "1", "-W", "1", "-q"]
    if ifname:
        argv += ["-I", ifname]
    argv.append(str(addr))
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    subprocess.run(argv, check=False, capture_output=True, timeout=5)


def resolve_mac(addr: IPAddress, netns: str | None = None, tries: int = 3,
                routed: bool = False) -> str:
    """The MAC a backend entry for ``addr`` carries, as seen from the appliance
    (optionally inside ``netns``): on a connected network, ``addr``'s own
    (ARP or NDP); behind a router, the next hop's when ``routed`` (tunnel
    mode, whose outer destination is the backend), else NeighbourError (a
    DSR or NAT frame sent to a router would not reach the backend)."""
    hop = next_hop(addr, netns)
    via = f" on {hop.ifname}" if hop.ifname else ""
    if hop.gateway is not None and not routed:
        raise NeighbourError(
            f"backend {addr} is not on a connected network (its route goes through "
            f"{hop.gateway}{via}): only a tunnel VIP (mode: tunnel) reaches a routed backend")
    target = hop.gateway if hop.gateway is not None else addr
    for attempt in range(tries):
        mac = _lookup(target, hop.ifindex, netns)
        if mac:
            return mac
        _solicit(target, hop.ifname, netns)
        time.sleep(0.05 * (attempt + 1))
    if hop.gateway is not None:
        raise NeighbourError(f"no MAC address for backend {addr}'s next hop {hop.gateway}"
                             f"{via}: it did not answer {protocol(target)}")
    raise NeighbourError(f"no MAC address for backend {addr}: it did not answer "
                         f"{protocol(target)}")
