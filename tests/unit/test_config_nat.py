"""NAT mode's configuration (`mode: nat` VIPs, the `nat:` section): what it
accepts and its defaults, what it refuses (naming file, line and field), and
what the control plane makes of it: TableSet.nat, each Vip's mode, nat_port and
snat, the data plane's connection-table size, a reload that changes it."""

from __future__ import annotations

import logging
from ipaddress import IPv4Address
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpclb.config import (
    ConnTimeouts,
    HpclbConfig,
    NatDownPolicy,
    load_config,
    parse_config,
)
from hpclb.contract.tables import (
    CONN_STATE_NAMES,
    CONN_TABLE_DEFAULT,
    CONN_TIMEOUTS_DEFAULT,
    MAX_BACKENDS,
    MAX_VIPS,
    NatConfig,
    NatDown,
    TableSet,
    VipMode,
)
from hpclb.controller.backends import BackendDecider
from hpclb.controller.core import Controller, Prepared, nat_tables, vip_entry
from hpclb.controller.ids import Checkpoint
from hpclb.dataplane.select import Choice, Dataplane, dataplane_argv, dpdk_launch, xdp_argv

from .config_cases import EXAMPLES, assert_refused, line_of, refused

NAT = """\
appliance:
  name: gw1
  interfaces:
    ingress: eth0
    egress: [eth1]
  hash_key: 000102030405060708090a0b0c0d0e0f
  ring_size: 251
  management_address: 10.0.0.5
pools:
  web:
    backend_port: 8080
    backends:
      - {name: b1, address: 10.30.0.11, via: eth1, mac: '02:00:00:00:00:11'}
      - {name: b2, address: 10.30.0.12, via: eth1, mac: '02:00:00:00:00:12'}
  ldap:
    snat: true
    backends:
      - {name: l1, address: 10.31.0.21, via: eth1, mac: '02:00:00:00:00:21'}
  dsr:
    backends:
      - {name: d1, address: 10.32.0.31, mac: '02:00:00:00:00:31'}
vips:
  - {name: web, address: 192.0.2.30, port: 80, mode: nat, pool: web}
  - {name: tls, address: 192.0.2.30, port: 443, mode: nat, pool: web, backend_port: 8443,
     snat: true}
  - {name: ldap, address: 192.0.2.31, port: 389, mode: nat, pool: ldap}
  - {name: ldap-udp, address: 192.0.2.31, port: 389, protocol: udp, mode: nat, pool: ldap,
     snat: false}
  - {name: plain, address: 192.0.2.32, port: 80, pool: dsr}
nat:
  conn_table_size: 1024
  on_backend_down: drop
  timeouts: {established: 3600, udp_replied: 180}
  snat: {addresses: [10.30.255.1, 10.30.255.2], ports: "2000-2999"}
"""

MINIMAL = """\
appliance:
  name: gw1
  interfaces: {ingress: eth0, egress: [eth1]}
  hash_key: 000102030405060708090a0b0c0d0e0f
pools:
  web: {backends: [{name: b1, address: 10.30.0.11, via: eth1}]}
vips: [{name: web, address: 192.0.2.30, port: 80, mode: nat, pool: web}]
"""


# --- what is accepted, and the defaults -------------------------------------------


def test_the_defaults_are_the_contracts() -> None:
    cfg = parse_config(MINIMAL, "t.yaml")
    nat = cfg.nat
    assert nat.conn_table_size == CONN_TABLE_DEFAULT
    assert nat.on_backend_down is NatDownPolicy.RESCHEDULE
    assert nat.timeouts.by_state() == CONN_TIMEOUTS_DEFAULT
    assert nat.snat is None
    assert tuple(ConnTimeouts.model_fields) == CONN_STATE_NAMES  # one field per state
    [vip] = cfg.vips
    assert cfg.vip_backend_port(vip) == 80 and cfg.vip_snat(vip) is False
    assert nat_tables(cfg) == NatConfig()  # the contract's defaults, field for field


def test_pool_settings_and_vip_overrides() -> None:
    cfg = parse_config(NAT, "t.yaml")
    assert [cfg.vip_backend_port(v) for v in cfg.vips] == [8080, 8443, 389, 389, 80]
    assert [cfg.vip_snat(v) for v in cfg.vips] == [False, True, True, False, False]
    assert cfg.nat.timeouts.established == 3600 and cfg.nat.timeouts.syn_sent == 120
    assert cfg.nat.on_backend_down is NatDownPolicy.DROP
    assert cfg.nat.snat is not None
    assert (cfg.nat.snat.ports.min, cfg.nat.snat.ports.max) == (2000, 2999)


