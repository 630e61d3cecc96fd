"""The BGP announcement tied to the data plane's life (issue 15): the
liveness interface (`bgp.alive_interface`, `--alive-interface` on either data
plane, each VIP a route through it in vips.conf) and BFD (`bgp.bfd`, rendered
into bird.conf, its sessions' states in the speaker's status)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from hpclb.announce import bird
from hpclb.announce.decision import Inputs
from hpclb.announce.speaker import Speaker
from hpclb.config import Dataplane, parse_config
from hpclb.config.bgp import BgpConfig
from hpclb.dataplane.select import (
    Choice,
    alive_interface_of,
    dataplane_argv,
    running_alive_interface,
    xdp_argv,
)
from hpclb.host import install

VIP, VIP6 = "198.18.1.10", "fd48:4c01::10"
BGP: dict[str, Any] = {"local_asn": 65001, "router_id": "10.99.0.1",
                       "peers": [{"name": "tor1", "address": "10.99.0.2", "asn": 65000},
                                 {"name": "tor2", "address": "10.98.0.2", "asn": 65000,
                                  "multihop": 2, "source_address": "10.99.0.1"}],
                       "next_hop6": "fd00::1"}
BASE: dict[str, Any] = {
    "appliance": {"name": "gw", "interfaces": {"ingress": "eth0"},
                  "hash_key": "000102030405060708090a0b0c0d0e0f"},
    "pools": {"web": {"backends": [{"name": "b1", "address": "10.0.0.11"}]}},
    "vips": [{"name": "v", "address": VIP, "port": 80, "protocol": "tcp", "pool": "web"}],
}


def bgp(tmp_path: Path, **extra: Any) -> BgpConfig:
    return BgpConfig.model_validate({**BGP, "config_dir": str(tmp_path),
                                     "control_socket": str(tmp_path / "bird.ctl"), **extra})


# --- the schema ------------------------------------------------------------------------------

def test_defaults_couple_the_announcement_and_leave_bfd_off(tmp_path: Path) -> None:
    cfg = bgp(tmp_path)
    assert cfg.alive_interface == "hpclb-alive"
    assert not cfg.bfd.enabled
    assert (cfg.bfd.interval_ms, cfg.bfd.multiplier) == (300, 3)
    assert bgp(tmp_path, alive_interface=None).alive_interface is None


@pytest.mark.parametrize("name", ["x" * 15, "a.b-c_1", "alive0"])
def test_interface_names_the_kernel_takes(tmp_path: Path, name: str) -> None:
    assert bgp(tmp_path, alive_interface=name).alive_interface == name


@pytest.mark.parametrize("name", ["", "x" * 16, ".", "..", "a b", "a/b", "a%d", "é", 7])
def test_other_names_are_refused(tmp_path: Path, name: object) -> None:
    with pytest.raises(ValidationError, match="alive_interface"):
        bgp(tmp_path, alive_interface=name)


@pytest.mark.parametrize("bfd", [{"interval_ms": 5}, {"interval_ms": 60001},
                                 {"multiplier": 0}, {"multiplier": 256},
                                 {"interval_ms": "300"}, {"enabled": True, "min_rx": 1}])
def test_bfd_out_of_bounds_is_refused(tmp_path: Path, bfd: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="bfd"):
        bgp(tmp_path, bfd=bfd)


def test_bfd_to_a_multihop_peer_needs_its_source_address(tmp_path: Path) -> None:
    peers = [{"name": "far", "address": "10.98.0.2", "asn": 65000, "multihop": 3}]
    with pytest.raises(ValidationError, match="peer far is multihop: BFD to it needs"):
        bgp(tmp_path, peers=peers, bfd={"enabled": True})
    assert bgp(tmp_path, peers=peers).bfd.enabled is False  # without BFD: fine


# --- rendering -------------------------------------------------------------------------------

def test_routes_go_through_the_liveness_interface(tmp_path: Path) -> None:
    text = bird.render_vips(bgp(tmp_path), [VIP6, VIP], "hpclb-alive")
    assert f'route {VIP}/32 via "hpclb-alive";' in text
    assert f'route {VIP6}/128 via "hpclb-alive";' in text
    assert "blackhole" not in text
    assert bird.parse_vips(text) == {VIP, VIP6}


def test_without_an_interface_the_routes_are_blackholes(tmp_path: Path) -> None:
    text = bird.render_vips(bgp(tmp_path, alive_interface=None), [VIP], None)
    assert f"route {VIP}/32 blackhole;" in text and "via" not in text
    assert bird.parse_vips(text) == {VIP}


def test_parse_vips_reads_both_forms_and_nothing_else() -> None:
    text = "\n".join([f"  route {VIP}/32 blackhole;", f'  route {VIP6}/128 via "alive0";',
                      "  route 192.0.2.1/32 unreachable;", "  # route 192.0.2.2/32 blackhole;",
                      '  route 192.0.2.3/32 via 10.0.0.1;'])
    assert bird.parse_vips(text) == {VIP, VIP6}


def test_bfd_rendered_for_every_peer_when_enabled(tmp_path: Path) -> None:
    off = bird.render_bird(bgp(tmp_path), tmp_path / "vips.conf")
    assert "protocol bfd" not in off and "bfd on" not in off
    cfg = bgp(tmp_path, bfd={"enabled": True, "interval_ms": 100, "multiplier": 5})
    text = bird.render_bird(cfg, tmp_path / "vips.conf")
    assert "protocol bfd hpclb_bfd {" in text
    assert 'interface "*" { interval 100 ms; multiplier 5; };' in text
    assert "multihop { interval 100 ms; multiplier 5; };" in text  # tor2 is multihop
    assert text.count("  bfd on;") == 2
    # BFD before the sessions that use it; each peer's block holds its own.
    assert text.index("protocol bfd") < text.index("protocol bgp bgp_tor1")


@pytest.mark.skipif(shutil.which("bird") is None,
                    reason="BIRD 2 is not installed (Debian package bird2)")
def test_bird_parses_the_coupled_configuration(tmp_path: Path) -> None:
    cfg = bgp(tmp_path, bfd={"enabled": True})
    (tmp_path / "vips.conf").write_text(bird.render_vips(cfg, [VIP, VIP6], "hpclb-alive"))
    (tmp_path / "bird.conf").write_text(bird.render_bird(cfg, tmp_path / "vips.conf"))
    res = subprocess.run(["bird", "-p", "-c", str(tmp_path / "bird.conf")],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


# --- the speaker -----------------------------------------------------------------------------

def test_speaker_routes_follow_the_running_data_planes_interface(tmp_path: Path) -> None:
    """Without BIRD (configure fails and is retried): the files say it."""
    speaker = Speaker(bgp(tmp_path))
    assert speaker.device == "hpclb-alive"
    speaker.announcements.adopt({VIP}, 0.0, 0.0)
    speaker.prepare()
    vips = tmp_path / "vips.conf"
    assert f'route {VIP}/32 via "hpclb-alive";' in vips.read_text()
    speaker.pending = False
    # An adopted data plane started without the option: blackholes, at once.
    speaker.set_device(None)
    assert speaker.pending
    speaker.update(speaker_inputs(), 1.0, 1.0)
    assert f"route {VIP}/32 blackhole;" in vips.read_text()
    assert speaker.report(1.0, 1.0)["alive_interface"] is None
    speaker.pending = False
    speaker.set_device(None)  # unchanged: nothing to tell BIRD
    assert not speaker.pending


def speaker_inputs() -> Inputs:
    return Inputs(None, {VIP: ("web",)}, {"web": 1})


BFD_REPLY = [
    "1020-hpclb_bfd:",
    " IP address                Interface  State      Since         Interval  Timeout",
    " 10.99.0.2                 lbr0       Up         1796320077      0.300    0.900",
    " 10.98.0.2                 ---        Down       1796320070      1.000    0.000",
    "0000 ",
]


def test_bfd_sessions_parsed_and_shown_per_peer(tmp_path: Path) -> None:
    states = bird.parse_bfd(bird.read_reply(iter(line + "\n" for line in BFD_REPLY)))
    assert states == {"10.99.0.2": "Up", "10.98.0.2": "Down"}
    speaker = Speaker(bgp(tmp_path, bfd={"enabled": True}))
    speaker.sessions = [bird.Session("tor1", "up", "Established", 1796320077.0, "10.99.0.2",
                                     65000, "Established", 1),
                        bird.Session("tor2", "start", "Active", 1796320070.0, "10.98.0.3",
                                     65000, "", None)]
    speaker.bfd = states
    report = speaker.report(0.0, 1796320080.0)
    assert report["bfd"] is True
    assert [s["bfd"] for s in report["sessions"]] == ["Up", None]
    # Without BFD the sessions carry no such key.
    plain = Speaker(bgp(tmp_path))
    plain.sessions = speaker.sessions
    assert "bfd" not in plain.report(0.0, 1796320080.0)["sessions"][0]


# --- the data planes' command lines ----------------------------------------------------------

def config_with(bgp_section: dict[str, Any] | None) -> Any:
    doc = {**BASE, **({"bgp": bgp_section} if bgp_section is not None else {})}
    return parse_config(yaml.safe_dump(doc), "hpclb.yaml")


def test_xdp_daemon_gets_the_option_only_with_an_announcing_section() -> None:
    with_bgp = xdp_argv(config_with(BGP))
    assert alive_interface_of(with_bgp) == "hpclb-alive"
    assert with_bgp[-2:] == ["--alive-interface", "hpclb-alive"]
    assert "--alive-interface" not in xdp_argv(config_with(None))
    assert "--alive-interface" not in xdp_argv(config_with({**BGP, "alive_interface": None}))
    named = xdp_argv(config_with({**BGP, "alive_interface": "lb-up"}))
    assert alive_interface_of(named) == "lb-up"


def test_dpdk_forwarder_gets_it_after_the_separator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCLB_DPDK_BIN", shutil.which("true") or "/bin/true")
    doc = {**BASE, "appliance": {**BASE["appliance"], "dataplane": "dpdk",
                                 "dpdk": {"driver": "af_xdp", "lcores": [0, 1]}},
           "bgp": BGP}
    cfg = parse_config(yaml.safe_dump(doc), "hpclb.yaml")
    argv = dataplane_argv(cfg, Choice(Dataplane.DPDK, "configured"))
    assert argv[-2:] == ["--alive-interface", "hpclb-alive"]
    assert argv.index("--alive-interface") > argv.index("--")


def test_running_interface_read_from_the_process_command_line() -> None:
    assert running_alive_interface(None) is None
    assert running_alive_interface(os.getpid()) is None
    # It says when it runs: before its exec, the child's command line is ours.
    proc = subprocess.Popen([sys.executable, "-c",
                             "import sys; print('running', flush=True); sys.stdin.read()",
                             "--alive-interface", "lb-up"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "running\n"
        assert running_alive_interface(proc.pid) == "lb-up"
    finally:
        proc.communicate(timeout=10)  # closes its stdin: it exits
    assert alive_interface_of(["x", "--alive-interface"]) is None


# --- the daemons' checks (where built) -------------------------------------------------------

def built(name: str) -> str | None:
    try:
        return str(install.find(name))
    except (FileNotFoundError, OSError):
        return None


@pytest.mark.skipif(built("hpclb-xdp") is None, reason="hpclb-xdp is not built")
@pytest.mark.parametrize("name", ["", "x" * 16, "a/b", "..", "a b"])
def test_xdp_daemon_refuses_a_bad_name(name: str) -> None:
    binary = built("hpclb-xdp")
    assert binary is not None
    res = subprocess.run([binary, "--iface", "lo", "--alive-interface", name],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2, res.stderr
    assert "--alive-interface must be 1..15 characters" in res.stderr


def test_announced_but_not_exported_raises_an_alarm(tmp_path: Path) -> None:
    """BIRD holds no valid route (the liveness interface missing): the
    session is up, the VIP decided announced, nothing exported."""
    speaker = Speaker(bgp(tmp_path))
    speaker.announcements.adopt({VIP}, 0.0, 0.0)
    speaker.pending = False

    def session(exported: int) -> bird.Session:
        return bird.Session("tor1", "up", "Established", 1.0, "10.99.0.2", 65000, "", exported)

    speaker.sessions = [session(0)]
    assert speaker.alarms(100.0, 100.0) == []  # not for long yet
    alarms = speaker.alarms(100.0 + 10.0, 110.0)
    assert len(alarms) == 1 and "exports none to tor1" in alarms[0]["message"]
    assert "hpclb-alive" in alarms[0]["message"]
    speaker.sessions = [session(1)]  # the interface came back: exported
    assert speaker.alarms(120.0, 120.0) == []
    speaker.sessions = [session(0)]
    assert speaker.alarms(130.0, 130.0) == []  # the clock starts again


@pytest.mark.skipif(built("hpclb-dpdk") is None, reason="hpclb-dpdk is not built")
def test_dpdk_forwarder_refuses_a_bad_name_before_the_eal() -> None:
    binary = built("hpclb-dpdk")
    assert binary is not None
    res = subprocess.run([binary, "-l", "0,1", "--", "--port", "x", "--alive-interface", "a/b"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2, res.stderr
    assert "--alive-interface must be 1..15 characters" in res.stderr
    assert "EAL:" not in res.stderr
