"""Tunnel mode's configuration (`mode: tunnel`, `tunnel:` blocks on pools and
VIPs) and IPv6 addresses: what is accepted and its defaults, what is refused
(naming file, line and field), what the controller makes of it (each Vip's
mode and tunnel fields, routed MAC lookups for tunnel pools), and a reload
with a bad tunnel block that keeps the configuration in force."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpclb.config import HpclbConfig, TunnelEncap, load_config, parse_config
from hpclb.contract.tables import (
    GUE_PORT_DEFAULT,
    MAX_BACKENDS,
    MAX_VIPS,
    Encap,
    IPAddress,
    TableSet,
    VipMode,
)
from hpclb.controller import core
from hpclb.controller.backends import BackendDecider
from hpclb.controller.core import Controller, vip_entry
from hpclb.controller.ids import Checkpoint
from hpclb.controller.preflight import host_problems
from hpclb.dataplane.select import Choice, Dataplane, dataplane_argv
from hpclb.host.neighbours import NeighbourError

from .config_cases import EXAMPLES, assert_refused, line_of

TUNNEL = """\
appliance:
  name: tun1
  interfaces: {ingress: eth0, egress: [eth1]}
  hash_key: 000102030405060708090a0b0c0d0e0f
  ring_size: 251
pools:
  far4:
    tunnel: {source: 172.16.0.0/24}
    backends:
      - {name: f1, address: 10.50.1.11, via: eth1}
      - {name: f2, address: 10.50.2.12, via: eth1}
  far6:
    tunnel: {encap: gue, source: 'fd00:100::/112'}
    backends:
      - {name: s1, address: 'fd00:60::21'}
  near6:
    backends:
      - {name: n1, address: '2001:db8:1::11'}
vips:
  - {name: ipip, address: 192.0.2.50, port: 80, mode: tunnel, pool: far4}
  - {name: gue, address: 192.0.2.51, port: 443, mode: tunnel, pool: far6}
  - {name: v6, address: '2001:db8::51', port: 443, mode: tunnel, pool: far6,
     tunnel: {encap: gue, gue_port: 7000, source: 'fd00:100::1:0/128'}}
  - {name: fixed, address: 192.0.2.52, port: 80, mode: tunnel, pool: far4,
     tunnel: {source: 10.0.0.0/8}}
  - {name: dsr6, address: '2001:db8::52', port: 80, pool: near6}
