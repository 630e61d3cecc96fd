"""The kernel's side of the DPDK forwarder's exception path.

While hpclb-dpdk owns a port, the kernel no longer sees the wire through that
interface (AF_XDP steers every frame to the forwarder; a vfio-bound NIC has no
kernel interface at all). What is not for a VIP reaches the kernel through the
port's TAP instead, so the appliance's own addresses and routes must live on
the TAP: management traffic, ARP for the appliance, and the neighbour
resolution the control plane relies on (backend MACs) keep working.

``hand_over`` moves the IPv4 addresses and the routes of a vdev's kernel
interface onto its TAP, recording what it moved in a JSON file so that a
control plane restarted later still knows; ``give_back`` puts them back when
the forwarder stops for good. A TAP that the forwarder re-creates after a
crash gets the recorded addresses again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute, NetlinkError, NetNS

log = logging.getLogger("hpclb.exception_path")

RT_TABLE_MAIN = 254
EEXIST = 17
ESRCH = 3
TAP_WAIT_S = 5.0


def _ipr(netns: str | None) -> IPRoute | NetNS:
    return NetNS(netns) if netns else IPRoute()


def _index(ipr: IPRoute | NetNS, ifname: str) -> int | None:
    found = ipr.link_lookup(ifname=ifname)
    return found[0] if found else None


def _addresses(ipr: IPRoute | NetNS, index: int) -> list[dict[str, Any]]:
    return [{"address": a.get_attr("IFA_ADDRESS"), "prefixlen": a["prefixlen"]}
            for a in ipr.get_addr(family=2, index=index)]


def _routes(ipr: IPRoute | NetNS, index: int) -> list[dict[str, Any]]:
    """Routes through the interface that its addresses do not bring along
    (gateways and other static routes of the main table)."""
    out = []
    for r in ipr.get_routes(family=2, table=RT_TABLE_MAIN, oif=index):
        if r["proto"] == 2:  # RTPROT_KERNEL: re-created with the address
            continue
        route = {"dst_len": r["dst_len"]}
        for attr, key in (("RTA_DST", "dst"), ("RTA_GATEWAY", "gateway"),
                          ("RTA_PRIORITY", "priority")):
            value = r.get_attr(attr)
            if value is not None:
                route[key] = value
        out.append(route)
    return out


def _move(ipr: IPRoute | NetNS, record: dict[str, Any], src: int | None, dst: int) -> None:
    for a in record["addresses"]:
        try:
            ipr.addr("add", index=dst, address=a["address"], prefixlen=a["prefixlen"])
        except NetlinkError as exc:
            if exc.code != EEXIST:
                raise
        if src is not None:
            with contextlib.suppress(NetlinkError):
                ipr.addr("del", index=src, address=a["address"], prefixlen=a["prefixlen"])
    ipr.link("set", index=dst, state="up")
    for r in record["routes"]:
        try:
            ipr.route("replace", oif=dst, **r)
        except NetlinkError as exc:
            log.warning("route %s could not follow the addresses: %s", r, exc)


def hand_over(iface: str, tap: str, record_path: Path, netns: str | None = None) -> int:
    """Moves iface's IPv4 addresses and routes onto tap. Returns how many
    addresses tap carries afterwards."""
    ipr = _ipr(netns)
    try:
        deadline = time.monotonic() + TAP_WAIT_S
        while (tap_index := _index(ipr, tap)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"exception interface {tap} did not appear")
            time.sleep(0.05)
        src = _index(ipr, iface)
        current = _addresses(ipr, src) if src is not None else []
        if current:
            record = {"iface": iface, "addresses": current, "routes": _routes(ipr, src)}
            record_path.parent.mkdir(parents=True, exist_ok=True)
            record_path.write_text(json.dumps(record))
        elif record_path.exists():
            record = json.loads(record_path.read_text())  # handed over before a restart
        else:
            return 0
        _move(ipr, record, src, tap_index)
        log.info("exception path: %s's addresses %s are on %s", iface,
                 ", ".join(f"{a['address']}/{a['prefixlen']}" for a in record["addresses"]),
                 tap)
        return len(_addresses(ipr, tap_index))
    finally:
        ipr.close()


def give_back(record_path: Path, netns: str | None = None) -> None:
    """Puts the recorded addresses and routes back on their interface."""
    if not record_path.exists():
        return
    record = json.loads(record_path.read_text())
    ipr = _ipr(netns)
    try:
        index = _index(ipr, record["iface"])
        if index is not None:
            _move(ipr, record, None, index)
            log.info("gave %s its addresses back", record["iface"])
    finally:
        ipr.close()
    record_path.unlink()


def detach_xdp(iface: str, netns: str | None = None) -> None:
    """Removes any XDP program from iface: one a killed AF_XDP port left behind
    would make the next forwarder's attach fail."""
    base = ["ip", "-n", netns] if netns else ["ip"]
    for mode in ("xdp", "xdpgeneric"):
        subprocess.run([*base, "link", "set", "dev", iface, mode, "off"],
                       capture_output=True, check=False)
