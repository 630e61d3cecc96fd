"""BGP announcements (hpclb.announce): the flap damping, the announce
decision, BIRD's configuration and control socket (against a fake BIRD, and
the rendered configuration parsed by the real `bird -p` where installed), the
`bgp:` section's validation, and what the status and the metrics show."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpclb.announce import bird
from hpclb.announce.damping import Damper
from hpclb.announce.decision import Announcements, Inputs, State
from hpclb.announce.speaker import Speaker, inputs_for
from hpclb.config import ConfigError, parse_config
from hpclb.config.bgp import BgpConfig, DampingConfig, parse_community

# --- damping ---------------------------------------------------------------------------

DAMP = DampingConfig(penalty=1000, suppress=2500, reuse=750, half_life_s=10, max_suppress_s=60)


def test_one_flap_does_not_suppress() -> None:
    d = Damper(DAMP)
    d.withdrawn(0.0)
    assert d.may_announce(0.0)
    assert d.current(10.0) == pytest.approx(500.0)  # one half-life


def test_three_quick_flaps_suppress_until_the_penalty_decays_below_reuse() -> None:
    d = Damper(DAMP)
    for t in (0.0, 1.0, 2.0):
        d.withdrawn(t)
    assert not d.may_announce(2.0)
    release = d.release_in(2.0)
    assert release is not None
    # Still suppressed just before the release time, free just after.
    assert not d.may_announce(2.0 + release - 0.5)
    assert d.may_announce(2.0 + release + 0.5)
    assert d.release_in(2.0 + release + 0.5) is None


def test_suppression_never_outlasts_max_suppress_after_the_last_withdrawal() -> None:
    d = Damper(DAMP)
    for i in range(100):  # a storm: the penalty is capped at the ceiling
        d.withdrawn(i * 0.1)
    assert d.current(9.9) <= DAMP.ceiling + 1e-6
    assert not d.may_announce(9.9 + DAMP.max_suppress_s - 1.0)
    assert d.may_announce(9.9 + DAMP.max_suppress_s + 0.01)


def test_hysteresis_between_reuse_and_suppress() -> None:
    d = Damper(DAMP)
    d.withdrawn(0.0)
    d.withdrawn(0.0)
    assert d.may_announce(0.0)  # 2000 < suppress: not suppressed
    d.withdrawn(0.0)
    assert not d.may_announce(0.0)  # 3000: suppressed
    # 3000 -> 1500 after one half-life: over reuse, so still suppressed.
    assert not d.may_announce(10.0)


def test_damping_disabled_never_suppresses() -> None:
    d = Damper(DAMP.model_copy(update={"enabled": False}))
    for t in range(10):
        d.withdrawn(float(t))
    assert d.may_announce(10.0)


@pytest.mark.parametrize("fields, message", [
    ({"reuse": 3000, "suppress": 2500}, "reuse"),
    ({"max_suppress_s": 5, "half_life_s": 10}, "max_suppress_s"),
    ({"penalty": 0}, "greater than 0"),
])
def test_damping_settings_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DampingConfig(**fields)


# --- the decision -------------------------------------------------------------------------

VIP = "198.18.1.10"
VIP6 = "fd48:4c01::10"


def inputs(up: int = 2, fault: str | None = None, stopping: bool = False,
           pools: dict[str, tuple[str, ...]] | None = None,
           in_service: dict[str, int] | None = None) -> Inputs:
    return Inputs(fault, pools or {VIP: ("web",)}, in_service or {"web": up},
                  stopping=stopping)


def test_announced_while_serving_withdrawn_without_backends_or_data_plane() -> None:
    a = Announcements(DAMP)
    assert a.update(inputs(), 0.0, 0.0)
    assert a.items[VIP].state is State.ANNOUNCED
    assert "2 backend(s) in service in pool web" in a.items[VIP].reason
    assert a.update(inputs(up=0), 1.0, 1.0)
    assert a.items[VIP].state is State.WITHDRAWN
    assert a.items[VIP].reason == "no backend in service in pool web"
    assert a.items[VIP].cause == "no_backend"
    assert a.update(inputs(), 2.0, 2.0)
    assert a.items[VIP].state is State.ANNOUNCED
    assert a.update(inputs(fault="data plane not running"), 3.0, 3.0)
    assert a.items[VIP].state is State.WITHDRAWN
    assert (a.items[VIP].reason, a.items[VIP].cause) == ("data plane not running", "dataplane")
    assert not a.update(inputs(fault="data plane not running"), 4.0, 4.0)  # no change


def test_an_address_of_two_pools_is_announced_while_either_serves() -> None:
    a = Announcements(DAMP)
    pools = {VIP: ("tcp-pool", "udp-pool")}
    a.update(inputs(pools=pools, in_service={"tcp-pool": 0, "udp-pool": 1}), 0.0, 0.0)
    assert a.items[VIP].state is State.ANNOUNCED
    assert "udp-pool" in a.items[VIP].reason and "tcp-pool" not in a.items[VIP].reason
    a.update(inputs(pools=pools, in_service={"tcp-pool": 0, "udp-pool": 0}), 1.0, 1.0)
    assert a.items[VIP].state is State.WITHDRAWN


def test_flapping_is_suppressed_and_comes_back_after_reuse() -> None:
    a = Announcements(DAMP)
    t = 0.0
    for _ in range(3):
        a.update(inputs(), t, t)
        a.update(inputs(up=0), t + 0.1, t + 0.1)
        t += 0.5
    a.update(inputs(), t, t)
    item = a.items[VIP]
    assert item.state is State.SUPPRESSED and item.cause == "damped"
    assert item.reason.startswith("damped: flapped") and "in service" in item.reason
    assert VIP not in a.announced()
    # A withdrawal while suppressed stays immediate and adds nothing (it was
    # not announced).
    penalty = item.damper.current(t) if item.damper else 0.0
    a.update(inputs(up=0), t, t)
    assert a.items[VIP].state is State.WITHDRAWN
    assert item.damper is not None and item.damper.current(t) == pytest.approx(penalty)
    # Serving again, long enough after: announced.
    a.update(inputs(), t + 60.0, t + 60.0)
    assert a.items[VIP].state is State.ANNOUNCED


def test_stopping_withdraws_everything_without_a_penalty() -> None:
    a = Announcements(DAMP)
    a.update(inputs(), 0.0, 0.0)
    assert a.update(inputs(stopping=True), 1.0, 1.0)
    item = a.items[VIP]
    assert item.state is State.WITHDRAWN and item.cause == "stopping"
    assert item.damper is not None and item.damper.current(1.0) == 0.0


def test_adopted_announcements_hold_until_the_first_decision() -> None:
    a = Announcements(DAMP)
    a.adopt([VIP], 0.0, 0.0)
    assert a.announced() == {VIP}
    assert not a.update(inputs(), 1.0, 1.0)  # still announced: nothing to tell BIRD
    assert a.items[VIP].cause == "serving"
    assert a.items[VIP].changes == 0  # no flap across a control-plane restart


def test_a_removed_vip_is_forgotten() -> None:
    a = Announcements(DAMP)
    a.update(Inputs(None, {VIP: ("web",), VIP6: ("web6",)}, {"web": 1, "web6": 1}), 0.0, 0.0)
    assert a.announced() == {VIP, VIP6}
    assert a.update(Inputs(None, {VIP: ("web",)}, {"web": 1}), 1.0, 1.0)
    assert a.announced() == {VIP}


def test_never_announced_addresses() -> None:
    a = Announcements(DAMP)
    a.update(Inputs(None, {VIP: ("web",)}, {"web": 1}, never=frozenset({VIP})), 0.0, 0.0)
    assert a.items[VIP].state is State.WITHDRAWN and a.items[VIP].cause == "disabled"


# --- the `bgp:` section -------------------------------------------------------------------

BASE: dict[str, Any] = {
    "appliance": {"name": "gw", "interfaces": {"ingress": "eth0"},
                  "hash_key": "000102030405060708090a0b0c0d0e0f"},
    "pools": {"web": {"backends": [{"name": "b1", "address": "10.0.0.11"}]},
              "web6": {"backends": [{"name": "b1-v6", "address": "fd00::11"}]}},
    "vips": [{"name": "v", "address": VIP, "port": 80, "protocol": "tcp", "pool": "web"}],
}
BGP: dict[str, Any] = {"local_asn": 65001, "router_id": "10.99.0.1",
                       "peers": [{"name": "tor1", "address": "10.99.0.2", "asn": 65000}]}


def config_with(bgp: dict[str, Any] | None, vips: list[dict[str, Any]] | None = None) -> Any:
    doc = {**BASE, **({"bgp": bgp} if bgp is not None else {})}
    if vips is not None:
        doc["vips"] = vips
    return parse_config(yaml.safe_dump(doc), "hpclb.yaml")


def test_no_bgp_section_means_no_announcements() -> None:
    assert config_with(None).bgp is None


def test_a_full_section_is_read() -> None:
    cfg = config_with({**BGP, "communities": ["65000:100", "no-export", "65000:1:2"],
                       "med": 10, "next_hop": "10.99.0.1",
                       "vips": {VIP: {"med": 20, "communities": ["65000:200"]}},
                       "damping": {"half_life_s": 5, "max_suppress_s": 30}}).bgp
    assert cfg is not None
    assert cfg.attributes(VIP) == (20, ["65000:200"])
    assert cfg.attributes("198.18.1.11") == (10, ["65000:100", "no-export", "65000:1:2"])
    assert cfg.damping.half_life_s == 5


@pytest.mark.parametrize("bgp, where, message", [
    ({**BGP, "local_asn": 0}, "bgp.local_asn", "greater than or equal to 1"),
    ({**BGP, "router_id": "fd00::1"}, "bgp.router_id", "IPv4 address"),
    ({**BGP, "peers": []}, "bgp.peers", "at least 1"),
    ({**BGP, "peers": [{"name": "tor-1", "address": "10.99.0.2", "asn": 65000}]},
     "bgp.peers[0].name", "pattern"),
    ({**BGP, "peers": [{"name": "t", "address": "10.99.0.300", "asn": 65000}]},
     "bgp.peers[0].address", "not a valid IPv4 or IPv6 address"),
    ({**BGP, "peers": [BGP["peers"][0], BGP["peers"][0]]}, "bgp.peers[1]", "already used"),
    ({**BGP, "communities": ["65000:70000"]}, "bgp.communities[0]", "16-bit"),
    ({**BGP, "communities": ["bogus"]}, "bgp.communities[0]", "ASN:VALUE"),
    ({**BGP, "med": -1}, "bgp.med", "greater than or equal to 0"),
    ({**BGP, "vips": {"198.18.9.9": {"med": 1}}}, "bgp.vips.198.18.9.9",
     "not the address of any VIP"),
    ({**BGP, "vips": {"web": {"med": 1}}}, "bgp.vips", "not a VIP address"),
    ({**BGP, "damping": {"reuse": 3000}}, "bgp.damping", "reuse"),
    ({**BGP, "bogus": 1}, "bgp.bogus", "unknown key"),
])
def test_refused_with_a_clear_error(bgp: dict[str, Any], where: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_with(bgp)
    text = str(err.value)
    assert where in text and message in text, text


def test_ipv6_vips_over_an_ipv4_session_need_next_hop6() -> None:
    vips = [*BASE["vips"], {"name": "v6", "address": VIP6, "port": 80, "protocol": "tcp",
                            "pool": "web6"}]
    with pytest.raises(ConfigError, match=r"set bgp\.next_hop6"):
        config_with(BGP, vips)
    assert config_with({**BGP, "next_hop6": "fd00::1"}, vips).bgp is not None
    # Or the IPv6 VIP is never announced.
    assert config_with({**BGP, "vips": {VIP6: {"announce": False}}}, vips).bgp is not None


def test_communities_parsed() -> None:
    assert parse_community("65000:100") == (65000, 100)
    assert parse_community("NO-EXPORT") == (65535, 65281)
    assert parse_community("4200000000:1:2") == (4200000000, 1, 2)


# --- BIRD's configuration ---------------------------------------------------------------------

def bgp_config(tmp_path: Path, **extra: Any) -> BgpConfig:
    return BgpConfig.model_validate({
        **BGP, "config_dir": str(tmp_path), "control_socket": str(tmp_path / "bird.ctl"),
        "communities": ["65000:100", "65000:1:2"], "med": 7, "next_hop6": "fd00::1",
        "vips": {VIP6: {"med": 9, "communities": ["no-export"]}}, **extra})


def test_render_vips_carries_med_and_communities(tmp_path: Path) -> None:
    text = bird.render_vips(bgp_config(tmp_path), [VIP6, VIP])
    assert f"route {VIP}/32 blackhole;" in text and f"route {VIP6}/128 blackhole;" in text
    assert (f"if net = {VIP}/32 then {{ bgp_med = 7; bgp_community.add((65000,100)); "
            "bgp_large_community.add((65000,1,2)); accept; }") in text
    assert (f"if net = {VIP6}/128 then {{ bgp_med = 9; "
            "bgp_community.add((65535,65281)); accept; }") in text
    assert bird.parse_vips(text) == {VIP, VIP6}
    assert bird.parse_vips(bird.render_vips(bgp_config(tmp_path), [])) == set()


def test_render_bird(tmp_path: Path) -> None:
    cfg = bgp_config(tmp_path, peers=[{"name": "tor1", "address": "10.99.0.2", "asn": 65000,
                                       "hold_time_s": 9, "multihop": 2,
                                       "source_address": "10.99.0.1"}])
    text = bird.render_bird(cfg, tmp_path / "vips.conf")
    assert "router id 10.99.0.1;" in text
    assert f'include "{tmp_path}/vips.conf";' in text
    assert "protocol bgp bgp_tor1 {" in text
    assert "local 10.99.0.1 as 65001;" in text
    assert "neighbor 10.99.0.2 port 179 as 65000;" in text
    assert "hold time 9;" in text and "multihop 2;" in text
    assert "import none; export filter hpclb_export;" in text
    assert "next hop address fd00::1;" in text


@pytest.mark.skipif(shutil.which("bird") is None,
                    reason="BIRD 2 is not installed (Debian package bird2)")
def test_bird_parses_what_is_rendered(tmp_path: Path) -> None:
    cfg = bgp_config(tmp_path)
    (tmp_path / "vips.conf").write_text(bird.render_vips(cfg, [VIP, VIP6]))
    (tmp_path / "bird.conf").write_text(bird.render_bird(cfg, tmp_path / "vips.conf"))
    res = subprocess.run(["bird", "-p", "-c", str(tmp_path / "bird.conf")],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


# --- the control socket, against a fake BIRD ----------------------------------------------------

PROTOCOLS = "".join(line + "\n" for line in [
    '2002-Name       Proto      Table      State  Since         Info',
    '1002-device1    Device     ---        up     1796320073    ',
    '1006-',
    '1002-hpclb_vips4 Static     master4    up     1796320073    ',
    '1006-  Channel ipv4',
    '     State:          UP',
    '     Routes:         1 imported, 0 exported, 1 preferred',
    '1002-bgp_tor1   BGP        ---        up     1796320077    Established   ',
    '1006-  BGP state:          Established',
    '     Neighbor address: 10.99.0.2',
    '     Neighbor AS:      65000',
    '   Channel ipv4',
    '     Routes:         0 imported, 1 exported, 0 preferred',
    '1002-bgp_tor2   BGP        ---        start  1796320073    Active        '
    'Socket: Connection refused',
    '1006-  BGP state:          Active',
    '     Neighbor address: 10.99.0.3',
    '     Neighbor AS:      65002',
    '0000 ',
])


class FakeBird:
    """A Unix socket speaking BIRD's CLI protocol: answers `configure` (or
    refuses it), `show protocols all` and `show status`, and records commands."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.commands: list[str] = []
        self.refuse_configure = False
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rw", encoding="utf-8", newline="\n") as f:
                f.write("0001 BIRD 2.0.12 ready.\n")
                f.flush()
                cmd = f.readline().strip()
                self.commands.append(cmd)
                if cmd == "configure":
                    f.write("8002 vips.conf, line 3: syntax error\n" if self.refuse_configure
                            else "0002-Reading configuration from bird.conf\n0003 Reconfigured\n")
                elif cmd == "show protocols all":
                    f.write(PROTOCOLS)
                else:
                    f.write("0000 \n")
                f.flush()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fake_bird(tmp_path: Path) -> Iterator[FakeBird]:
    fake = FakeBird(tmp_path / "bird.ctl")
    try:
        yield fake
    finally:
        fake.close()


