"""How the control plane launches the DPDK forwarder: the dpdk configuration
section, the data-plane choice (and its logged reason), and the command line
rendered from templates/dpdk_eal.args.j2."""

from __future__ import annotations

from typing import Any

import pytest

from hpclb.config import ConfigError, Dataplane, parse_config
from hpclb.dataplane.dpdk import DpdkLaunch, DpdkPort, forwarder_argv, free_hugepages_mb
from hpclb.dataplane.select import Choice, choose_dataplane, dataplane_argv, dpdk_launch

BASE = """\
appliance:
  name: gw1
  dataplane: {dataplane}
  interfaces:
    ingress: {ingress}
    egress: [{egress}]
  netns: lbns
  hash_key: 000102030405060708090a0b0c0d0e0f
{dpdk}
pools:
  web:
    weights: static
    backends:
      - {{name: b1, address: 198.18.0.11}}
vips:
  - {{name: svc, address: 198.18.1.10, port: 80, protocol: tcp, pool: web}}
"""


def config(dataplane: str = "auto", ingress: str = "eth0", egress: str = "eth1",
           dpdk: str = "") -> str:
    return BASE.format(dataplane=dataplane, ingress=ingress, egress=egress, dpdk=dpdk)


def argv_pairs(argv: list[str]) -> list[tuple[str, str]]:
    """(option, value) pairs of an argv whose options all take one value."""
    return list(zip(argv[::2], argv[1::2], strict=False))


# --- the template ------------------------------------------------------------


def test_vdev_ports_render_with_their_taps_and_queues() -> None:
    launch = DpdkLaunch(
        ports=(DpdkPort(0, "af_xdp", iface="eth0", tap="hpclb0"),
               DpdkPort(1, "af_packet", iface="eth1", tap=None)),
        socket="ipc:///run/hpclb/x.sock", lcores=(2, 3, 5), netns="lbns", ring_size=131071,
        flow_table_size=1000, flow_timeout_s=60, idle_sleep_us=10, numa="strict",
        socket_mem_mb=1024, file_prefix="hpclb-gw1", binary="/opt/hpclb-dpdk",
    )
    argv = forwarder_argv(launch)
    assert argv[0] == "/opt/hpclb-dpdk"
    sep = argv.index("--")
    eal, ours = argv[1:sep], argv[sep + 1:]
    assert eal == [
        "-l", "2,3,5", "--main-lcore", "2", "--in-memory", "--file-prefix", "hpclb-gw1",
        "-m", "1024", "--no-pci",
        "--vdev", "net_af_xdp0,iface=eth0,start_queue=0,queue_count=2",
        "--vdev", "net_tap0,iface=hpclb0",
        "--vdev", "net_af_packet1,iface=eth1,qpairs=2",
        "--log-level", "notice",
    ]
    assert argv_pairs(ours) == [
        ("--port", "net_af_xdp0:net_tap0"), ("--port", "net_af_packet1"),
        ("--socket", "ipc:///run/hpclb/x.sock"), ("--ring-size", "131071"),
        ("--flow-table-size", "1000"), ("--flow-timeout", "60"), ("--idle-sleep-us", "10"),
        ("--numa", "strict"), ("--netns", "lbns"),
    ]


def test_pci_ports_are_allowed_by_address_and_no_huge_is_explicit() -> None:
    launch = DpdkLaunch(ports=(DpdkPort(0, "pci", pci="0000:3b:00.0", tap="hpclb0"),),
                        socket="ipc:///s", hugepages=False, socket_mem_mb=128, binary="f")
    argv = forwarder_argv(launch)
    assert "--no-pci" not in argv
    assert argv[argv.index("-a") + 1] == "0000:3b:00.0"
    assert argv[argv.index("--no-huge") + 1] == "--no-shconf"  # --in-memory needs hugepages
    assert "--in-memory" not in argv and argv[argv.index("-m") + 1] == "128"
    assert "--port" in argv and "0000:3b:00.0:net_tap0" in argv
    assert "--netns" not in argv


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"index": 0, "driver": "pci", "pci": "eth0"}, "PCI address"),
    ({"index": 0, "driver": "af_xdp"}, "needs an interface"),
])
def test_bad_ports_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DpdkPort(**kwargs)


def test_a_forwarder_needs_a_worker_and_distinct_lcores() -> None:
    port = (DpdkPort(0, "af_xdp", iface="eth0"),)
    with pytest.raises(ValueError, match="two lcores"):
        DpdkLaunch(ports=port, socket="ipc:///s", lcores=(0,), binary="f")
    with pytest.raises(ValueError, match="repeat"):
        DpdkLaunch(ports=port, socket="ipc:///s", lcores=(1, 1), binary="f")