@pytest.mark.parametrize("ports", ['"2000-2999"', "' 2000 - 2999 '", "2000-2999",
                                   "{min: 2000, max: 2999}"])
def test_snat_ports_as_a_range_or_min_max(ports: str) -> None:
    cfg = parse_config(NAT.replace('ports: "2000-2999"', f"ports: {ports}"), "t.yaml")
    assert cfg.nat.snat is not None
    assert (cfg.nat.snat.ports.min, cfg.nat.snat.ports.max) == (2000, 2999)


def test_snat_ports_default_to_the_unprivileged_range() -> None:
    cfg = parse_config(NAT.replace(', ports: "2000-2999"', ""), "t.yaml")
    assert cfg.nat.snat is not None
    assert (cfg.nat.snat.ports.min, cfg.nat.snat.ports.max) == (1024, 65535)


def test_round_trips_through_model_dump() -> None:
    for cfg in (parse_config(NAT, "t.yaml"), load_config(EXAMPLES / "nat.yaml")):
        assert HpclbConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_the_example_is_a_nat_gateway() -> None:
    cfg = load_config(EXAMPLES / "nat.yaml")
    assert {v.mode.value for v in cfg.vips} == {"nat"}
    assert cfg.nat.snat is not None and any(cfg.vip_snat(v) for v in cfg.vips)
    assert {cfg.vip_backend_port(v) for v in cfg.vips} == {8080, 8443, 389}


# --- what is refused, and where ----------------------------------------------------


# Problems reported at another line than the one changed: (old, path) -> where.
CROSS_FIELD = {
    ("port: 80, pool: dsr}", "pools.web.backend_port"): "backend_port: 8080",
    ("port: 80, pool: dsr}", "pools.ldap.snat"): "snat: true",
    ("10.30.0.12, via: eth1,", "vips[0].mode"): "mode: nat",
    ("[10.30.255.1, 10.30.255.2]", "vips[1].snat"): "snat: true}",
    ("address: 192.0.2.30, port: 80", "pools.web.backends[0].address"): "10.30.0.11, via",
}


