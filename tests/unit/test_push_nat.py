"""push.py and client.py with NAT mode: the order of set_nat among the VIP
operations, and dump -> TableSet (Vip.snat, TableSet.nat).

No data plane: ``FakePlane`` is a DataplaneClient whose ``call`` answers from
tables it keeps, with the protocol server's SNAT rule (PROTOCOL.md, set_vip
and set_nat), per family: a VIP with ``snat`` needs a SNAT address of its
family, and a family's pool cannot be emptied while such a VIP of that family
is configured; IPv6 NAT VIPs and IPv6 SNAT addresses only with "nat6", the
pool held and dumped IPv4 first; and its tunnel rules (mode 2 only on
a plane with tunnel mode, the tunnel fields with mode 2 only, gue_port with
GUE only, dumped for tunnel VIPs only). Every request goes through the real
client methods, so what they put on the wire is what the fake checks.
test_push_tunnel.py uses it too.
"""

from __future__ import annotations

import ipaddress
import random
from typing import Any

import numpy as np
import pytest

from hpclb.contract.tables import (
    CONN_STATE_NAMES,
    CONN_TIMEOUTS_DEFAULT,
    Backend,
    NatConfig,
    NatDown,
    TableSet,
    Vip,
    VipMode,
)
from hpclb.dataplane.client import DataplaneClient, DataplaneError, snat_order
from hpclb.dataplane.push import fetch_tables, push_tables

RING_SIZE = 7
HASH_KEY = bytes(range(16))
NAT_DEFAULT_WIRE: dict[str, Any] = {
    "snat_addrs": [], "snat_port_min": 1024, "snat_port_max": 65535, "on_backend_down": 0,
    "timeouts": dict(zip(CONN_STATE_NAMES, CONN_TIMEOUTS_DEFAULT, strict=True)),
}


