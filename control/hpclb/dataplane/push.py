"""Desired state -> table protocol operations.

``push_tables`` brings a data plane from the tables it holds (``current``,
read back from the data plane when unknown) to ``desired`` with the fewest
operations: the hash key if it changed; backends (a ring may only name
backends the data plane knows); VIPs that went away or changed (deleted first,
so that a key moving to another id is free); the NAT configuration if it
changed; new and changed VIPs together with their rings (the ring is written
before the VIP goes live); for VIPs that stay, a patch of the changed slots,
so a weight change never rewrites 65537 slots; last, backends no longer
configured become UNUSED, once no ring names them.

The NAT configuration's place follows the data plane's SNAT rule (PROTOCOL.md,
set_vip and set_nat): a VIP with ``snat`` needs a SNAT address when it is set,
and the pool cannot be emptied while such a VIP is configured. After the
deletions every VIP left is one ``desired`` keeps unchanged, and before the
additions none of the new or changed VIPs exists yet: so a new or grown pool
is there before the VIPs that need it, and a pool is emptied only once the
VIPs that used it are gone.

Tunnel VIPs go only to a data plane whose ``hello`` lists the ``"tunnel"``
capability, IPv6 NAT VIPs and IPv6 SNAT addresses only to one that lists
``"nat6"``: ``push_tables`` asks (one ``hello``, only when such a VIP or pool
is to be set) and refuses before any change otherwise. The SNAT pool holds
both families; each VIP's connections take an address of its own family, and
pools compare in the data plane's order (``snat_order``: IPv4 then IPv6). VIPs compare as the data
plane holds them (``held_form``): a GUE VIP whose ``gue_port`` is 0 is the
one with ``GUE_PORT_DEFAULT``, so the diff does not re-set it every push.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpclb.contract.ringdiff import diff_tables
from hpclb.contract.tables import (
    CONN_STATE_NAMES,
    GUE_PORT_DEFAULT,
    Backend,
    BackendState,
    Encap,
    NatConfig,
    NatDown,
    TableSet,
    Vip,
    VipMode,
    addr_from_wire,
    mac_str,
)
from hpclb.dataplane.client import DataplaneClient, DataplaneError, snat_order


@dataclass
class PushReport:
    config_set: bool = False
    nat_set: bool = False
    backends_set: int = 0
    vips_set: int = 0
    vips_deleted: int = 0
    rings_full: int = 0
    slots_patched: int = 0

    def summary(self) -> str:
        return (
            f"nat={'new' if self.nat_set else 'same'} "
            f"key={'new' if self.config_set else 'same'} "
            f"backends={self.backends_set} vips={self.vips_set} "
            f"vips_deleted={self.vips_deleted} "
            f"full_rings={self.rings_full} patched_slots={self.slots_patched}"
        )


def push_tables(client: DataplaneClient, current: TableSet | None, desired: TableSet) -> PushReport:
    """Bring the data plane from ``current`` to ``desired``.

    ``current`` None means "unknown" (a start, a restart, a failed push): it is
    then read back from the data plane, so that what is pushed is always a
    diff against what is really there, deletions included.
    """
    report = PushReport()
    for family in (4, 6):
        snat_vips = sorted(vid for vid, vip in desired.vips.items()
                           if vip.snat and vip.addr.version == family)
        if snat_vips and not any(a.version == family for a in desired.nat.snat_addrs):
            raise ValueError(
                f"VIPs {snat_vips} use SNAT but the NAT configuration has no IPv{family} "
                "SNAT address (a VIP's connections take one of its own family)"
            )
    if current is None:
        current = fetch_tables(client)
    if current.ring_size != desired.ring_size:
        raise ValueError(
            f"the data plane's ring has {current.ring_size} slots, the configuration "
            f"{desired.ring_size}: the data plane must be restarted to change it"
        )
    _check_capabilities(client, current, desired)
    if current.hash_key != desired.hash_key:
        client.set_config(desired.hash_key)
        report.config_set = True

    old_backends = current.backends
    changed = [b for bid, b in desired.backends.items() if old_backends.get(bid) != b]
    # Backends no longer configured become UNUSED (after rings stop naming them).
    removed = [bid for bid in old_backends if bid not in desired.backends]
    if changed:
        client.set_backends(changed)
        report.backends_set = len(changed)

    old_vips = current.vips
    # Delete first: a VIP whose key moved to another id must be gone before
    # the new id claims the key.
    for vip_id, vip in old_vips.items():
        if not _same_vip(desired.vips.get(vip_id), vip):
            client.del_vip(vip.addr, vip.port, vip.proto)
            report.vips_deleted += 1
    # Between the deletions and the additions: see the module's docstring.
    if _nat_key(current.nat) != _nat_key(desired.nat):
        client.set_nat(desired.nat)
        report.nat_set = True
    for vip_id, vip in desired.vips.items():
        ring = desired.rings[vip_id]
        if not _same_vip(old_vips.get(vip_id), vip):
            # The ring travels with the VIP: no packet finds the VIP ringless.
            client.set_vip(vip, ring)
            report.vips_set += 1
            report.rings_full += 1
            continue
        old_ring = current.rings.get(vip_id)
        if old_ring is None:
            client.set_ring(vip_id, ring)
            report.rings_full += 1
        else:
            slots, values = diff_tables(old_ring, ring)
            if len(slots):
                client.patch_ring(vip_id, slots, values)
                report.slots_patched += len(slots)

    for bid in removed:
        client.set_backend_state(bid, BackendState.UNUSED)
    return report


def held_form(vip: Vip) -> Vip:
    """``vip`` as a data plane holds it once set (what ``fetch_tables`` reads
    back): a tunnel VIP with GUE and ``gue_port`` 0 gets ``GUE_PORT_DEFAULT``,
    as set_vip sends it."""
    if vip.mode == VipMode.TUNNEL and vip.tunnel_encap == Encap.GUE and not vip.gue_port:
        return dataclasses.replace(vip, gue_port=GUE_PORT_DEFAULT)
    return vip


def _same_vip(a: Vip | None, b: Vip | None) -> bool:
    if a is None or b is None:
        return a is b
    return held_form(a) == held_form(b)


def _check_capabilities(client: DataplaneClient, current: TableSet,
                        desired: TableSet) -> None:
    """Refuse, before any change, what the data plane's hello says it lacks:
    tunnel VIPs to be set without the "tunnel" capability, IPv6 NAT VIPs to be
    set or a new pool with IPv6 SNAT addresses without "nat6" (its set_vip and
    set_nat would refuse them one by one, after the deletions and backends
    went through)."""
    def to_set(want: Callable[[Vip], bool]) -> list[int]:
        return sorted(vid for vid, vip in desired.vips.items()
                      if want(vip) and not _same_vip(current.vips.get(vid), vip))

    tunnel = to_set(lambda v: v.mode == VipMode.TUNNEL)
    nat6 = to_set(lambda v: v.mode == VipMode.NAT and v.addr.version == 6)
    pool6 = [str(a) for a in desired.nat.snat_addrs if a.version == 6]
    if _nat_key(current.nat) == _nat_key(desired.nat):
        pool6 = []  # held already: nothing to set
    if not (tunnel or nat6 or pool6):
        return
    hello = client.hello()
    caps = [str(c) for c in hello.get("capabilities", ())]
    plane = f"the {hello.get('dataplane', '?')} data plane"
    has = f"its capabilities: {', '.join(caps) or 'none'}"
    if tunnel and "tunnel" not in caps:
        raise DataplaneError(f"VIPs {tunnel} use tunnel mode, which {plane} lacks ({has})")
    if (nat6 or pool6) and "nat6" not in caps:
        what = (f"VIPs {nat6} are IPv6 NAT VIPs" if nat6 else
                f"the NAT configuration's IPv6 SNAT addresses ({', '.join(pool6)}) need it")
        raise DataplaneError(f"{what}: NAT mode for IPv6 (capability \"nat6\"), which "
                             f"{plane} lacks ({has})")


def _nat_key(nat: NatConfig) -> tuple[object, ...]:
    """What set_nat would send: NatConfigs built with lists or plain ints, or
    with the pool's families interleaved, compare by value."""
    return (snat_order(nat.snat_addrs), int(nat.snat_port_min), int(nat.snat_port_max),
            int(nat.on_backend_down), tuple(int(t) for t in nat.timeouts_s))


