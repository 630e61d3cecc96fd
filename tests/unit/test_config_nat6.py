"""NAT mode for IPv6 in the configuration: `mode: nat` VIPs of IPv6 with IPv6
backends, `nat.snat.addresses` of both families; what is refused (NAT64
mixes, an IPv6 SNAT VIP without an IPv6 pool address, IPv6 addresses that are
not unicast, more than 16 of a family), naming file, line and field; and what
the controller builds: the pool normalised IPv4 first (as the data plane holds
it), IPv6 NAT VIPs in the tables. The IPv4 cases are test_config_nat.py's."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path

import pytest

from hpclb.config import load_config, parse_config
from hpclb.contract.tables import VipMode
from hpclb.controller.core import nat_tables, vip_entry

from .config_cases import EXAMPLES, assert_refused, refused
from .test_config_nat import built

NAT6 = """\
appliance:
  name: gw6
  interfaces:
    ingress: eth0
    egress: [eth1]
  hash_key: 000102030405060708090a0b0c0d0e0f
  ring_size: 251
  management_address: 10.0.0.5
pools:
  web6:
    backend_port: 8080
    backends:
      - {name: w1, address: 'fd00:30::11', via: eth1, mac: '02:00:00:00:00:11'}
      - {name: w2, address: 'fd00:30::12', via: eth1, mac: '02:00:00:00:00:12'}
  ldap6:
    snat: true
    backends:
      - {name: l1, address: 'fd00:31::21', via: eth1, mac: '02:00:00:00:00:21'}
  web4:
    backends:
      - {name: v1, address: 10.30.0.11, via: eth1, mac: '02:00:00:00:00:31'}
vips:
  - {name: web6, address: '2001:db8::30', port: 80, mode: nat, pool: web6}
  - {name: tls6, address: '2001:db8::30', port: 443, mode: nat, pool: web6, snat: true}
  - {name: ldap6, address: '2001:db8::31', port: 389, mode: nat, pool: ldap6}
  - {name: web4, address: 192.0.2.30, port: 80, mode: nat, pool: web4, snat: true}
nat:
  snat: {addresses: ['fd00:ff::2', 10.30.255.1, 'fd00:ff::1'], ports: "2000-2999"}