class FakePlane(DataplaneClient):
    """Tables in wire form, the SNAT rule, and the log of every op."""

    def __init__(self, nat: bool = True, tunnel: bool = True, nat6: bool = False) -> None:
        super().__init__("ipc:///nonexistent")
        self.has_nat = nat
        self.has_nat6 = nat and nat6
        self.has_tunnel = tunnel
        self.ops: list[tuple[str, dict[str, Any]]] = []
        self.hash_key = bytes(16)
        self.vips: dict[int, dict[str, Any]] = {}
        self.rings: dict[int, bytes] = {}
        self.backends: dict[int, dict[str, Any]] = {}
        self.nat: dict[str, Any] = dict(NAT_DEFAULT_WIRE)

    def log(self) -> list[str]:
        """The ops, VIP ops with their vip_id or key: 'set_vip 3', 'del_vip 10.0.0.3'."""
        out = []
        for op, f in self.ops:
            if op == "set_vip":
                out.append(f"set_vip {f['vip_id']}")
            elif op == "del_vip":
                out.append(f"del_vip {ipaddress.ip_address(f['addr'])}")
            else:
                out.append(op)
        return out

    def _snat_vips(self, alen: int | None = None) -> list[int]:
        """SNAT VIPs, of one family (address length 4 or 16) when given."""
        return [i for i, v in self.vips.items()
                if v.get("snat") and alen in (None, len(v["addr"]))]

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.ops.append((op, fields))
        if op == "hello":
            caps = (["dsr", "patch_ring"] + ["nat"] * self.has_nat + ["nat6"] * self.has_nat6
                    + ["tunnel"] * self.has_tunnel)
            return {"v": 2, "ok": True, "dataplane": "fake", "version": 2,
                    "capabilities": caps}
        if op == "set_config":
            self.hash_key = fields["hash_key"]
        elif op == "set_backends":
            for b in fields["backends"]:
                self.backends[b["id"]] = b
        elif op == "set_backend_state":
            if fields["state"] == 3:
                del self.backends[fields["id"]]
            else:
                self.backends[fields["id"]]["state"] = fields["state"]
        elif op == "set_vip":
            snat = fields.get("snat", False)
            if not isinstance(snat, bool):
                raise DataplaneError("set_vip: field 'snat' must be bool")
            if fields["mode"] == 1 and not self.has_nat:
                raise DataplaneError("set_vip: mode not supported by this data plane")
            if fields["mode"] == 1 and len(fields["addr"]) == 16 and not self.has_nat6:
                raise DataplaneError("set_vip: field 'mode': NAT mode (1) is IPv4 only")
            tunnel = self._tunnel_fields(fields)
            if snat and fields["mode"] != 1:
                raise DataplaneError("set_vip: field 'snat': only a NAT VIP (mode 1) takes SNAT")
            if snat and not any(len(a) == len(fields["addr"]) for a in self.nat["snat_addrs"]):
                raise DataplaneError("set_vip: field 'snat': no SNAT pool of the VIP's "
                                     "family configured (set_nat)")
            key = (fields["addr"], fields["port"], fields["proto"])
            for i, v in self.vips.items():
                if (v["addr"], v["port"], v["proto"]) == key and i != fields["vip_id"]:
                    raise DataplaneError(f"set_vip: already VIP {i}")
            vip = {k: fields[k] for k in ("vip_id", "addr", "port", "proto", "mode",
                                          "nat_port")}
            vip["snat"] = snat
            if "tunnel_src" in fields:
                vip["tunnel_src"] = fields["tunnel_src"]
            vip.update(tunnel)
            if fields["vip_id"] not in self.vips:
                self.rings[fields["vip_id"]] = fields.get("slots", b"\xff" * 4 * RING_SIZE)
            self.vips[fields["vip_id"]] = vip
        elif op == "del_vip":
            key = (fields["addr"], fields["port"], fields["proto"])
            for i, v in list(self.vips.items()):
                if (v["addr"], v["port"], v["proto"]) == key:
                    del self.vips[i], self.rings[i]
                    break
            else:
                raise DataplaneError("del_vip: no VIP with this addr/port/proto")
        elif op == "set_ring":
            self.rings[fields["vip_id"]] = fields["slots"]
        elif op == "patch_ring":
            ring = np.frombuffer(self.rings[fields["vip_id"]], dtype="<u4").copy()
            patch = np.frombuffer(fields["patch"], dtype="<u4").reshape(-1, 2)
            ring[patch[:, 0]] = patch[:, 1]
            self.rings[fields["vip_id"]] = ring.tobytes()
        elif op == "get_ring":
            return {"v": 2, "ok": True, "slots": self.rings[fields["vip_id"]]}
        elif op == "set_nat":
            if not self.has_nat:
                raise DataplaneError("set_nat: op 'set_nat' not supported")
            assert set(fields) == set(NAT_DEFAULT_WIRE), fields
            assert list(fields["timeouts"]) == list(CONN_STATE_NAMES)
            addrs = fields["snat_addrs"]
            assert all(isinstance(a, bytes) and len(a) in (4, 16) for a in addrs)
            # The client sends the pool as the data plane holds it: IPv4 first.
            assert addrs == sorted(addrs, key=len), addrs
            if any(len(a) == 16 for a in addrs) and not self.has_nat6:
                raise DataplaneError("set_nat: field 'snat_addrs[0]' is IPv6: this data "
                                     "plane has no NAT mode for IPv6")
            for alen in (4, 16):
                if not any(len(a) == alen for a in addrs) and self._snat_vips(alen):
                    raise DataplaneError(f"set_nat: field 'snat_addrs': VIP "
                                         f"{self._snat_vips(alen)[0]} uses SNAT")
            self.nat = dict(fields)
        elif op == "dump":
            return {"v": 2, "ok": True, "hash_key": self.hash_key, "ring_size": RING_SIZE,
                    "vips": [self.vips[i] for i in sorted(self.vips)],
                    "backends": [self.backends[i] for i in sorted(self.backends)],
                    "nat": self.nat}
        else:
            raise AssertionError(f"unexpected op {op}")
        return {"v": 2, "ok": True}

    def _tunnel_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """set_vip's tunnel rules (PROTOCOL.md); the fields dump reports."""
        given = [k for k in ("tunnel_encap", "gue_port", "tunnel_src_bits") if k in fields]
        if fields["mode"] != 2:
            if given:
                raise DataplaneError(f"set_vip: field '{given[0]}': only a tunnel VIP "
                                     f"(mode 2) takes it")
            return {}
        if not self.has_tunnel:
            raise DataplaneError("set_vip: mode not supported by this data plane")
        encap = fields.get("tunnel_encap", 0)
        assert encap in (0, 1) and 0 <= fields.get("tunnel_src_bits", 0) <= 16, fields
        if "gue_port" in fields and encap != 1:
            raise DataplaneError("set_vip: field 'gue_port': only GUE (tunnel_encap 1)")
        if "tunnel_src" not in fields:
            raise DataplaneError("set_vip: field 'tunnel_src': tunnel mode (2) needs an "
                                 "outer source address")
        if fields["nat_port"]:
            raise DataplaneError("set_vip: field 'nat_port': only a NAT VIP")
        out = {"tunnel_encap": encap, "tunnel_src_bits": fields.get("tunnel_src_bits", 0)}
        if encap == 1:
            out["gue_port"] = fields.get("gue_port", 6080)
        return out