# --- configuration -----------------------------------------------------------


def test_dpdk_section_defaults() -> None:
    d = parse_config(config()).appliance.dpdk
    assert (d.driver, d.lcores, d.hugepages_mb, d.numa.value, d.exception_path) == (
        None, [0, 1], 512, "warn", True)


@pytest.mark.parametrize(("text", "field", "message"), [
    (config(dpdk="  dpdk: {lcores: [1, 1]}"), "appliance.dpdk.lcores", "distinct"),
    (config(dpdk="  dpdk: {lcores: [0]}"), "appliance.dpdk.lcores", "at least 2"),
    (config(dpdk="  dpdk: {driver: pci}"), "appliance.dpdk.driver", "PCI addresses"),
    (config(dpdk="  dpdk: {numa: maybe}"), "appliance.dpdk.numa", "'strict' or 'warn'"),
    (config(dpdk="  dpdk: {hugepages_mb: 1}"), "appliance.dpdk.hugepages_mb", "64"),
    (config(egress="0000:3b:00.1"), "appliance.interfaces", "mix of PCI"),
    (config(dataplane="xdp", ingress="0000:3b:00.0", egress="0000:3b:00.1"),
     "appliance.dataplane", "PCI addresses"),
    (config(ingress="0000:3b:00.0", egress="0000:3b:00.1", dpdk="  dpdk: {driver: af_xdp}"),
     "appliance.dpdk.driver", "wraps a kernel interface"),
])
def test_bad_dpdk_settings_name_their_field(text: str, field: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, "t.yaml")
    assert field in str(err.value) and message in str(err.value), str(err.value)


# --- the choice ----------------------------------------------------------------


def test_xdp_when_configured() -> None:
    choice = choose_dataplane(parse_config(config(dataplane="xdp")))
    assert (choice.kind, choice.reason) == (Dataplane.XDP, "configured")


def test_auto_without_a_dpdk_port_picks_xdp_and_says_why() -> None:
    choice = choose_dataplane(parse_config(config()))
    assert choice.kind == Dataplane.XDP
    assert "no DPDK vdev driver is configured" in choice.reason


def test_nics_not_bound_to_vfio_leave_no_data_plane_and_say_why() -> None:
    # XDP needs kernel interface names, so PCI ports DPDK cannot own stop here.
    for dataplane in ("auto", "dpdk"):
        cfg = parse_config(config(dataplane=dataplane, ingress="0000:ff:1f.7",
                                  egress="0000:ff:1f.6"))
        with pytest.raises(RuntimeError, match="not bound to vfio-pci"):
            choose_dataplane(cfg)


def test_dpdk_without_enough_hugepages_is_refused_with_the_figures() -> None:
    need = 1 << 20  # 1 TiB: more than this host has free
    assert free_hugepages_mb() < need
    text = config(dataplane="dpdk", dpdk=f"  dpdk: {{driver: af_xdp, hugepages_mb: {need}}}")
    with pytest.raises(RuntimeError, match=f"{need} MB needed"):
        choose_dataplane(parse_config(text))
    auto = choose_dataplane(parse_config(text.replace("dataplane: dpdk", "dataplane: auto")))
    assert auto.kind == Dataplane.XDP and f"{need} MB needed" in auto.reason


def test_dpdk_launch_follows_the_configuration() -> None:
    cfg = parse_config(config(dataplane="dpdk", dpdk=(
        "  dpdk: {driver: af_packet, lcores: [0, 2, 3], idle_sleep_us: 5, tap_prefix: exc}")))
    launch = dpdk_launch(cfg)
    assert [(p.device, p.iface, p.tap) for p in launch.ports] == [
        ("net_af_packet0", "eth0", "exc0"), ("net_af_packet1", "eth1", "exc1")]
    assert (launch.lcores, launch.workers, launch.netns, launch.idle_sleep_us) == (
        (0, 2, 3), 2, "lbns", 5)
    assert launch.socket == cfg.appliance.control_socket
    assert launch.file_prefix == "hpclb-gw1"
    argv = dataplane_argv(cfg, Choice(Dataplane.DPDK, "configured"))
    assert argv[0].endswith("hpclb-dpdk")
    assert "net_af_packet0,iface=eth0,qpairs=2" in argv and "net_tap1,iface=exc1" in argv
    xdp = dataplane_argv(cfg, Choice(Dataplane.XDP, "configured"))
    assert xdp[0].endswith("hpclb-xdp") and ["--egress", "eth1"] == xdp[-4:-2]