@pytest.mark.parametrize(("old", "new", "path", "words"), [
    # the nat section
    ("conn_table_size: 1024", "conn_table_size: 1023", "nat.conn_table_size",
     "must be even (two entries per connection), got 1023"),
    ("conn_table_size: 1024", "conn_table_size: 2", "nat.conn_table_size",
     "greater than or equal to 4"),
    ("conn_table_size: 1024", "conn_table_size: 67108864", "nat.conn_table_size",
     "less than or equal to 33554432"),
    ("conn_table_size: 1024", "conn_table_size: '1024'", "nat.conn_table_size",
     "valid integer"),
    ("on_backend_down: drop", "on_backend_down: retry", "nat.on_backend_down",
     "'reschedule' or 'drop'"),
    ("{established: 3600,", "{establshed: 3600,", "nat.timeouts.establshed",
     "did you mean 'established'"),
    ("{established: 3600,", "{established: 0,", "nat.timeouts.established",
     "greater than or equal to 1"),
    ("{established: 3600,", "{established: 1.5,", "nat.timeouts.established",
     "valid integer"),
    ("{established: 3600,", "{established: 2147483648,", "nat.timeouts.established",
     "less than or equal to 2147483647"),
    ("conn_table_size: 1024", "conn_table_sise: 1024", "nat.conn_table_sise",
     "did you mean 'conn_table_size'"),
    # SNAT
    # an IPv6 pool alone does not serve IPv4 SNAT VIPs (test_config_nat6.py: the other way)
    ("[10.30.255.1, 10.30.255.2]", "['2001:db8::1']", "vips[1].snat",
     "SNAT for IPv4 VIP 'tls' needs an IPv4 address: add one to nat.snat.addresses (a "
     "connection takes a SNAT address of its VIP's family)"),
    ("[10.30.255.1, 10.30.255.2]", "[10.30.255.1, 10.30.255.1]", "nat.snat.addresses",
     "listed twice: 10.30.255.1"),
    ("[10.30.255.1, 10.30.255.2]", "[]", "nat.snat.addresses", "at least 1 item"),
    ("[10.30.255.1, 10.30.255.2]", "[" + ", ".join(f"10.30.255.{i}" for i in range(1, 18)) + "]",
     "nat.snat.addresses", "17 IPv4 addresses: at most 16 of each family"),
    ("[10.30.255.1, 10.30.255.2]", "[0.0.0.0]", "nat.snat.addresses[0]",
     "not a unicast address"),
    ("[10.30.255.1, 10.30.255.2]", "[10.30.255.1, 192.0.2.31]", "nat.snat.addresses[1]",
     "192.0.2.31 is VIP 'ldap''s address"),
    ("[10.30.255.1, 10.30.255.2]", "[10.30.0.12]", "nat.snat.addresses[0]",
     "backend 'b2'"),
    ("[10.30.255.1, 10.30.255.2]", "[10.0.0.5]", "nat.snat.addresses[0]",
     "the management address"),
    ('ports: "2000-2999"', 'ports: "2000-"', "nat.snat.ports", "expected a range 'MIN-MAX'"),
    ('ports: "2000-2999"', "ports: 5000", "nat.snat.ports", "expected a range 'MIN-MAX'"),
    ('ports: "2000-2999"', 'ports: "3000-2000"', "nat.snat.ports",
     "min 3000 is above max 2000"),
    ('ports: "2000-2999"', 'ports: "0-100"', "nat.snat.ports.min",
     "greater than or equal to 1"),
    ('ports: "2000-2999"', "ports: {min: 1, max: 70000}", "nat.snat.ports.max",
     "less than or equal to 65535"),
    # VIPs and pools
    ("address: 192.0.2.30, port: 80", "address: '2001:db8::30', port: 80",
     "pools.web.backends[0].address",
     "backend 'b1' is IPv4 and NAT VIP 'web' (2001:db8::30) IPv6: NAT mode does not translate "
     "between families (no NAT64"),
    ("port: 80, pool: dsr}", "port: 80, pool: dsr, backend_port: 8080}",
     "vips[4].backend_port", "only a NAT VIP (mode: nat) maps ports"),
    ("port: 80, pool: dsr}", "port: 80, pool: dsr, snat: true}", "vips[4].snat",
     "only a NAT VIP (mode: nat) takes SNAT"),
    ("port: 80, pool: dsr}", "port: 80, pool: web}", "pools.web.backend_port",
     "only NAT VIPs can use backend_port, and dsr VIP 'plain' uses this pool"),
    ("port: 80, pool: dsr}", "port: 80, pool: ldap}", "pools.ldap.snat",
     "only NAT VIPs can use snat, and dsr VIP 'plain' uses this pool"),
    ("    backend_port: 8080", "    backend_port: 0", "pools.web.backend_port",
     "greater than or equal to 1"),
    ("backend_port: 8443", "backend_port: 65536", "vips[1].backend_port",
     "less than or equal to 65535"),
    ("mode: nat, pool: web}", "mode: tunnel, pool: web}", "vips[0].mode",
     "tunnel mode needs the outer source prefix: add a `tunnel:` block to VIP 'web'"),
    ("port: 80, pool: dsr}", "port: 80, pool: dsr, tunnel: {source: 10.9.0.0/24}}",
     "vips[4].tunnel", "only a tunnel VIP (mode: tunnel) encapsulates: this one is dsr"),
    ("10.30.0.12, via: eth1,", "'fd00:30::12', via: eth1,", "pools.web.backends[1].address",
     "backend 'b2' is IPv6 and NAT VIP 'web' (192.0.2.30) IPv4: NAT mode does not translate "
     "between families (no NAT64: a connection's addresses, client, VIP, backend and SNAT, are "
     "all IPv4 or all IPv6); give pool 'web' IPv4 backends"),
    # two interfaces: the backends of a NAT VIP leave by an egress port
    ("10.30.0.12, via: eth1,", "10.30.0.12,", "vips[0].mode",
     "pool 'web' has b2 on the ingress interface eth0 (no `via`)"),
])
def test_refusals_name_line_and_field(old: str, new: str, path: str, words: str) -> None:
    assert_refused(NAT, old, new, path, words, CROSS_FIELD.get((old, path), new))


def test_snat_asked_for_without_addresses() -> None:
    message = refused(NAT.split("  snat: {addresses")[0])
    assert f"t.yaml:{line_of(NAT, 'snat: true}')}:" in message  # vips[1].snat's line
    assert "vips[1].snat: SNAT for VIP 'tls' needs addresses: add nat.snat.addresses" in message
    assert "pools.ldap.snat: SNAT for VIP 'ldap' needs addresses" in message
    assert "ldap-udp" not in message  # its own snat: false wins