def vip(i: int, snat: bool = False, mode: VipMode = VipMode.NAT) -> Vip:
    return Vip(vip_id=i, addr=ipaddress.IPv4Address(f"10.0.0.{i}"), port=80, proto=6,
               mode=mode, snat=snat)


def pool(*last: int) -> NatConfig:
    return NatConfig(snat_addrs=tuple(ipaddress.IPv4Address(f"198.51.100.{n}") for n in last))


def tables(vips: list[Vip], nat: NatConfig | None = None) -> TableSet:
    t = TableSet(hash_key=HASH_KEY, ring_size=RING_SIZE, nat=nat or NatConfig())
    t.backends = {b: Backend(b, ipaddress.IPv4Address(f"10.1.0.{b}"), f"02:00:00:00:00:{b:02x}")
                  for b in range(3)}
    for v in vips:
        t.vips[v.vip_id] = v
        t.rings[v.vip_id] = np.arange(RING_SIZE, dtype=np.uint32) % 3
    return t


def pushed(plane: FakePlane, current: TableSet | None, desired: TableSet) -> list[str]:
    plane.ops.clear()
    push_tables(plane, current, desired)
    return [op for op in plane.log() if op not in ("get_ring", "dump")]


def test_a_new_pool_goes_before_the_vips_that_need_it() -> None:
    plane = FakePlane()
    ops = pushed(plane, None, tables([vip(1), vip(2, snat=True)], pool(1, 2)))
    assert ops.index("set_nat") < ops.index("set_vip 2")
    assert plane._snat_vips() == [2]
    # Only a true snat travels: a request without it reads as before NAT mode.
    sent = {f["vip_id"]: f for op, f in plane.ops if op == "set_vip"}
    assert "snat" not in sent[1] and sent[2]["snat"] is True


def test_a_pool_is_emptied_after_its_vips_are_gone() -> None:
    plane = FakePlane()
    first = tables([vip(1), vip(2, snat=True)], pool(1))
    push_tables(plane, None, first)
    ops = pushed(plane, first, tables([vip(1)]))
    assert ops == ["del_vip 10.0.0.2", "set_nat"]
    assert plane.nat == NAT_DEFAULT_WIRE


def test_snat_dropped_on_a_kept_vip_with_the_pool() -> None:
    """VIP 2 stays but loses snat while the pool goes: the VIP is rewritten
    around the set_nat (deleted before it, set after it)."""
    plane = FakePlane()
    first = tables([vip(2, snat=True)], pool(1))
    push_tables(plane, None, first)
    ops = pushed(plane, first, tables([vip(2)]))
    assert ops == ["del_vip 10.0.0.2", "set_nat", "set_vip 2"]
    # And back: the pool first, then the VIP with snat.
    second = tables([vip(2)])
    ops = pushed(plane, second, first)
    assert ops == ["del_vip 10.0.0.2", "set_nat", "set_vip 2"]
    assert plane.vips[2]["snat"] is True


def test_a_pool_change_under_kept_snat_vips_touches_no_vip() -> None:
    plane = FakePlane()
    first = tables([vip(1, snat=True), vip(2, snat=True)], pool(1, 2, 3))
    push_tables(plane, None, first)
    assert pushed(plane, first, tables(list(first.vips.values()), pool(4))) == ["set_nat"]
    timeouts = list(CONN_TIMEOUTS_DEFAULT)
    timeouts[2] = 3600
    nat = NatConfig(snat_addrs=pool(4).snat_addrs, snat_port_min=20000, snat_port_max=20999,
                    on_backend_down=NatDown.DROP, timeouts_s=tuple(timeouts))
    assert pushed(plane, None, tables(list(first.vips.values()), nat)) == ["set_nat"]
    assert plane.nat["timeouts"]["established"] == 3600
    assert plane.nat["on_backend_down"] == 1 and plane.nat["snat_port_max"] == 20999


def test_no_nat_change_no_set_nat() -> None:
    plane = FakePlane(nat=False)  # a data plane without NAT mode: set_nat would fail
    first = tables([vip(1, mode=VipMode.DSR)])
    push_tables(plane, None, first)
    assert "set_nat" not in plane.log()
    assert pushed(plane, None, first) == []
    # A NatConfig equal by value (lists, plain ints) is no change either.
    same = tables([vip(1, mode=VipMode.DSR)], NatConfig(
        snat_addrs=(), on_backend_down=0,  # type: ignore[arg-type]
        timeouts_s=list(CONN_TIMEOUTS_DEFAULT)))  # type: ignore[arg-type]
    assert pushed(plane, first, same) == []


