"""Backend MAC resolution from the neighbour table, ARPing when it is missing.

DSR forwarding rewrites the destination MAC, so every backend's MAC must be
known before its first slot is pushed. The kernel's neighbour table is the
source of truth; when an entry is absent or unresolved we make the kernel ARP
for it (one ping) and read the table again.
"""

from __future__ import annotations

import ipaddress
import subprocess
import time

from pyroute2 import IPRoute, NetNS

NUD_VALID = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80  # reachable|stale|delay|probe|noarp|permanent


class NeighbourError(RuntimeError):
    pass


def _lookup(addr: ipaddress.IPv4Address, netns: str | None) -> str | None:
    ipr = NetNS(netns) if netns else IPRoute()
    try:
        for entry in ipr.get_neighbours(dst=str(addr)):
            mac = entry.get_attr("NDA_LLADDR")
            if mac and entry["state"] & NUD_VALID:
                return str(mac).lower()
        return None
    finally:
        ipr.close()


def _solicit(addr: ipaddress.IPv4Address, netns: str | None) -> None:
    argv = ["ping", "-c", "1", "-W", "1", "-q", str(addr)]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    subprocess.run(argv, check=False, capture_output=True, timeout=5)


def resolve_mac(addr: ipaddress.IPv4Address, netns: str | None = None, tries: int = 3) -> str:
    """MAC of ``addr`` as seen from the appliance (optionally inside ``netns``)."""
    for attempt in range(tries):
        mac = _lookup(addr, netns)
        if mac:
            return mac
        _solicit(addr, netns)
        time.sleep(0.05 * (attempt + 1))
    raise NeighbourError(f"no MAC address for backend {addr}: it did not answer ARP")