def test_sessions_read_from_show_protocols(fake_bird: FakeBird) -> None:
    sessions = bird.show_protocols(fake_bird.path)
    assert [(s.name, s.bgp_state, s.neighbor, s.neighbor_as) for s in sessions] == [
        ("tor1", "Established", "10.99.0.2", 65000), ("tor2", "Active", "10.99.0.3", 65002)]
    up = sessions[0].report(1796320077.0 + 42)
    assert up["established"] and up["uptime_s"] == 42.0 and up["routes_exported"] == 1
    down = sessions[1].report(1796320100.0)
    assert not down["established"] and down["uptime_s"] is None
    assert "Connection refused" in str(down["info"])


def test_errors_are_bird_errors(fake_bird: FakeBird, tmp_path: Path) -> None:
    fake_bird.refuse_configure = True
    with pytest.raises(bird.BirdError, match="syntax error"):
        bird.configure(fake_bird.path)
    with pytest.raises(bird.BirdError, match="control socket"):
        bird.command(tmp_path / "nobody.ctl", "show status")


def serving(up: int = 1, fault: str | None = None) -> Inputs:
    return Inputs(fault, {VIP: ("web",)}, {"web": up})


def test_speaker_tells_bird_only_when_the_announced_set_changes(
        fake_bird: FakeBird, tmp_path: Path) -> None:
    speaker = Speaker(bgp_config(tmp_path))
    speaker.prepare()
    assert bird.parse_vips((tmp_path / "vips.conf").read_text()) == set()
    speaker.update(serving(), 0.0, 0.0)
    assert bird.parse_vips((tmp_path / "vips.conf").read_text()) == {VIP}
    assert fake_bird.commands.count("configure") == 1
    speaker.update(serving(up=2), 0.3, 0.3)  # same set: BIRD not bothered
    assert fake_bird.commands.count("configure") == 1
    speaker.update(serving(up=0), 0.6, 0.6)
    assert bird.parse_vips((tmp_path / "vips.conf").read_text()) == set()
    assert fake_bird.commands.count("configure") == 2
    report = speaker.report(0.6, 0.6)
    assert report["reachable"] and report["sessions"][0]["name"] == "tor1"
    assert report["announcements"][0]["state"] == "withdrawn"