# --- the host's hooks around a start ---------------------------------------------


class FakeNetlink:
    closed = 0

    def close(self) -> None:
        FakeNetlink.closed += 1


@pytest.fixture
def host_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """DpdkHost's netlink work, recorded instead of done; the TAP exc0 shows
    up on the third look."""
    from hpclb.dataplane import exception_path

    calls: list[tuple[str, ...]] = []
    looks = {"n": 0}

    def record(name: str) -> Any:
        def fn(*args: Any, ipr: Any = None) -> Any:
            assert isinstance(ipr, FakeNetlink)
            calls.append((name, *(str(a) for a in args)))
        return fn

    def link_index(ifname: str, netns: str | None = None, *, ipr: Any = None) -> int | None:
        looks["n"] += 1
        return 7 if looks["n"] >= 3 else None

    monkeypatch.setattr(exception_path, "open_netlink", lambda netns=None: FakeNetlink())
    for name in ("detach_xdp", "hand_over", "give_back", "claim_vips"):
        monkeypatch.setattr(exception_path, name, record(name))
    monkeypatch.setattr(exception_path, "link_index", link_index)
    return calls


def dpdk_config(vips: str = "198.18.1.10") -> Any:
    text = config(dataplane="dpdk", dpdk="  dpdk: {driver: af_xdp, tap_prefix: exc}")
    extra = "".join(f"  - {{name: v{i}, address: {a}, port: 81, protocol: udp, pool: web}}\n"
                    for i, a in enumerate(vips.split()) if a != "198.18.1.10")
    return parse_config(text + extra)


def test_the_host_hooks_keep_the_restart_path_short(host_calls: list[tuple[str, ...]],
                                                    tmp_path: Any) -> None:
    """Before the spawn only the stale AF_XDP programs go; the VIPs and the
    addresses' hand-over overlap the start-up, waiting for each TAP; after the
    hello nothing is left to do; a reload's VIPs are synced; a stop gives
    everything back and closes the kept netlink socket."""
    from hpclb.dataplane.select import DpdkHost

    host = DpdkHost(dpdk_config(), tmp_path)
    rec = str(tmp_path / "gw1.vips.addresses.json")
    host.before_start()
    assert host_calls == [("detach_xdp", "eth0", "lbns"), ("detach_xdp", "eth1", "lbns")]
    host_calls.clear()
    host.while_starting(lambda: True)
    assert host_calls == [
        ("claim_vips", "['198.18.1.10']", rec, "lbns"),
        ("hand_over", "eth0", "exc0", str(tmp_path / "gw1.exc0.addresses.json"), "lbns"),
        ("hand_over", "eth1", "exc1", str(tmp_path / "gw1.exc1.addresses.json"), "lbns")]
    host_calls.clear()
    host.after_ready()
    assert host_calls == []
    # The next restart: the VIPs are already the forwarder's, only the TAPs move.
    host.before_start()
    host.while_starting(lambda: True)
    assert [c[0] for c in host_calls] == ["detach_xdp", "detach_xdp", "hand_over", "hand_over"]
    host_calls.clear()
    # A start that ends before its TAP appears: after_ready is left to do it.
    host.before_start()
    host.while_starting(lambda: False)
    host.after_ready()
    assert [c[0] for c in host_calls] == ["detach_xdp", "detach_xdp", "hand_over", "hand_over"]
    host_calls.clear()
    host.sync_vips(dpdk_config("198.18.1.10 198.18.1.20"))
    assert host_calls == [("claim_vips", "['198.18.1.10', '198.18.1.20']", rec, "lbns")]
    host_calls.clear()
    closed = FakeNetlink.closed
    host.after_stop()
    assert host_calls == [("give_back", str(tmp_path / "gw1.exc0.addresses.json"), "lbns"),
                          ("give_back", str(tmp_path / "gw1.exc1.addresses.json"), "lbns"),
                          ("give_back", rec, "lbns")]
    assert FakeNetlink.closed == closed + 1


def test_an_adopted_forwarder_gets_its_vips_and_addresses_after_its_hello(
        host_calls: list[tuple[str, ...]], tmp_path: Any) -> None:
    from hpclb.dataplane.select import DpdkHost

    host = DpdkHost(dpdk_config(), tmp_path)
    host.after_ready()
    assert [c[0] for c in host_calls] == ["hand_over", "hand_over", "claim_vips"]