def test_nat_needs_an_egress_interface() -> None:
    text = MINIMAL.replace(", egress: [eth1]", "").replace(", via: eth1", "")
    message = refused(text)
    assert message.startswith(f"t.yaml:{line_of(text, 'mode: nat')}:"), message
    assert ("vips[0].mode: NAT mode needs two interfaces: clients on "
            "appliance.interfaces.ingress (eth0), backends behind an egress interface "
            "(appliance.interfaces.egress is empty)") in message
    parse_config(text.replace("mode: nat", "mode: dsr"))  # one arm is DSR's


def test_many_one_arm_backends_are_named_briefly() -> None:
    backends = ", ".join(f"{{name: n{i}, address: 10.30.1.{i}}}" for i in range(1, 9))
    text = MINIMAL.replace("{name: b1, address: 10.30.0.11, via: eth1}", backends)
    message = refused(text)
    assert "has n1, n2, n3, n4, n5 and 3 more on the ingress interface" in message, message


def test_ipv6_nat_takes_ipv6_backends() -> None:
    """An IPv6 NAT VIP with IPv6 backends is accepted as the DSR one is (more
    in test_config_nat6.py); with an IPv4 backend it is refused at the
    backend's address (no NAT64)."""
    v6 = MINIMAL.replace("192.0.2.30", "'2001:db8::30'").replace("10.30.0.11", "'fd00:30::11'")
    for mode in ("dsr", "nat"):
        cfg = parse_config(v6.replace("mode: nat", f"mode: {mode}"))
        assert cfg.vips[0].address.version == cfg.pools["web"].backends[0].address.version == 6
    mixed = v6.replace("'fd00:30::11'", "10.30.0.11")
    message = refused(mixed)
    column = mixed.splitlines()[-2].index("10.30.0.11") + 1
    assert message.startswith(f"t.yaml:{line_of(mixed, '10.30.0.11')}:{column}: "
                              "pools.web.backends[0].address: backend 'b1' is IPv4 and NAT VIP "
                              "'web' (2001:db8::30) IPv6: NAT mode does not translate"), message


# --- into the tables ----------------------------------------------------------------


def built(cfg: HpclbConfig, tmp_path: Path) -> tuple[TableSet, Checkpoint]:
    """The controller's _build_tables for ``cfg``, without a data plane: MACs
    are configured, so nothing is resolved."""
    ctl = Controller.__new__(Controller)
    ctl.config, ctl.macs, ctl.unresolved_addrs, ctl._rings = cfg, {}, set(), {}
    checkpoint = Checkpoint.load(tmp_path / "ids.json", MAX_BACKENDS, MAX_VIPS)
    tables, _ = ctl._build_tables(cfg, BackendDecider(cfg), checkpoint, resolve=False)
    return tables, checkpoint


def test_the_configuration_reaches_the_table_set(tmp_path: Path) -> None:
    cfg = parse_config(NAT, "t.yaml")
    tables, checkpoint = built(cfg, tmp_path)
    assert tables.nat == NatConfig(
        snat_addrs=(IPv4Address("10.30.255.1"), IPv4Address("10.30.255.2")),
        snat_port_min=2000, snat_port_max=2999, on_backend_down=NatDown.DROP,
        timeouts_s=(120, 60, 3600, 120, 120, 10, 30, 180))
    vips = {name: tables.vips[checkpoint.vips.get(name)]
            for name in ("web", "tls", "ldap", "ldap-udp", "plain")}
    assert {n: (v.mode, v.nat_port, v.snat) for n, v in vips.items()} == {
        "web": (VipMode.NAT, 8080, False),
        "tls": (VipMode.NAT, 8443, True),
        "ldap": (VipMode.NAT, 389, True),  # the VIP's own port, explicit
        "ldap-udp": (VipMode.NAT, 389, False),
        "plain": (VipMode.DSR, 0, False),
    }
    assert vips["ldap-udp"].proto == 17 and vips["web"].addr == IPv4Address("192.0.2.30")
    # NAT backends leave by their egress port (1), the one-arm DSR one by the ingress (0)
    ports = {str(b.addr): b.port for b in tables.backends.values()}
    assert ports == {"10.30.0.11": 1, "10.30.0.12": 1, "10.31.0.21": 1, "10.32.0.31": 0}
    assert all(len(tables.rings[vid]) == 251 for vid in tables.vips)


def test_vip_entry_of_a_dsr_vip_is_unchanged() -> None:
    cfg = parse_config(NAT, "t.yaml")
    vip = vip_entry(cfg, cfg.vips[4], 7)
    assert (vip.vip_id, vip.mode, vip.nat_port, vip.snat) == (7, VipMode.DSR, 0, False)


