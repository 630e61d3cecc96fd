"""The kernel's side of the DPDK forwarder's exception path.

While hpclb-dpdk owns a port, the kernel no longer sees the wire through that
interface (AF_XDP steers every frame to the forwarder; a vfio-bound NIC has no
kernel interface at all). What is not for a VIP reaches the kernel through the
port's TAP instead, so the appliance's own addresses and routes must live on
the TAP: management traffic, ARP for the appliance, and the neighbour
resolution the control plane relies on (backend MACs) keep working.

``hand_over`` moves the addresses and the routes of a vdev's kernel interface
onto its TAP, recording what it moved in a JSON file so that a control plane
restarted later still knows; ``give_back`` puts them back when the forwarder
stops for good. A TAP that the forwarder re-creates after a crash gets the
recorded addresses again. Both families move: IPv4 addresses, and the IPv6
ones but link-local (fe80::/10, which each interface keeps: the kernel makes
one for the TAP, and the kernel interface's own stays on it), so that the
kernel answers Neighbor Solicitations for the appliance's IPv6 addresses
behind the TAP as it answers ARP; IPv6 addresses go onto the TAP without
duplicate address detection (they were the host's a moment ago, and a
tentative address would neither answer nor send for a second).

The VIPs are the forwarder's alone: it answers ARP for them, and what reaches
the kernel for a VIP (through the TAP, or through the stale AF_XDP program of a
killed forwarder, which passes every frame to the kernel until the next one
starts) must not be answered by the kernel, which would send ICMP port
unreachable for UDP and RST for TCP from the VIP. ``claim_vips`` takes every
VIP address off the kernel's interfaces (an XDP appliance keeps them on ``lo``,
where the kernel must accept what XDP passes), recording where each was, and
installs a ``blackhole`` route for each VIP: the kernel drops such packets
silently, with or without ip_forward (a blackhole sends no ICMP, unlike
``unreachable`` or ``prohibit``). A VIP that a reload removes, and every VIP
when the forwarder stops for good (``give_back`` of the VIP record), gets its
addresses back and loses its blackhole. A VIP that is also an interface's
subnet address (not a /32, for IPv6 not a /128) is the appliance's own
address: it is left alone, with a warning. IPv6 VIPs are claimed as IPv4 ones
are: a /128 blackhole (the kernel's IPv6 blackhole is as silent: no ICMPv6,
no RST), their /128 addresses off every interface.

The records are JSON, version 2 since IPv6: the same keys as version 1 (which
had no ``version``), IPv6 entries beside the IPv4 ones, the family told by the
address (and a ``family`` in IPv6 routes), so that a version 1 record is read
as it is. A version 1 control plane reading a version 2 record puts IPv6
addresses back too, but would leave the IPv6 blackholes behind (it deletes
/32 routes only).

Every function takes an open netlink socket (``open_netlink``) or opens one in
the namespace for the call: a supervisor keeps one for its hooks, since
entering a namespace costs some 20 ms, which a restart should not pay.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute, NetlinkError, NetNS

log = logging.getLogger(__name__)

RT_TABLE_MAIN = 254
RTN_BLACKHOLE = 6
RTPROT_KERNEL = 2
RTPROT_STATIC = 4
AF_INET, AF_INET6 = 2, 10
IFA_F_NODAD = 0x02  # <linux/if_addr.h>
EEXIST = 17
EADDRNOTAVAIL = 99
TAP_WAIT_S = 5.0
VIP_RECORD_KIND = "vips"
RECORD_VERSION = 2  # module doc: IPv6 entries beside the IPv4 ones
LINK_LOCAL6 = ipaddress.IPv6Network("fe80::/10")

Netlink = IPRoute | NetNS


def open_netlink(netns: str | None = None) -> Netlink:
    """A netlink socket in ``netns`` (the caller's namespace for None); close it."""
    return NetNS(netns) if netns else IPRoute()



@contextlib.contextmanager
def _netlink(netns: str | None, ipr: Netlink | None) -> Iterator[Netlink]:
    """``ipr`` as it is, or one opened (and closed) for the call."""
    if ipr is not None:
        yield ipr
        return
    own = open_netlink(netns)
    try:
        yield own
    finally:
        own.close()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _read_record(path: Path) -> dict[str, Any] | None:
    """A record, None when there is none; one that cannot be read is named in
    a warning and treated as none (written atomically, so this is outside
    damage, and what it held is lost either way)."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        log.warning("exception path record %s cannot be read, ignored: %s", path, err)
        return None
    return record if isinstance(record, dict) else None


def _index(ipr: IPRoute | NetNS, ifname: str) -> int | None:
    found = ipr.link_lookup(ifname=ifname)
    return found[0] if found else None


def link_index(ifname: str, netns: str | None = None, *, ipr: Netlink | None = None
               ) -> int | None:
    """The interface's index, None while it does not exist."""
    with _netlink(netns, ipr) as nl:
        return _index(nl, ifname)


def _is_v6(address: str) -> bool:
    return ":" in address


def _addresses(ipr: IPRoute | NetNS, index: int) -> list[dict[str, Any]]:
    """The interface's IPv4 addresses, then its IPv6 ones but link-local."""
    v4 = [{"address": a.get_attr("IFA_ADDRESS"), "prefixlen": a["prefixlen"]}
          for a in ipr.get_addr(family=AF_INET, index=index)]
    v6 = [{"address": str(ipaddress.IPv6Address(a.get_attr("IFA_ADDRESS"))),
           "prefixlen": a["prefixlen"]}
          for a in ipr.get_addr(family=AF_INET6, index=index)
          if ipaddress.IPv6Address(a.get_attr("IFA_ADDRESS")) not in LINK_LOCAL6]
    return v4 + v6


def _routes(ipr: IPRoute | NetNS, index: int) -> list[dict[str, Any]]:
    """Routes through the interface that its addresses do not bring along
    (gateways and other static routes of the main table), IPv4 then IPv6."""
    out = []
    for family in (AF_INET, AF_INET6):
        for r in ipr.get_routes(family=family, table=RT_TABLE_MAIN, oif=index):
            if r["proto"] == RTPROT_KERNEL:  # re-created with the address (fe80::/64 too)
                continue
            route = {"dst_len": r["dst_len"]}
            if family == AF_INET6:  # a default route names no address to tell it by
                route["family"] = AF_INET6
            for attr, key in (("RTA_DST", "dst"), ("RTA_GATEWAY", "gateway"),
                              ("RTA_PRIORITY", "priority")):
                value = r.get_attr(attr)
                if value is not None:
                    route[key] = value
            out.append(route)
    return out


def _add_address(ipr: IPRoute | NetNS, index: int, address: str, prefixlen: int) -> bool:
    """Adds an address (present already is fine). An IPv4 failure raises; an
    IPv6 one (IPv6 disabled on the interface, say) is a warning and False:
    the address stays where it was rather than vanish."""
    if not _is_v6(address):
        try:
            ipr.addr("add", index=index, address=address, prefixlen=prefixlen)
        except NetlinkError as exc:
            if exc.code != EEXIST:
                raise
        return True
    try:
        ipr.addr("add", index=index, address=address, prefixlen=prefixlen,
                 family=AF_INET6, flags=IFA_F_NODAD)
    except NetlinkError as exc:
        if exc.code != EEXIST:
            log.warning("%s/%d cannot go onto interface %d: %s", address, prefixlen, index,
                        exc)
            return False
    return True


def _move(ipr: IPRoute | NetNS, record: dict[str, Any], src: int | None, dst: int) -> None:
    for a in record["addresses"]:
        if not _add_address(ipr, dst, a["address"], a["prefixlen"]):
            continue
        if src is not None:
            with contextlib.suppress(NetlinkError):
                ipr.addr("del", index=src, address=a["address"], prefixlen=a["prefixlen"])
    ipr.link("set", index=dst, state="up")
    for r in record["routes"]:
        try:
            ipr.route("replace", oif=dst, **r)
        except NetlinkError as exc:
            log.warning("route %s could not follow the addresses: %s", r, exc)


def hand_over(iface: str, tap: str, record_path: Path, netns: str | None = None, *,
              ipr: Netlink | None = None) -> int:
    """Moves iface's addresses (IPv4, IPv6 but link-local) and routes onto
    tap. Returns how many such addresses tap carries afterwards."""
    with _netlink(netns, ipr) as ipr:
        deadline = time.monotonic() + TAP_WAIT_S
        while (tap_index := _index(ipr, tap)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"exception interface {tap} did not appear")
            time.sleep(0.05)
        src = _index(ipr, iface)
        current = _addresses(ipr, src) if src is not None else []
        earlier = _read_record(record_path)
        if current:
            record = {"version": RECORD_VERSION, "iface": iface, "addresses": current,
                      "routes": _routes(ipr, src)}
            if earlier is not None and earlier.get("iface") == iface:
                # Handed over before (by this version, or by one that moved IPv4
                # only and left the IPv6 addresses here): what the record holds
                # is on the TAP, not here, and must still come back.
                for key in ("addresses", "routes"):
                    record[key] = earlier[key] + [e for e in record[key]
                                                  if e not in earlier[key]]
            _write_json(record_path, record)
        elif earlier is not None:
            record = earlier  # handed over before a restart
        else:
            return 0
        _move(ipr, record, src, tap_index)
        log.info("exception path: %s's addresses %s are on %s", iface,
                 ", ".join(f"{a['address']}/{a['prefixlen']}" for a in record["addresses"]),
                 tap)
        return len(_addresses(ipr, tap_index))


def give_back(record_path: Path, netns: str | None = None, *,
              ipr: Netlink | None = None) -> None:
    """Puts the recorded addresses and routes back on their interface; for a
    VIP record (``claim_vips``), the VIPs' addresses, and removes their
    blackhole routes."""
    if not record_path.exists():
        return
    record = json.loads(record_path.read_text())
    if record.get("kind") == VIP_RECORD_KIND:
        claim_vips((), record_path, netns, ipr=ipr)
        return
    with _netlink(netns, ipr) as ipr:
        index = _index(ipr, record["iface"])
        if index is not None:
            _move(ipr, record, None, index)
            log.info("gave %s its addresses back", record["iface"])
    record_path.unlink()


def _xdp_modes(ipr: Netlink, index: int) -> set[str]:
    """The XDP attach modes in use on an interface, as ``ip link`` names them."""
    links = ipr.get_links(index)
    xdp = links[0].get_attr("IFLA_XDP") if links else None
    if xdp is None:
        return set()
    attached = xdp.get_attr("IFLA_XDP_ATTACHED")
    modes = set()
    for mode, prog_id in (("xdpgeneric", "IFLA_XDP_SKB_PROG_ID"),
                          ("xdp", "IFLA_XDP_DRV_PROG_ID"),
                          ("xdpoffload", "IFLA_XDP_HW_PROG_ID")):
        if xdp.get_attr(prog_id) or attached == mode:
            modes.add(mode)
    if attached == "multi" and not modes:
        modes = {"xdp", "xdpgeneric"}
    return modes


def detach_xdp(iface: str, netns: str | None = None, *, ipr: Netlink | None = None) -> None:
    """Removes any XDP program from iface: one a killed AF_XDP port left behind
    would make the next forwarder's attach fail. Only the modes in use are
    detached (each detach costs the kernel some 20 ms on a veth)."""
    with _netlink(netns, ipr) as nl:
        index = _index(nl, iface)
        modes = {"xdp", "xdpgeneric"} if index is None else _xdp_modes(nl, index)
    base = ["ip", "-n", netns] if netns else ["ip"]
    for mode in sorted(modes):
        subprocess.run([*base, "link", "set", "dev", iface, mode, "off"],
                       capture_output=True, check=False)


# --- the VIPs ---------------------------------------------------------------


def _local(a: Any) -> str:
    """An address's own address, as ``str(ip_address(...))`` writes it."""
    return str(ipaddress.ip_address(a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS")))


def _host_len(address: str) -> int:
    return 128 if _is_v6(address) else 32


def _host_route(address: str) -> dict[str, Any]:
    """The blackhole route of one VIP, as pyroute2 takes it. For IPv6, the
    protocol (what pyroute2 sets anyway) makes a delete precise: the kernel's
    IPv6 delete does not look at the type, and a /128 address brings a
    main-table route to the same destination (proto kernel), which must stay."""
    if not _is_v6(address):
        return {"dst": address, "dst_len": 32, "type": "blackhole", "table": RT_TABLE_MAIN}
    return {"dst": address, "dst_len": 128, "type": "blackhole", "table": RT_TABLE_MAIN,
            "family": AF_INET6, "proto": RTPROT_STATIC}


def _blackholes(ipr: Netlink) -> set[str]:
    """Host blackhole routes of the main table (/32 and /128)."""
    return {str(ipaddress.ip_address(r.get_attr("RTA_DST")))
            for family, host in ((AF_INET, 32), (AF_INET6, 128))
            for r in ipr.get_routes(family=family, table=RT_TABLE_MAIN)
            if r["type"] == RTN_BLACKHOLE and r["dst_len"] == host}


def claim_vips(vips: Iterable[str | ipaddress.IPv4Address | ipaddress.IPv6Address],
               record_path: Path, netns: str | None = None, *,
               ipr: Netlink | None = None) -> dict[str, list[str]]:
    """Makes ``vips`` the forwarder's alone (module doc): a blackhole route for
    each, then their host addresses (/32, /128) off every interface, recorded
    in ``record_path``; VIPs recorded earlier but not in ``vips`` get their
    addresses back and lose their blackhole. Idempotent; an empty ``vips``
    gives everything back and removes the record. Returns what it changed:
    {"taken": [...], "blackholed": [...], "released": [...]}."""
    wanted = {str(ipaddress.ip_address(str(v))) for v in vips}
    record: dict[str, Any] = {"kind": VIP_RECORD_KIND, "addresses": [], "blackholes": []}
    if record_path.exists():
        record = json.loads(record_path.read_text())
    record["version"] = RECORD_VERSION
    done: dict[str, list[str]] = {"taken": [], "blackholed": [], "released": []}
    with _netlink(netns, ipr) as nl:
        addrs = [*nl.get_addr(family=AF_INET), *nl.get_addr(family=AF_INET6)]
        own = {_local(a) for a in addrs if a["prefixlen"] < _host_len(_local(a))}
        for vip in sorted(wanted & own):
            log.warning("VIP %s is also an interface address of the appliance: the kernel "
                        "keeps it and answers what reaches it while the forwarder restarts",
                        vip)
        holes = sorted(wanted - own - _blackholes(nl))
        take = [a for a in addrs
                if a["prefixlen"] == _host_len(_local(a)) and _local(a) in wanted]
        names = {link["index"]: link.get_attr("IFLA_IFNAME")
                 for link in (nl.get_links() if take else ())}
        # What this call may change is recorded before it is changed.
        for a in take:
            entry = {"iface": names.get(a["index"], ""), "address": _local(a),
                     "prefixlen": _host_len(_local(a))}
            if entry not in record["addresses"]:
                record["addresses"].append(entry)
        record["blackholes"] = sorted(set(record["blackholes"]) | set(holes))
        if holes or take:
            _write_json(record_path, record)
        # 1. Blackholes first: once an address goes, its VIP's packets find no
        # route but the blackhole (a local address outranks it meanwhile).
        for vip in holes:
            nl.route("replace", **_host_route(vip))
            done["blackholed"].append(vip)
        # 2. The VIPs' host addresses off every interface.
        for a in take:
            try:
                nl.addr("del", index=a["index"], address=_local(a), prefixlen=a["prefixlen"])
            except NetlinkError as exc:
                if exc.code != EADDRNOTAVAIL:
                    raise
            done["taken"].append(f"{_local(a)}@{names.get(a['index'], a['index'])}")
        # 3. What is no longer a VIP: its addresses back, then its blackhole off.
        gone = ({e["address"] for e in record["addresses"]} | set(record["blackholes"])) - wanted
        keep = []
        for entry in record["addresses"]:
            if entry["address"] not in gone:
                keep.append(entry)
                continue
            index = _index(nl, entry["iface"])
            if index is None:
                log.warning("%s cannot go back to %s: no such interface", entry["address"],
                            entry["iface"])
                continue
            if _add_address(nl, index, entry["address"], entry["prefixlen"]):
                done["released"].append(entry["address"])
        for vip in sorted(gone & set(record["blackholes"])):
            with contextlib.suppress(NetlinkError):  # already gone
                nl.route("del", **_host_route(vip))
        record["addresses"] = keep
        record["blackholes"] = sorted(set(record["blackholes"]) - gone)
        if record["addresses"] or record["blackholes"]:
            if gone or holes or take or not record_path.exists():
                _write_json(record_path, record)
        else:
            record_path.unlink(missing_ok=True)
    if any(done.values()):
        log.info("VIPs: %s", ", ".join(f"{k} {' '.join(v)}" for k, v in done.items() if v))
    return done