def test_speaker_retries_a_refused_configure(fake_bird: FakeBird, tmp_path: Path) -> None:
    speaker = Speaker(bgp_config(tmp_path))
    speaker.prepare()
    fake_bird.refuse_configure = True
    speaker.update(serving(), 0.0, 0.0)
    assert speaker.pending and speaker.error and "syntax error" in speaker.error
    assert not speaker.report(0.0, 0.0)["reachable"]
    fake_bird.refuse_configure = False
    speaker.update(serving(), 0.5, 0.5)  # within the retry interval: not yet
    assert speaker.pending
    speaker.update(serving(), 2.5, 2.5)
    assert not speaker.pending and speaker.error is None


def test_a_bird_that_never_answers_does_not_stall_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It accepts the connection and says nothing: the speaker gives up after
    its timeout, reports the fault and retries later."""
    import hpclb.announce.speaker as speaker_module

    monkeypatch.setattr(speaker_module, "CONFIGURE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(speaker_module, "SHOW_TIMEOUT_S", 0.2)
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(tmp_path / "bird.ctl"))
    mute.listen(8)
    try:
        speaker = Speaker(bgp_config(tmp_path))
        speaker.prepare()
        speaker.update(serving(), 0.0, 0.0)
        assert speaker.pending and speaker.error is not None
        assert "timed out" in speaker.error  # gave up by its timeout
        assert bird.parse_vips((tmp_path / "vips.conf").read_text()) == {VIP}
    finally:
        mute.close()


def test_an_unwritable_directory_is_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    cfg = bgp_config(tmp_path, config_dir=str(tmp_path / "file" / "bird"))
    speaker = Speaker(cfg)
    with pytest.raises(OSError):
        speaker.prepare()  # the controller logs it once
    speaker.update(serving(), 0.0, 0.0)  # the loop goes on
    assert speaker.pending and speaker.error is not None
    assert speaker.error.startswith(f"cannot write {tmp_path / 'file' / 'bird'}")


def test_a_restart_adopts_what_the_speaker_announces(fake_bird: FakeBird, tmp_path: Path) -> None:
    first = Speaker(bgp_config(tmp_path))
    first.prepare()
    first.update(serving(), 0.0, 0.0)
    # kill -9 of the control plane: the next one finds vips.conf as it was.
    second = Speaker(bgp_config(tmp_path))
    second.prepare()
    assert second.announcements.announced() == {VIP}
    assert bird.parse_vips((tmp_path / "vips.conf").read_text()) == {VIP}
    before = fake_bird.commands.count("configure")
    second.update(serving(), 10.0, 10.0)
    assert fake_bird.commands.count("configure") == before + 1  # the first turn tells BIRD
    assert second.announcements.items[VIP].changes == 0


def test_withdraw_all_on_stop(fake_bird: FakeBird, tmp_path: Path) -> None:
    speaker = Speaker(bgp_config(tmp_path, withdraw_wait_s=0))
    speaker.prepare()
    speaker.update(serving(), 0.0, 0.0)
    speaker.withdraw_all(serving())
    assert bird.parse_vips((tmp_path / "vips.conf").read_text()) == set()
    assert not speaker.pending
    assert speaker.announcements.items[VIP].cause == "stopping"


def test_a_reload_rewrites_bird_conf_only_when_it_changes(
        fake_bird: FakeBird, tmp_path: Path) -> None:
    speaker = Speaker(bgp_config(tmp_path))
    speaker.prepare()
    speaker.update(serving(), 0.0, 0.0)
    assert not speaker.pending
    speaker.reconfigure(bgp_config(tmp_path))
    assert not speaker.pending
    speaker.reconfigure(bgp_config(tmp_path, med=99))
    assert speaker.pending and "bgp_med = 99" in (tmp_path / "vips.conf").read_text()


def test_inputs_for_marks_never_announced(tmp_path: Path) -> None:
    cfg = bgp_config(tmp_path, vips={VIP: {"announce": False}})
    got = inputs_for({VIP: ("web",), "198.18.1.11": ("web",)}, {"web": 1}, None, cfg)
    assert got.never == frozenset({VIP})


# --- the faces: status and metrics ------------------------------------------------------

def bgp_status() -> dict[str, Any]:
    return {"reachable": True, "error": None,
            "sessions": [{"name": "tor1", "peer": "10.99.0.2", "asn": 65000,
                          "state": "Established", "established": True, "uptime_s": 125.0},
                         {"name": "tor2", "peer": "10.99.0.3", "asn": 65002,
                          "state": "Active", "established": False, "uptime_s": None}],
            "announcements": [{"address": VIP, "state": "announced", "cause": "serving",
                               "reason": "2 backend(s) in service in pool web", "penalty": 0.0},
                              {"address": VIP6, "state": "suppressed", "cause": "damped",
                               "reason": "damped: flapped", "penalty": 1800.0}]}


def test_metrics_show_sessions_and_announcements() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from hpclb.faces.metrics import StatusCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: {"bgp": bgp_status()}))
    text = generate_latest(registry).decode()
    assert 'hpclb_bgp_session_up{address="10.99.0.2",peer="tor1",state="Established"} 1.0' in text
    assert 'hpclb_bgp_session_up{address="10.99.0.3",peer="tor2",state="Active"} 0.0' in text
    assert 'hpclb_bgp_session_uptime_seconds{address="10.99.0.2",peer="tor1"} 125.0' in text
    assert (f'hpclb_bgp_announcement{{address="{VIP}",cause="serving",state="announced"}} 1.0'
            in text)
    assert (f'hpclb_bgp_announcement{{address="{VIP6}",cause="damped",state="suppressed"}} 1.0'
            in text)
    assert f'hpclb_bgp_damping_penalty{{address="{VIP6}"}} 1800.0' in text
    assert "hpclb_bgp_speaker_up 1.0" in text


def test_status_shows_sessions_and_announcements() -> None:
    from rich.console import Console

    from hpclb.faces.render import bgp_rows, render_status

    console = Console(width=200, record=True)
    console.print(render_status({"appliance": "gw", "bgp": bgp_status()}))
    text = console.export_text()
    assert "tor1 10.99.0.2 AS65000: Established for 2m05s" in text
    assert "tor2 10.99.0.3 AS65002: Active" in text
    assert f"{VIP}: announced (2 backend(s) in service in pool web)" in text
    assert f"{VIP6}: suppressed (damped: flapped)" in text
    assert bgp_rows(None) == []


def test_the_api_status_carries_bgp() -> None:
    from hpclb.faces.api.views import status_view

    config = config_with(BGP)
    view = status_view(config, {"bgp": bgp_status()}, "rev")
    assert view.bgp == bgp_status()
    assert view.model_dump()["bgp"]["sessions"][0]["name"] == "tor1"
    assert status_view(config_with(None), {}, "rev").bgp is None


def test_lasting_faults_become_alarms(fake_bird: FakeBird, tmp_path: Path) -> None:
    speaker = Speaker(bgp_config(tmp_path))
    speaker.prepare()
    fake_bird.refuse_configure = True
    speaker.update(serving(), 0.0, 0.0)
    # tor2 has been Active since 1796320073 (PROTOCOLS): 27 s at this wall time.
    wall = 1796320100.0
    assert [a["message"] for a in speaker.alarms(0.0, wall)] == [
        "BGP session tor2 (10.99.0.3) Active for 27s"]  # the refusal is too recent
    assert speaker.alarms(10.0, wall)[0] == {
        "source": "bgp",
        "message": "BGP speaker: BIRD refused 'configure': vips.conf, line 3: syntax error"}
    fake_bird.refuse_configure = False
    speaker.update(serving(), 12.0, wall)
    assert all("BGP speaker" not in a["message"] for a in speaker.alarms(12.0, wall))
