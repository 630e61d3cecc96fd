"""push.py and client.py with tunnel mode: what set_vip puts on the wire for a
tunnel VIP, dump -> Vip (tunnel_encap, gue_port, tunnel_src_bits), a changed
encapsulation, port or bit count re-setting the VIP, and tunnel VIPs refused
before any change on a data plane whose hello lacks "tunnel".

No data plane: test_push_nat.FakePlane (the server's SNAT and tunnel rules,
tables in wire form). The same push against the real server (both daemons) is
test_protocol_server.py's test_push_with_tunnel.
"""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest

from hpclb.contract.tables import GUE_PORT_DEFAULT, Encap, TableSet, Vip, VipMode
from hpclb.dataplane.client import DataplaneError, tunnel_fields
from hpclb.dataplane.push import fetch_tables, held_form, push_tables
from tests.unit.test_push_nat import FakePlane, pushed, tables

SRC4 = ipaddress.IPv4Address("192.0.2.1")
SRC6 = ipaddress.IPv6Address("fd00::aa")


def tvip(i: int, encap: Encap = Encap.IPIP, gue_port: int = 0, bits: int = 0,
         v6: bool = False) -> Vip:
    addr = ipaddress.IPv6Address(f"fd00::{i}") if v6 else ipaddress.IPv4Address(f"10.0.0.{i}")
    return Vip(vip_id=i, addr=addr, port=80, proto=6, mode=VipMode.TUNNEL,
               tunnel_src=SRC6 if v6 or encap is Encap.GUE else SRC4, tunnel_encap=encap,
               gue_port=gue_port, tunnel_src_bits=bits)


def sent_vip(plane: FakePlane, vip_id: int) -> dict[str, object]:
    """The last set_vip request for vip_id."""
    return [f for op, f in plane.ops if op == "set_vip" and f["vip_id"] == vip_id][-1]


def test_set_vip_sends_the_tunnel_fields() -> None:
    plane = FakePlane()
    push_tables(plane, None, tables([tvip(1), tvip(2, Encap.GUE, 5555, 8),
                                     tvip(3, Encap.GUE, bits=16, v6=True)]))
    ipip, gue, gue6 = sent_vip(plane, 1), sent_vip(plane, 2), sent_vip(plane, 3)
    assert ipip["mode"] == 2 and ipip["tunnel_src"] == SRC4.packed
    assert ipip["tunnel_encap"] == 0 and ipip["tunnel_src_bits"] == 0
    assert "gue_port" not in ipip  # the server refuses it with IPIP
    assert (gue["tunnel_encap"], gue["gue_port"], gue["tunnel_src_bits"]) == (1, 5555, 8)
    assert gue6["gue_port"] == GUE_PORT_DEFAULT and gue6["tunnel_src"] == SRC6.packed
    # A VIP of another mode carries none of them (the server would refuse them).
    dsr = Vip(vip_id=4, addr=ipaddress.IPv4Address("10.0.0.4"), port=80, proto=6)
    assert tunnel_fields(dsr) == {}
    # A stray one is sent, for the data plane to refuse with its own error.
    with pytest.raises(DataplaneError, match="field 'tunnel_src_bits': only a tunnel VIP"):
        plane.set_vip(dataclasses.replace(dsr, tunnel_src_bits=4))


def test_fetch_round_trip_and_changes() -> None:
    plane = FakePlane()
    desired = tables([tvip(1), tvip(2, Encap.GUE, 5555, 8), tvip(3, Encap.GUE, bits=16, v6=True)])
    push_tables(plane, None, desired)
    held = fetch_tables(plane)
    assert held.vips[1] == desired.vips[1] and held.vips[2] == desired.vips[2]
    # gue_port 0 with GUE is held as the default, and compares equal to it.
    assert held.vips[3] == held_form(desired.vips[3])
    assert held.vips[3].gue_port == GUE_PORT_DEFAULT
    assert pushed(plane, held, desired) == []
    assert pushed(plane, None, desired) == []
    # Each tunnel field, changed alone, re-sets that VIP and only it.
    for vid, change in ((1, {"tunnel_encap": Encap.GUE}), (2, {"gue_port": 6081}),
                        (2, {"tunnel_src_bits": 9}), (2, {"tunnel_src": SRC4})):
        vips = dict(desired.vips)
        vips[vid] = dataclasses.replace(vips[vid], **change)  # type: ignore[arg-type]
        new = tables(list(vips.values()))
        ops = pushed(plane, None, new)
        assert ops == ["hello", f"del_vip 10.0.0.{vid}", f"set_vip {vid}"], (change, ops)
        back = fetch_tables(plane)
        assert back.vips == {k: held_form(v) for k, v in new.vips.items()}
        push_tables(plane, None, desired)
    # Back to DSR: the tunnel fields go (tunnel_src stays, as protocol 2 keeps it).
    dsr = dataclasses.replace(desired.vips[1], mode=VipMode.DSR, tunnel_encap=Encap.IPIP)
    push_tables(plane, None, tables([dsr]))
    assert set(plane.vips[1]) == {"vip_id", "addr", "port", "proto", "mode", "nat_port", "snat",
                                  "tunnel_src"}
    assert fetch_tables(plane).vips[1] == dsr


def test_tunnel_vips_need_the_capability() -> None:
    plane = FakePlane(tunnel=False)
    first = tables([Vip(vip_id=5, addr=ipaddress.IPv4Address("10.0.0.5"), port=80, proto=6)])
    push_tables(plane, None, first)
    plane.ops.clear()
    with pytest.raises(DataplaneError, match=r"VIPs \[1, 2\] use tunnel mode, which the fake "
                                             r"data plane lacks \(its capabilities: dsr, "
                                             r"patch_ring, nat\)"):
        push_tables(plane, first, tables([tvip(1), tvip(2, Encap.GUE, 5555)]))
    assert [op for op, _ in plane.ops] == ["hello"]  # refused before any change
    assert set(plane.vips) == {5}
    # No tunnel VIP to set: no hello asked, whatever the plane.
    plane.ops.clear()
    push_tables(plane, first, first)
    assert plane.ops == []


def test_a_kept_tunnel_vip_asks_no_hello() -> None:
    plane = FakePlane()
    desired = tables([tvip(1, Encap.GUE, 7000, 4)])
    push_tables(plane, None, desired)
    plane.ops.clear()
    push_tables(plane, desired, desired)
    assert "hello" not in [op for op, _ in plane.ops]
    held: TableSet = fetch_tables(plane)
    plane.ops.clear()
    push_tables(plane, held, desired)
    assert "hello" not in [op for op, _ in plane.ops]