def test_snat_without_a_pool_is_refused_before_any_op() -> None:
    plane = FakePlane()
    with pytest.raises(ValueError, match=r"VIPs \[2\] use SNAT but the NAT configuration has "
                                         r"no IPv4 SNAT address"):
        push_tables(plane, None, tables([vip(1), vip(2, snat=True)]))
    assert plane.ops == []


def test_fetch_tables_reads_snat_and_nat() -> None:
    plane = FakePlane()
    timeouts = tuple(range(1, 9))
    nat = NatConfig(snat_addrs=pool(9, 3).snat_addrs, snat_port_min=1, snat_port_max=1,
                    on_backend_down=NatDown.DROP, timeouts_s=timeouts)
    desired = tables([vip(1), vip(2, snat=True), vip(3, mode=VipMode.DSR)], nat)
    push_tables(plane, None, desired)
    held = fetch_tables(plane)
    assert held.nat == nat and held.vips == desired.vips
    assert held.vips[2].snat and not held.vips[1].snat
    assert pushed(plane, held, desired) == []
    # A data plane older than NAT mode: no "nat" in its dump, no "snat" per VIP.
    plane.nat = {}
    for v in plane.vips.values():
        v.pop("snat")
    dump = plane.dump()
    del dump["nat"]
    plane.call = lambda op, **f: dump if op == "dump" else FakePlane.call(  # type: ignore[method-assign]
        plane, op, **f)
    old = fetch_tables(plane)
    assert old.nat == NatConfig() and not any(v.snat for v in old.vips.values())


def test_set_nat_refuses_a_short_timeouts_tuple() -> None:
    plane = FakePlane()
    with pytest.raises(ValueError, match="one per connection state"):
        plane.set_nat(NatConfig(timeouts_s=(1, 2, 3)))
    assert plane.ops == []


def test_random_pushes_never_break_the_snat_rule() -> None:
    """Random successive desired states (pools empty or not, VIPs with and
    without snat, ids and keys moving): every push gets through the fake's
    SNAT rule, and the plane then holds exactly the desired state."""
    rng = random.Random(20260603)
    plane = FakePlane()
    current: TableSet | None = None
    for _ in range(300):
        addrs = rng.sample(range(1, 6), rng.choice([0, 0, 1, 2, 3]))
        nat = pool(*addrs)
        vips = []
        for i in rng.sample(range(1, 8), rng.randrange(0, 5)):
            snat = bool(addrs) and rng.random() < 0.5
            mode = VipMode.NAT if snat or rng.random() < 0.7 else VipMode.DSR
            vips.append(Vip(vip_id=i, addr=ipaddress.IPv4Address(f"10.0.0.{rng.randrange(1, 5)}"),
                            port=80 + rng.randrange(2), proto=6, mode=mode, snat=snat))
        keys = {v.key for v in vips}
        if len(keys) != len(vips):  # one id per key, as the configuration makes them
            continue
        desired = tables(vips, nat)
        push_tables(plane, current if rng.random() < 0.8 else None, desired)
        held = fetch_tables(plane)
        assert held.vips == desired.vips and held.nat == desired.nat
        current = desired


# --- NAT mode for IPv6 ---------------------------------------------------------------


def vip6(i: int, snat: bool = False, mode: VipMode = VipMode.NAT) -> Vip:
    return Vip(vip_id=i, addr=ipaddress.IPv6Address(f"fd00::{i}"), port=80, proto=6,
               mode=mode, snat=snat)


def pool46(*addrs: str) -> NatConfig:
    return NatConfig(snat_addrs=tuple(ipaddress.ip_address(a) for a in addrs))


def test_a_mixed_pool_round_trips_in_the_data_planes_order() -> None:
    """Families interleaved in the NatConfig: set_nat sends IPv4 first (the
    fake asserts it), dump reads back the same order, and neither that nor
    the interleaved original is a change for the next push."""
    plane = FakePlane(nat6=True)
    nat = pool46("2001:db8::2", "198.51.100.1", "2001:db8::1", "198.51.100.2")
    desired = tables([vip(1, snat=True), vip6(2, snat=True), vip6(3)], nat)
    ops = pushed(plane, None, desired)
    assert ops.index("set_nat") < ops.index("set_vip 2")
    assert [ipaddress.ip_address(a) for a in plane.nat["snat_addrs"]] == [
        ipaddress.ip_address(a) for a in
        ("198.51.100.1", "198.51.100.2", "2001:db8::2", "2001:db8::1")]
    held = fetch_tables(plane)
    assert held.vips == desired.vips and held.vips[2].addr.version == 6
    assert held.nat.snat_addrs == snat_order(nat.snat_addrs)
    assert pushed(plane, held, desired) == []
    assert pushed(plane, desired, desired) == []
    assert pushed(plane, None, desired) == []