# --- the data plane's command line, and a reload ---------------------------------


@pytest.fixture
def daemons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCLB_XDP_BIN", "/bin/true")
    monkeypatch.setenv("HPCLB_DPDK_BIN", "/bin/true")


def test_the_data_plane_starts_with_the_table_size(daemons: None) -> None:
    cfg = parse_config(NAT, "t.yaml")
    argv = xdp_argv(cfg)
    i = argv.index("--conn-table-size")
    assert argv[i + 1] == "1024"
    default = xdp_argv(parse_config(MINIMAL, "t.yaml"))
    assert default[default.index("--conn-table-size") + 1] == str(CONN_TABLE_DEFAULT)
    dpdk = parse_config(NAT.replace("ring_size: 251", "ring_size: 251\n  dpdk: {driver: af_xdp}"))
    assert dpdk_launch(dpdk).conn_table_size == 1024


def reloading(tmp_path: Path, running: str) -> Controller:
    """A controller in force with ``running``, as far as _restart_only and
    reload's refusal look (no data plane, no monitors)."""
    ctl = Controller.__new__(Controller)
    ctl.config_path = tmp_path / "hpclb.yaml"
    ctl.config_path.write_text(running)
    ctl.config = load_config(ctl.config_path)
    ctl.choice = Choice(Dataplane.XDP, "configured")
    ctl.dataplane = SimpleNamespace(argv=dataplane_argv(ctl.config, ctl.choice))  # type: ignore[assignment]
    ctl.speaker = None  # no `bgp:` in force: a commit has no announcements to follow
    return ctl


def test_a_new_table_size_waits_for_the_next_data_plane_start(
        tmp_path: Path, daemons: None, caplog: pytest.LogCaptureFixture) -> None:
    """A reload applies a new conn_table_size to the next start's command line
    (with a warning), never to the running data plane; a restart-only setting
    changed alongside it is kept as before."""
    ctl = reloading(tmp_path, NAT)
    new = parse_config(NAT.replace("conn_table_size: 1024", "conn_table_size: 4096")
                       .replace("on_backend_down: drop", "on_backend_down: reschedule"))
    with caplog.at_level(logging.WARNING):
        kept = ctl._restart_only(new)
    assert kept == new  # nothing to keep: the size is the next start's, the rest applies now
    assert "restart hpclb" not in caplog.text
    ctl.macs, ctl.unresolved_addrs, ctl._rings = {}, set(), {}
    ctl.monitors = SimpleNamespace(commit=lambda *_: None)  # type: ignore[assignment]
    ctl._push = lambda desired: True  # type: ignore[method-assign]
    checkpoint = Checkpoint.load(tmp_path / "ids.json", MAX_BACKENDS, MAX_VIPS)
    decider = BackendDecider(kept)
    desired, decisions = ctl._build_tables(kept, decider, checkpoint, resolve=False)
    running = list(ctl.dataplane.argv)
    with caplog.at_level(logging.WARNING):
        ctl._commit(Prepared(kept, None, decider, checkpoint, desired,  # type: ignore[arg-type]
                             decisions))
    assert "nat.conn_table_size 1024 -> 4096 entries: takes effect at the next data-plane " \
           "start" in caplog.text
    size = ctl.dataplane.argv.index("--conn-table-size") + 1
    assert ctl.dataplane.argv[size] == "4096" and running[size] == "1024"
    assert ctl.dataplane.argv[:size] == running[:size]
    # With a restart-only setting changed too, that one is kept and said so
    caplog.clear()
    both = parse_config(NAT.replace("conn_table_size: 1024", "conn_table_size: 8192")
                        .replace("ring_size: 251", "ring_size: 257"))
    with caplog.at_level(logging.WARNING):
        kept = ctl._restart_only(both)
    assert kept.appliance.ring_size == 251 and kept.nat.conn_table_size == 8192
    assert "restart hpclb to apply them" in caplog.text


def test_a_broken_nat_section_refuses_the_reload(tmp_path: Path, daemons: None,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    ctl = reloading(tmp_path, NAT)
    before = ctl.config
    ctl.config_path.write_text(NAT.replace("conn_table_size: 1024", "conn_table_size: 1023"))
    with caplog.at_level(logging.ERROR):
        assert ctl.reload() is False
    assert ctl.config is before
    assert "reload refused, keeping the running configuration" in caplog.text
    assert "nat.conn_table_size: must be even" in caplog.text
