"""Desired state -> table protocol operations.

``push_tables`` brings a data plane from the tables it holds (``current``,
read back from the data plane when unknown) to ``desired`` with the fewest
operations: the hash key if it changed; backends (a ring may only name
backends the data plane knows); VIPs that went away or changed (deleted first,
so that a key moving to another id is free); new and changed VIPs together
with their rings (the ring is written before the VIP goes live); for VIPs
that stay, a patch of the changed slots, so a weight change never rewrites
65537 slots; last, backends no longer configured
become UNUSED, once no ring names them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpclb.contract.ringdiff import diff_tables
from hpclb.contract.tables import (
    Backend,
    BackendState,
    TableSet,
    Vip,
    VipMode,
    addr_from_wire,
    mac_str,
)
from hpclb.dataplane.client import DataplaneClient


@dataclass
class PushReport:
    config_set: bool = False
    backends_set: int = 0
    vips_set: int = 0
    vips_deleted: int = 0
    rings_full: int = 0
    slots_patched: int = 0

    def summary(self) -> str:
        return (
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
    if current is None:
        current = fetch_tables(client)
    if current.ring_size != desired.ring_size:
        raise ValueError(
            f"the data plane's ring has {current.ring_size} slots, the configuration "
            f"{desired.ring_size}: the data plane must be restarted to change it"
        )
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
        if desired.vips.get(vip_id) != vip:
            client.del_vip(vip.addr, vip.port, vip.proto)
            report.vips_deleted += 1
    for vip_id, vip in desired.vips.items():
        ring = desired.rings[vip_id]
        if old_vips.get(vip_id) != vip:
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




def fetch_tables(client: DataplaneClient) -> TableSet:
    """What a running data plane holds, read back through dump and get_ring.

    Used when the control plane adopts a data plane that outlived it: the next
    push is then a diff against what is really there.
    """
    dump = client.dump()
    tables = TableSet(hash_key=bytes(dump["hash_key"]), ring_size=int(dump["ring_size"]))
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
        )
        tables.vips[vip.vip_id] = vip
        tables.rings[vip.vip_id] = client.get_ring(vip.vip_id)
    return tables