def test_snat_needs_a_pool_address_of_the_vips_family() -> None:
    plane = FakePlane(nat6=True)
    with pytest.raises(ValueError, match=r"VIPs \[2\] use SNAT but the NAT configuration has "
                                         r"no IPv6 SNAT address"):
        push_tables(plane, None, tables([vip(1, snat=True), vip6(2, snat=True)],
                                        pool46("198.51.100.1")))
    with pytest.raises(ValueError, match=r"VIPs \[1\] use SNAT but .* no IPv4 SNAT address"):
        push_tables(plane, None, tables([vip(1, snat=True)], pool46("2001:db8::1")))
    assert plane.ops == []


def test_the_ipv6_pool_is_emptied_after_its_vips_are_gone() -> None:
    plane = FakePlane(nat6=True)
    first = tables([vip(1, snat=True), vip6(2, snat=True)],
                   pool46("198.51.100.1", "2001:db8::1"))
    push_tables(plane, None, first)
    ops = pushed(plane, first, tables([vip(1, snat=True)], pool46("198.51.100.1")))
    assert ops == ["del_vip fd00::2", "set_nat"]
    assert plane.nat["snat_addrs"] == [ipaddress.IPv4Address("198.51.100.1").packed]


def test_ipv6_nat_needs_the_nat6_capability() -> None:
    """Refused before any change, naming the VIPs, or the IPv6 pool addresses
    when no IPv6 NAT VIP is to be set."""
    plane = FakePlane(nat6=False)
    first = tables([vip(1)])
    push_tables(plane, None, first)
    plane.ops.clear()
    with pytest.raises(DataplaneError, match=r'VIPs \[2\] are IPv6 NAT VIPs: NAT mode for '
                                             r'IPv6 \(capability "nat6"\), which the fake data '
                                             r"plane lacks \(its capabilities: dsr, patch_ring, "
                                             r"nat, tunnel\)"):
        push_tables(plane, first, tables([vip(1), vip6(2)]))
    with pytest.raises(DataplaneError, match=r"the NAT configuration's IPv6 SNAT addresses "
                                             r"\(2001:db8::1\) need it: NAT mode for IPv6"):
        push_tables(plane, first, tables([vip(1)], pool46("198.51.100.1", "2001:db8::1")))
    assert plane.log() == ["hello", "hello"]
    # IPv6 DSR VIPs and an IPv4 pool ask nothing of it.
    plane.ops.clear()
    push_tables(plane, first, tables([vip(1, snat=True), vip6(2, mode=VipMode.DSR)],
                                     pool46("198.51.100.1")))
    assert "hello" not in plane.log()


def test_random_mixed_pushes_never_break_the_per_family_snat_rule() -> None:
    """As test_random_pushes_never_break_the_snat_rule, both families: pools
    of either or both, IPv4 and IPv6 NAT VIPs with and without snat."""
    rng = random.Random(20261203)
    plane = FakePlane(nat6=True)
    choices = ["198.51.100.1", "198.51.100.2", "2001:db8::1", "2001:db8::2", "fd00:5::9"]
    current: TableSet | None = None
    for _ in range(300):
        nat = pool46(*rng.sample(choices, rng.randrange(0, 5)))
        families = {a.version for a in nat.snat_addrs}
        vips = []
        for i in rng.sample(range(1, 8), rng.randrange(0, 5)):
            v6 = rng.random() < 0.5
            snat = (6 if v6 else 4) in families and rng.random() < 0.5
            addr = (ipaddress.IPv6Address(f"fd00::{rng.randrange(1, 5)}") if v6 else
                    ipaddress.IPv4Address(f"10.0.0.{rng.randrange(1, 5)}"))
            mode = VipMode.NAT if snat or rng.random() < 0.7 else VipMode.DSR
            vips.append(Vip(vip_id=i, addr=addr, port=80, proto=6, mode=mode, snat=snat))
        if len({v.key for v in vips}) != len(vips):
            continue
        desired = tables(vips, nat)
        push_tables(plane, current if rng.random() < 0.8 else None, desired)
        held = fetch_tables(plane)
        assert held.vips == desired.vips
        assert held.nat.snat_addrs == snat_order(nat.snat_addrs)
        current = desired