"""


def test_ipv6_nat_vips_and_a_mixed_pool_are_accepted() -> None:
    cfg = parse_config(NAT6, "t.yaml")
    assert [cfg.vip_snat(v) for v in cfg.vips] == [False, True, True, True]
    assert cfg.nat.snat is not None
    # The configuration keeps the order given...
    assert cfg.nat.snat.addresses == [ip_address("fd00:ff::2"), IPv4Address("10.30.255.1"),
                                      ip_address("fd00:ff::1")]
    # ...the data plane's pool is IPv4 first, then IPv6 in that order.
    assert nat_tables(cfg).snat_addrs == (IPv4Address("10.30.255.1"), IPv6Address("fd00:ff::2"),
                                          IPv6Address("fd00:ff::1"))


def test_the_tables_carry_ipv6_nat_vips(tmp_path: Path) -> None:
    cfg = parse_config(NAT6, "t.yaml")
    tables, checkpoint = built(cfg, tmp_path)
    vips = {name: tables.vips[checkpoint.vips.get(name)] for name in ("web6", "tls6", "ldap6")}
    assert {n: (v.mode, v.nat_port, v.snat, v.addr.version) for n, v in vips.items()} == {
        "web6": (VipMode.NAT, 8080, False, 6),
        "tls6": (VipMode.NAT, 8080, True, 6),
        "ldap6": (VipMode.NAT, 389, True, 6),
    }
    assert tables.nat.snat_addrs[0] == IPv4Address("10.30.255.1")
    assert {str(b.addr): b.port for b in tables.backends.values()} == {
        "fd00:30::11": 1, "fd00:30::12": 1, "fd00:31::21": 1, "10.30.0.11": 1}
    vip = vip_entry(cfg, cfg.vips[0], 3)
    assert (vip.vip_id, vip.mode, vip.addr) == (3, VipMode.NAT, IPv6Address("2001:db8::30"))


# Problems reported at another line than the one changed: (old, path) -> where.
CROSS_FIELD = {
    ("'fd00:ff::2', 10.30.255.1, 'fd00:ff::1'", "vips[1].snat"): "snat: true}",
    ("'fd00:ff::2', 10.30.255.1, 'fd00:ff::1'", "pools.ldap6.snat"): "snat: true\n",
    ("mode: nat, pool: web6}", "pools.web4.backends[0].address"): "10.30.0.11, via",
}


@pytest.mark.parametrize(("old", "new", "path", "words"), [
    # IPv6 SNAT addresses: unicast, distinct, 16 of each family
    *[("'fd00:ff::2', 10.30.255.1", f"'{bad}', 10.30.255.1", "nat.snat.addresses[0]",
       f"{ip_address(bad)} is not a unicast address (::, ::1, ff00::/8, fe80::/10 and "
       "::ffff:0:0/96 are refused)")
      for bad in ("::", "::1", "ff02::1", "fe80::1", "febf::1", "::ffff:10.0.0.1")],
    ("'fd00:ff::2', 10.30.255.1, 'fd00:ff::1'", "'fd00:ff::2', 10.30.255.1, 'fd00:ff::2'",
     "nat.snat.addresses", "listed twice: fd00:ff::2"),
    ("'fd00:ff::2', 10.30.255.1, 'fd00:ff::1'",
     ", ".join(f"'fd00:ff::{i:x}'" for i in range(1, 18)) + ", 10.30.255.1",
     "nat.snat.addresses", "17 IPv6 addresses: at most 16 of each family"),
    ("'fd00:ff::2', 10.30.255.1, 'fd00:ff::1'", "'2001:db8::31', 10.30.255.1",
     "nat.snat.addresses[0]", "2001:db8::31 is VIP 'ldap6''s address"),
    ("'fd00:ff::2', 10.30.255.1, 'fd00:ff::1'", "'fd00:30::12', 10.30.255.1",
     "nat.snat.addresses[0]", "backend 'w2'"),
    # an IPv6 SNAT VIP needs an IPv6 pool address: on the VIP's snat or its pool's
    ("'fd00:ff::2', 10.30.255.1, 'fd00:ff::1'", "10.30.255.1", "vips[1].snat",
     "SNAT for IPv6 VIP 'tls6' needs an IPv6 address: add one to nat.snat.addresses (a "
     "connection takes a SNAT address of its VIP's family)"),
    ("'fd00:ff::2', 10.30.255.1, 'fd00:ff::1'", "10.30.255.1", "pools.ldap6.snat",
     "SNAT for IPv6 VIP 'ldap6' needs an IPv6 address"),
    # no NAT64: the backends are of the VIP's family
    ("'fd00:30::12', via: eth1,", "10.30.0.12, via: eth1,", "pools.web6.backends[1].address",
     "backend 'w2' is IPv4 and NAT VIP 'web6' (2001:db8::30) IPv6: NAT mode does not "
     "translate between families (no NAT64: a connection's addresses, client, VIP, backend and "
     "SNAT, are all IPv4 or all IPv6); give pool 'web6' IPv6 backends"),
    ("mode: nat, pool: web6}", "mode: nat, pool: web4}", "pools.web4.backends[0].address",
     "backend 'v1' is IPv4 and NAT VIP 'web6' (2001:db8::30) IPv6"),
])
def test_refusals_name_line_and_field(old: str, new: str, path: str, words: str) -> None:
    assert_refused(NAT6, old, new, path, words, CROSS_FIELD.get((old, path), new))


def test_an_ipv4_pool_address_serves_only_ipv4_vips() -> None:
    """The same pool with its IPv6 addresses dropped: both IPv6 SNAT VIPs
    are named, the IPv4 one and the IPv6 VIP without SNAT are not."""
    message = refused(NAT6.replace("'fd00:ff::2', 10.30.255.1, 'fd00:ff::1'", "10.30.255.1"))
    assert "'tls6'" in message and "'ldap6'" in message
    assert "'web4'" not in message and "'web6'" not in message


def test_the_nat6_example_loads() -> None:
    cfg = load_config(EXAMPLES / "nat6.yaml")
    assert {v.mode.value for v in cfg.vips} == {"nat"}
    assert {v.address.version for v in cfg.vips} == {4, 6}
    assert cfg.nat.snat is not None and {a.version for a in cfg.nat.snat.addresses} == {4, 6}
    pool = nat_tables(cfg).snat_addrs
    assert [a.version for a in pool] == sorted(a.version for a in pool)
    for vip in cfg.vips:
        assert all(b.address.version == vip.address.version
                   for b in cfg.pools[vip.pool].backends)