"""


# --- accepted, and what it means ------------------------------------------------------


def test_settings_and_defaults() -> None:
    cfg = parse_config(TUNNEL, "t.yaml")
    ipip, gue, v6, fixed, dsr6 = (cfg.vip_tunnel(v) for v in cfg.vips)
    assert dsr6 is None
    assert ipip is not None and gue is not None and v6 is not None and fixed is not None
    assert (ipip.encap, ipip.gue_port, ipip.port) == (TunnelEncap.IPIP, None, 0)
    assert (gue.encap, gue.port) == (TunnelEncap.GUE, GUE_PORT_DEFAULT)
    assert v6 is cfg.vips[2].tunnel  # a VIP's own block wins over its pool's
    assert v6.port == 7000
    assert [t.src_bits for t in (ipip, gue, v6, fixed)] == [8, 16, 0, 16]
    assert cfg.tunnel_pools() == {"far4", "far6"}


def test_the_vip_entries_carry_the_tunnel() -> None:
    cfg = parse_config(TUNNEL, "t.yaml")
    got = [vip_entry(cfg, v, i) for i, v in enumerate(cfg.vips)]
    fields = [(v.mode, str(v.tunnel_src), v.tunnel_encap, v.gue_port, v.tunnel_src_bits)
              for v in got]
    assert fields == [
        (VipMode.TUNNEL, "172.16.0.0", Encap.IPIP, 0, 8),
        (VipMode.TUNNEL, "fd00:100::", Encap.GUE, GUE_PORT_DEFAULT, 16),
        (VipMode.TUNNEL, "fd00:100::1:0", Encap.GUE, 7000, 0),
        (VipMode.TUNNEL, "10.0.0.0", Encap.IPIP, 0, 16),
        (VipMode.DSR, "None", Encap.IPIP, 0, 0),  # DSR: the contract's defaults
    ]
    assert got[2].addr == ipaddress.IPv6Address("2001:db8::51") and got[2].nat_port == 0


def test_a_wide_prefix_only_reserves_its_last_16_bits() -> None:
    """A /8 source gives 10.0.0.0-10.0.255.255: a backend elsewhere in the /8
    is not an outer source, and is accepted."""
    cfg = parse_config(TUNNEL.replace("10.50.2.12", "10.1.0.12"), "t.yaml")
    assert str(cfg.vip_tunnel(cfg.vips[3]).sources) == "10.0.0.0/16"  # type: ignore[union-attr]


def test_the_tables_and_routed_mac_lookups(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Tunnel pools' backends are resolved through their next hop (routed), a
    DSR pool's never; IPv6 backends reach the tables with their addresses."""
    asked: dict[str, bool] = {}

    def fake_resolve(addr: IPAddress, netns: str | None = None, tries: int = 3,
                     routed: bool = False) -> str:
        asked[str(addr)] = routed
        return f"02:00:00:00:00:{len(asked):02x}"

    monkeypatch.setattr(core, "resolve_mac", fake_resolve)
    cfg = parse_config(TUNNEL, "t.yaml")
    tables, checkpoint = built(cfg, tmp_path)
    assert asked == {"10.50.1.11": True, "10.50.2.12": True, "fd00:60::21": True,
                     "2001:db8:1::11": False}
    backends = {str(b.addr): (b.family, b.port) for b in tables.backends.values()}
    assert backends == {"10.50.1.11": (4, 1), "10.50.2.12": (4, 1), "fd00:60::21": (6, 0),
                        "2001:db8:1::11": (6, 0)}
    assert tables.vips[checkpoint.vips.get("v6")].mode is VipMode.TUNNEL