def nat_from_wire(nat: dict[str, Any]) -> NatConfig:
    """dump's ``nat`` map as a NatConfig (equal to the one set_nat was sent,
    whose pool set_nat sends in ``snat_order``)."""
    timeouts = nat["timeouts"]
    return NatConfig(
        snat_addrs=tuple(addr_from_wire(bytes(a)) for a in nat["snat_addrs"]),
        snat_port_min=int(nat["snat_port_min"]),
        snat_port_max=int(nat["snat_port_max"]),
        on_backend_down=NatDown(int(nat["on_backend_down"])),
        timeouts_s=tuple(int(timeouts[name]) for name in CONN_STATE_NAMES),
    )


def fetch_tables(client: DataplaneClient) -> TableSet:
    """What a running data plane holds, read back through dump and get_ring.

    Used when the control plane adopts a data plane that outlived it: the next
    push is then a diff against what is really there.
    """
    dump = client.dump()
    tables = TableSet(hash_key=bytes(dump["hash_key"]), ring_size=int(dump["ring_size"]))
    if "nat" in dump:  # a data plane older than NAT mode holds the defaults
        tables.nat = nat_from_wire(dump["nat"])
    for b in dump["backends"]:
        tables.backends[int(b["id"])] = Backend(
            backend_id=int(b["id"]),
            addr=addr_from_wire(bytes(b["addr"])),
            mac=mac_str(bytes(b["mac"])),
            state=BackendState(int(b["state"])),
            port=int(b["port"]),
        )
    for v in dump["vips"]:
        vip = Vip(
            vip_id=int(v["vip_id"]),
            addr=addr_from_wire(bytes(v["addr"])),
            port=int(v["port"]),
            proto=int(v["proto"]),
            mode=VipMode(int(v["mode"])),
            nat_port=int(v.get("nat_port", 0)),
            tunnel_src=addr_from_wire(bytes(v["tunnel_src"])) if "tunnel_src" in v else None,
            snat=bool(v.get("snat", False)),
            tunnel_encap=Encap(int(v.get("tunnel_encap", Encap.IPIP))),
            gue_port=int(v.get("gue_port", 0)),
            tunnel_src_bits=int(v.get("tunnel_src_bits", 0)),
        )
        tables.vips[vip.vip_id] = vip
        tables.rings[vip.vip_id] = client.get_ring(vip.vip_id)
    return tables