def test_an_unresolved_backend_waits_for_the_retry_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that did not answer is asked again by a resolving build (the
    retry tick), not by a weight push, and stays listed as unresolved."""
    calls: list[bool] = []

    def silent(addr: IPAddress, netns: str | None = None, tries: int = 3,
               routed: bool = False) -> str:
        calls.append(routed)
        raise NeighbourError(f"no MAC address for backend {addr}: it did not answer NDP")

    monkeypatch.setattr(core, "resolve_mac", silent)
    ctl = Controller.__new__(Controller)
    ctl.config = parse_config(TUNNEL, "t.yaml")
    ctl.macs, ctl.unresolved_addrs = {}, set()
    addr = ipaddress.IPv6Address("fd00:60::21")
    assert ctl._mac(addr, None, resolve=True, routed=True) is None
    assert ctl._mac(addr, None, resolve=False, routed=True) is None  # a weight push
    assert calls == [True] and ctl.unresolved_addrs == {(addr, True)}
    assert ctl._mac(addr, None, resolve=True, routed=True) is None
    assert calls == [True, True]


def built(cfg: HpclbConfig, tmp_path: Path) -> tuple[TableSet, Checkpoint]:
    ctl = Controller.__new__(Controller)
    ctl.config, ctl.macs, ctl.unresolved_addrs, ctl._rings = cfg, {}, set(), {}
    checkpoint = Checkpoint.load(tmp_path / "ids.json", MAX_BACKENDS, MAX_VIPS)
    tables, _ = ctl._build_tables(cfg, BackendDecider(cfg), checkpoint, resolve=False)
    return tables, checkpoint


@pytest.mark.parametrize("name", ["tunnel.yaml", "dualstack.yaml"])
def test_the_examples(name: str) -> None:
    cfg = load_config(EXAMPLES / name)
    assert HpclbConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    families = {(v.address.version, b.address.version)
                for v in cfg.vips for b in cfg.pools[v.pool].backends}
    if name == "tunnel.yaml":
        assert {v.mode.value for v in cfg.vips} == {"tunnel"}
        assert {t.encap for v in cfg.vips if (t := cfg.vip_tunnel(v))} == set(TunnelEncap)
        assert families == {(4, 4), (4, 6), (6, 6)}
    else:
        assert families == {(4, 4), (6, 6)}


# --- refused, and where -----------------------------------------------------------


# Problems reported at another line than the one changed: (old, path) -> where.
CROSS_FIELD = {
    ("{name: f2, address: 10.50.2.12,", "vips[3].tunnel.source"): "source: 10.0.0.0/8",
    ("{name: f2, address: 10.50.2.12,", "pools.far4.tunnel.source"): "source: 172.16",
    ("address: '2001:db8::51', port: 443, mode: tunnel, pool: far6,",
     "pools.far4.backends[0].address"): "name: f1",
    ("source: 'fd00:100::1:0/128'", "vips[2].address"): "name: v6",
}


@pytest.mark.parametrize(("old", "new", "path", "words"), [
    # the tunnel block
    ("{source: 172.16.0.0/24}", "{encap: gre, source: 172.16.0.0/24}",
     "pools.far4.tunnel.encap", "'ipip' or 'gue'"),
    ("{source: 172.16.0.0/24}", "{source: 172.16.0.1/24}", "pools.far4.tunnel.source",
     "host bits set: the prefix's network address is the tunnel source, write 172.16.0.0/24"),
    ("{source: 172.16.0.0/24}", "{source: 172.16.0.0/33}", "pools.far4.tunnel.source",
     "not an IPv4 or IPv6 prefix"),
    ("{source: 172.16.0.0/24}", "{source: 17}", "pools.far4.tunnel.source",
     "must be a prefix such as 172.16.0.0/24"),
    ("{source: 172.16.0.0/24}", "{}", "pools.far4.tunnel.source", "Field required"),
    ("{source: 172.16.0.0/24}", "{gue_port: 6080, source: 172.16.0.0/24}",
     "pools.far4.tunnel", "gue_port is for encap gue only (encap is ipip"),
    ("{encap: gue, source:", "{encap: gue, gue_port: 0, source:", "pools.far6.tunnel.gue_port",
     "greater than or equal to 1"),
    ("{source: 172.16.0.0/24}", "{source: 172.16.0.0/24, key: 1}", "pools.far4.tunnel.key",
     "unknown key"),
    # a tunnel VIP needs a block; only tunnel VIPs use one
    ("    tunnel: {source: 172.16.0.0/24}\n", "", "vips[0].mode",
     "tunnel mode needs the outer source prefix: add a `tunnel:` block to VIP 'ipip' or to "
     "pool 'far4'"),
    ("port: 80, pool: near6}", "port: 80, pool: near6, tunnel: {source: 10.9.0.0/24}}",
     "vips[4].tunnel", "only a tunnel VIP (mode: tunnel) encapsulates: this one is dsr"),
    ("port: 80, pool: near6}", "port: 80, pool: far6}", "vips[4].pool",
     "pool 'far6' serves tunnel VIP 'gue': a dsr VIP cannot share it"),
    # families
    ("{name: s1, address: 'fd00:60::21'}", "{name: s1, address: 10.60.0.21}",
     "pools.far6.backends[0].address",
     "backend 's1' is IPv4, and tunnel VIP 'gue' reaches pool 'far6' from an IPv6 source "
     "(fd00:100::/112): the outer headers are of the source's family"),
    ("{name: f1, address: 10.50.1.11,", "{name: f1, address: 'fd00:50::11',",
     "pools.far4.backends[0].address", "backend 'f1' is IPv6, and tunnel VIP 'ipip'"),
    ("address: '2001:db8::51', port: 443, mode: tunnel, pool: far6,",
     "address: '2001:db8::51', port: 443, mode: tunnel, pool: far4,",
     "pools.far4.backends[0].address",
     "backend 'f1' is IPv4, and tunnel VIP 'v6' reaches pool 'far4' from an IPv6 source"),
    ("source: 'fd00:100::1:0/128'", "source: 172.17.0.1/32", "vips[2].address",
     "IPv6 VIP 'v6' cannot be tunnelled from an IPv4 source (172.17.0.1/32): IPv6 inside "
     "IPv4 is not carried"),
    ("{name: n1, address: '2001:db8:1::11'}", "{name: n1, address: 10.1.0.11}",
     "pools.near6.backends[0].address",
     "backend 'n1' is IPv4 and DSR VIP 'dsr6' (2001:db8::52) IPv6"),
    # the outer sources hold no VIP nor backend
    ("{name: f2, address: 10.50.2.12,", "{name: f2, address: 10.0.2.12,",
     "vips[3].tunnel.source", "10.0.0.0/8 gives outer sources 10.0.0.0-10.0.255.255, which "
     "include the address of backend 'f2', 10.0.2.12: the hosts holding it drop packets from "
     "it as martians"),
    ("{name: f2, address: 10.50.2.12,", "{name: f2, address: 172.16.0.9,",
     "pools.far4.tunnel.source", "include the address of backend 'f2', 172.16.0.9"),
    ("source: 'fd00:100::/112'", "source: '2001:db8::/64'", "pools.far6.tunnel.source",
     "include the address of VIP 'v6', 2001:db8::51"),
])
def test_refusals_name_line_and_field(old: str, new: str, path: str, words: str) -> None:
    assert_refused(TUNNEL, old, new, path, words,
                   CROSS_FIELD.get((old, path), new or "name: ipip"), single=False)


# --- a reload -----------------------------------------------------------------------


def test_a_bad_tunnel_block_refuses_the_reload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """SIGHUP with a broken tunnel block: the reload is refused whole and the
    configuration in force stays, tunnel settings included."""
    monkeypatch.setenv("HPCLB_XDP_BIN", "/bin/true")
    ctl = Controller.__new__(Controller)
    ctl.config_path = tmp_path / "hpclb.yaml"
    ctl.config_path.write_text(TUNNEL)
    ctl.config = before = load_config(ctl.config_path)
    ctl.choice = Choice(Dataplane.XDP, "configured")
    ctl.dataplane = SimpleNamespace(argv=dataplane_argv(ctl.config, ctl.choice))  # type: ignore[assignment]
    broken = TUNNEL.replace("{encap: gue, source: 'fd00:100::/112'}",
                            "{encap: gue, source: 172.16.1.0/24}")
    ctl.config_path.write_text(broken)
    with caplog.at_level(logging.ERROR):
        assert ctl.reload() is False
    assert ctl.config is before
    assert str(ctl.config.vip_tunnel(ctl.config.vips[1]).source) == "fd00:100::/112"  # type: ignore[union-attr]
    assert "reload refused, keeping the running configuration" in caplog.text
    assert (f"hpclb.yaml:{line_of(broken, 'fd00:60::21')}:") in caplog.text
    assert "backend 's1' is IPv6, and tunnel VIP 'gue' reaches pool 'far6' from an IPv4 " \
           "source (172.16.1.0/24)" in caplog.text


# --- preflight (hpclb check) ----------------------------------------------------------


@pytest.mark.parametrize(("host", "missing"), [("[::1]", False), ("[fd00:dead::1]", True)])
def test_preflight_looks_up_an_ipv6_service_address(tmp_path: Path, host: str,
                                                    missing: bool) -> None:
    """A telemetry endpoint on an IPv6 address (in brackets) is looked up as
    IPv6: found when the host holds it, named when it does not."""
    text = TUNNEL.replace("  ring_size: 251\n", "  ring_size: 251\n  management_address: 10.0.0.7\n"
                          f"telemetry:\n  bind: tcp://{host}:5557\n"
                          f"  server_key: {tmp_path}/server.key_secret\n"
                          f"  allow_dir: {tmp_path}\n")
    problems = host_problems(parse_config(text, "t.yaml"))
    bind = [p for p in problems if p.startswith("telemetry.bind")]
    assert bind == ([f"telemetry.bind: {host[1:-1]} is not an address of this host"]
                    if missing else []), problems
