"""Lab: BGP announcements of the VIPs by `hpclb run` through BIRD 2.

The one-LAN lab in dual stack (client, appliance, two backends serving TCP,
an IPv4 and an IPv6 VIP) plus a router namespace joined to the appliance's
by its own link (10.99.0.0/30, fd99::/64). The router runs BIRD 2 with
kernel protocols (`merge paths on`: ECMP when a fleet announces), importing
what its BGP peer announces; the appliance runs BIRD 2 as its speaker,
unprivileged, started once `hpclb run` wrote its bird.conf (as the
proposed hpclb-bird.path unit does), and `hpclb run` with a `bgp:` section
and a TCP probe. The VIP's /32 (and the IPv6 VIP's /128, announced over the
IPv4 session with an IPv6 next hop) must be in the router's kernel table
while a backend is up, leave it when every backend is down, come back,
leave it when the data plane dies (kill -9) and come back once it is
restarted, stay across a kill -9 of `hpclb run` (the data plane forwards,
the speaker keeps announcing) and its restart, leave it when `hpclb run` and
the data plane are both killed -9 while the speaker lives (the data plane's
liveness interface leaves with it: BIRD withdraws by itself) and come back on
the restart, leave it when the appliance stops (before its data plane
stops) and come back when it starts; the session stays up throughout
(reconfigurations are graceful); last, leave it when the link goes silent
(BFD, 300 ms x 3 on both sides, drops the session). Convergence times are
printed (and written to $HPCLB_BGP_FIGURES when set), never asserted.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LAB_VIP6, LabAppliance
from hpclb.lab.topology import Lab, default_pass_obj

from .polling import Watcher, held_at

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="lab tests need root (network namespaces, veth, XDP)"),
    pytest.mark.skipif(shutil.which("bird") is None,
                       reason="BIRD 2 is not installed (Debian package bird2)"),
]

APPLIANCE_ADDR, ROUTER_ADDR = "10.99.0.1", "10.99.0.2"
# The IPv6 VIP goes over the IPv4 session with this next hop (bgp.next_hop6).
APPLIANCE_ADDR6, ROUTER_ADDR6 = "fd99::1", "fd99::2"
ROUTE4, ROUTE6 = f"{LAB_VIP}/32", f"{LAB_VIP6}/128"
APPLIANCE_AS, ROUTER_AS = 65001, 65000
# BFD on both sides of the session (bgp.bfd): a silent link drops it in
# about BFD_MS x BFD_MULT instead of the hold time (9 s). Not tighter: 100 ms
# x 3 dropped the session once in about 20 runs on a shared 2-CPU box (a
# starved BFD thread), and BIRD then waits 60 s (error wait time) to connect.
BFD_MS, BFD_MULT = 300, 3
ALIVE = "hpclb-alive"  # bgp.alive_interface's default
PROBE: dict[str, Any] = {"kind": "tcp", "port": LAB_PORT, "interval_s": 0.5, "timeout_s": 0.5,
                         "rise": 2, "fall": 2, "damping": {"enabled": False}}
ROUTER_CONF = f"""\
router id {ROUTER_ADDR};
protocol device {{ scan time 2; }}
protocol kernel {{ ipv4 {{ import none; export all; }}; merge paths on; }}
protocol kernel {{ ipv6 {{ import none; export all; }}; merge paths on; }}
protocol bfd {{ interface "*" {{ interval {BFD_MS} ms; multiplier {BFD_MULT}; }}; }}
protocol bgp appliance1 {{
  local {ROUTER_ADDR} as {ROUTER_AS};
  neighbor {APPLIANCE_ADDR} as {APPLIANCE_AS};
  bfd on;
  hold time 9;
  connect delay time 1;
  connect retry time 2;
  ipv4 {{ import all; export none; }};
  ipv6 {{ import all; export none; }};
}}
"""
POLL_S = 0.02


class BgpAppliance(LabAppliance):
    """The lab appliance with a `bgp:` section peering with the router; the
    speaker's files in ``bird_dir``."""

    speaker_started = 0.0  # when the appliance's BIRD was started (monotonic)
    keep_dataplane = False  # `hpclb run --keep-dataplane`

    def _run_argv(self) -> list[str]:
        return [*super()._run_argv(), *(["--keep-dataplane"] if self.keep_dataplane else [])]

    def __init__(self, *args: Any, bird_dir: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bird_dir = bird_dir

    def config(self) -> dict[str, Any]:
        config = super().config()
        config["appliance"]["checkpoint_interval_s"] = 1.0
        config["bgp"] = {
            "local_asn": APPLIANCE_AS, "router_id": APPLIANCE_ADDR,
            "peers": [{"name": "router", "address": ROUTER_ADDR, "asn": ROUTER_AS,
                       "hold_time_s": 9}],
            "communities": [f"{APPLIANCE_AS}:10"], "med": 10,
            "next_hop6": APPLIANCE_ADDR6, "vips": {LAB_VIP6: {"med": 20}},
            "config_dir": str(self.bird_dir),
            "control_socket": str(self.bird_dir / "bird.ctl"),
            "withdraw_wait_s": 1.0,
            "bfd": {"enabled": True, "interval_ms": BFD_MS, "multiplier": BFD_MULT},
        }
        return config


@dataclass
class Router:
    lab: Lab
    ns: str
    socket: Path

    def route(self, prefix: str = ROUTE4) -> str:
        """The router's kernel route to ``prefix`` ("" when it has none)."""
        family = "-6" if ":" in prefix else "-4"
        res = subprocess.run(["ip", family, "-n", self.ns, "route", "show", "exact", prefix],
                             capture_output=True, text=True, timeout=10, check=True)
        return res.stdout.strip()

    def birdc(self, *args: str) -> str:
        return subprocess.run(["birdc", "-s", str(self.socket), *args],
                              capture_output=True, text=True, timeout=10).stdout

    def bird_route(self, prefix: str = ROUTE4) -> str:
        res = subprocess.run(["birdc", "-s", str(self.socket), "show", "route", "all", prefix],
                             capture_output=True, text=True, timeout=10)
        return res.stdout


def wait_for(what: str, predicate: Callable[[], bool], timeout_s: float,
             explain: Callable[[], str] | None = None) -> float:
    """Poll until ``predicate()``; returns when it first held (monotonic)."""
    return held_at(what, predicate, timeout_s, POLL_S, explain)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(prefix=f"g{uuid.uuid4().hex[:6]}", backends=2, ipv6=True,
             peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT)
        yield lab


@pytest.fixture(scope="module")
def router(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """The router namespace, its link to the appliance's, and its BIRD."""
    workdir = tmp_path_factory.mktemp("router")
    ns = f"{lab.prefix}-rtr"
    r_if, a_if = f"{lab.prefix}r", f"{lab.prefix}a"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
    try:
        cmds = [["ip", "link", "add", r_if, "netns", ns, "type", "veth", "peer", "name", a_if,
                 "netns", lab.lb_ns],
                ["ip", "-n", ns, "addr", "add", f"{ROUTER_ADDR}/30", "dev", r_if],
                ["ip", "-n", lab.lb_ns, "addr", "add", f"{APPLIANCE_ADDR}/30", "dev", a_if],
                ["ip", "-n", ns, "addr", "add", f"{ROUTER_ADDR6}/64", "dev", r_if, "nodad"],
                ["ip", "-n", lab.lb_ns, "addr", "add", f"{APPLIANCE_ADDR6}/64", "dev", a_if,
                 "nodad"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "link", "set", r_if, "up"],
                ["ip", "-n", lab.lb_ns, "link", "set", a_if, "up"]]
        for cmd in cmds:
            subprocess.run(cmd, check=True, timeout=10)
        conf, sock = workdir / "bird.conf", workdir / "bird.ctl"
        conf.write_text(ROUTER_CONF)
        proc = lab.popen(ns, ["bird", "-f", "-c", str(conf), "-s", str(sock)],
                         stdout=subprocess.DEVNULL, stderr=open(workdir / "bird.log", "w"))
        try:
            wait_for("router BIRD socket", sock.exists, 10)
            yield Router(lab, ns, sock)
        finally:
            lab.stop_process(proc)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, timeout=10)


def speaker_user() -> tuple[str, int] | None:
    """The unprivileged user the appliance's BIRD runs as (Debian's bird2
    creates `bird`), with its group id; None where there is none."""
    try:
        entry = pwd.getpwnam("bird")
    except KeyError:
        return None
    return entry.pw_name, entry.pw_gid


# The speaker's capabilities: port 179, and for BFD (whose sockets BIRD
# gives SO_PRIORITY 7, refused without CAP_NET_RAW on this kernel, or
# CAP_NET_ADMIN on older ones) CAP_NET_RAW.
SPEAKER_CAPS = "+net_bind_service,+net_raw"


def speaker_argv(bird_dir: Path) -> list[str]:
    """BIRD as the proposed hpclb-bird.service runs it: as user bird, with
    only CAP_NET_BIND_SERVICE (port 179), CAP_NET_RAW (BFD) and no new
    privileges."""
    argv = ["bird", "-f", "-c", str(bird_dir / "bird.conf"), "-s", str(bird_dir / "bird.ctl")]
    user = speaker_user()
    if user is None:
        print("no `bird` user: the appliance's BIRD runs as root in this lab")
        return argv
    return ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--init-groups",
            f"--inh-caps=-all,{SPEAKER_CAPS}", f"--ambient-caps=-all,{SPEAKER_CAPS}",
            f"--bounding-set=-all,{SPEAKER_CAPS}", "--no-new-privs", *argv]


@pytest.fixture(scope="module")
def appliance(lab: Lab, router: Router,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[BgpAppliance]:
    """`hpclb run` with the `bgp:` section, and the appliance's BIRD, run
    unprivileged, started once bird.conf exists (the proposed
    hpclb-bird.path's doing). The speaker's directory is shared with its
    group, as /run/hpclb/bird would be (pytest's own directories are 0700)."""
    workdir = tmp_path_factory.mktemp("bgp")
    bird_dir = Path(tempfile.mkdtemp(prefix="hpclb-bgp-"))
    try:
        user = speaker_user()
        if user is not None:
            os.chown(bird_dir, 0, user[1])
            bird_dir.chmod(0o770)
        app = BgpAppliance(lab, workdir, {"b1": 1.0, "b2": 1.0}, dataplane="xdp",
                           vips=(LAB_VIP, LAB_VIP6),
                           probe=PROBE, bird_dir=bird_dir)
        with app:
            wait_for("bird.conf written by hpclb run", (bird_dir / "bird.conf").exists, 10)
            started = time.monotonic()
            with open(workdir / "speaker.log", "w") as log:
                speaker = lab.popen(lab.lb_ns, speaker_argv(bird_dir),
                                    stdout=subprocess.DEVNULL, stderr=log)
            try:
                app.speaker_started = started
                if user is not None:  # unprivileged indeed
                    wait_for("the speaker's socket", (bird_dir / "bird.ctl").exists, 10)
                    assert Path(f"/proc/{speaker.pid}").stat().st_uid == \
                        pwd.getpwnam(user[0]).pw_uid
                yield app
            finally:
                app.stop()  # while the speaker runs: the withdrawal on stop reaches it
                lab.stop_process(speaker)
    finally:
        shutil.rmtree(bird_dir, ignore_errors=True)


def explain(router: Router, app: LabAppliance) -> Callable[[], str]:
    """What to read when the route does not do what it should."""
    def text() -> str:
        protocols = subprocess.run(["birdc", "-s", str(router.socket), "show", "protocols"],
                                   capture_output=True, text=True, timeout=10).stdout
        speaker = app.workdir / "speaker.log"
        return (f"router: {protocols}\nspeaker log: "
                f"{speaker.read_text()[-2000:] if speaker.exists() else '(none)'}\n"
                f"hpclb run: {app.log_text()}")
    return text


def alive_interface(lab: Lab) -> bool:
    """Whether the liveness interface exists in the appliance's namespace."""
    return subprocess.run(["ip", "-n", lab.lb_ns, "link", "show", ALIVE], capture_output=True,
                          timeout=10).returncode == 0


def announcement(status: dict[str, Any], vip: str = LAB_VIP) -> dict[str, Any]:
    bgp = status.get("bgp") or {}
    found = [a for a in bgp.get("announcements", []) if a["address"] == vip]
    return found[0] if found else {}


def wall_to_mono(wall: float) -> float:
    return time.monotonic() - (time.time() - wall)


class RouteWatch(Watcher):
    """Polls the router's route in a thread: whether it ever went missing."""

    def __init__(self, router: Router) -> None:
        super().__init__(POLL_S)
        self.router = router
        self.missing_at: float | None = None

    def look(self) -> None:
        if not self.router.route() and self.missing_at is None:
            self.missing_at = time.monotonic()


def test_vip_announced_while_served(lab: Lab, router: Router, appliance: BgpAppliance) -> None:
    figures: dict[str, float] = {}
    started = appliance.speaker_started

    # 1. Backends up: the routes appear (the /32 and the /128, the latter over
    # the IPv4 session with its IPv6 next hop), with the configured MED and
    # community; the status shows the session and why.
    shown = wait_for("VIP route in the router", lambda: bool(router.route()), 30,
                     explain(router, appliance))
    figures["first_announcement_s"] = shown - started
    wait_for("IPv6 VIP route in the router", lambda: bool(router.route(ROUTE6)), 10,
             explain(router, appliance))
    assert f"via {APPLIANCE_ADDR}" in router.route()
    assert f"via {APPLIANCE_ADDR6}" in router.route(ROUTE6)
    detail = router.bird_route()
    assert "BGP.med: 10" in detail and f"({APPLIANCE_AS},10)" in detail, detail
    assert "BGP.med: 20" in router.bird_route(ROUTE6)  # its own, from bgp.vips
    status = appliance.wait_status(
        lambda s: any(x.get("established") for x in (s.get("bgp") or {}).get("sessions", []))
        and announcement(s).get("state") == "announced", 15, "session up, VIP announced")
    session = status["bgp"]["sessions"][0]
    assert (session["name"], session["peer"], session["asn"]) == ("router", ROUTER_ADDR,
                                                                  ROUTER_AS)
    assert session["uptime_s"] is not None and session["uptime_s"] >= 0
    assert "backend(s) in service in pool lab" in announcement(status)["reason"]
    # Each route goes through the data plane's liveness interface, which the
    # data plane holds in the appliance's namespace (the speaker's); BFD is
    # up on both sides.
    assert f'route {ROUTE4} via "{ALIVE}";' in (appliance.bird_dir / "vips.conf").read_text()
    assert alive_interface(lab), "the data plane holds no liveness interface"
    status = appliance.wait_status(
        lambda s: ((s.get("bgp") or {}).get("sessions") or [{}])[0].get("bfd") == "Up", 10,
        "BFD session up")
    assert status["bgp"]["alive_interface"] == ALIVE
    wait_for("the router's BFD session up",
             lambda: " Up " in router.birdc("show", "bfd", "sessions"), 10)

    # 2. Every backend of the pool down (their servers stopped: the probes
    # fail): withdrawn; the status says why.
    stopped = time.monotonic()
    for i in (1, 2):
        lab.stop_backend(i)
    gone = wait_for("route withdrawn after the backends died", lambda: not router.route(), 30)
    wait_for("IPv6 route withdrawn", lambda: not router.route(ROUTE6), 10)
    status = appliance.wait_status(lambda s: announcement(s).get("state") == "withdrawn", 10,
                                   "VIP withdrawn")
    assert announcement(status)["cause"] == "no_backend", announcement(status)
    decided = wall_to_mono(float(announcement(status)["since"]))
    figures["backends_down_to_route_gone_s"] = gone - stopped
    figures["withdraw_decision_to_route_gone_s"] = gone - decided

    # 3. A backend back: announced again.
    restarted = time.monotonic()
    lab.start_backend(1, LAB_PORT)
    back = wait_for("route back after a backend came back", lambda: bool(router.route()), 30)
    wait_for("IPv6 route back", lambda: bool(router.route(ROUTE6)), 10)
    status = appliance.wait_status(lambda s: announcement(s).get("state") == "announced", 10,
                                   "VIP announced again")
    decided = wall_to_mono(float(announcement(status)["since"]))
    figures["backend_up_to_route_back_s"] = back - restarted
    figures["announce_decision_to_route_back_s"] = back - decided
    lab.start_backend(2, LAB_PORT)
    # `birdc configure` with a new vips.conf is graceful: the session stayed up.
    assert status["bgp"]["sessions"][0]["since"] == session["since"], status["bgp"]

    # 4. The data plane dies (kill -9): withdrawn before it is restarted, back
    # once the restarted one holds its tables.
    appliance.wait_status(lambda s: all(h["up"] for h in s["health"].values()), 10,
                          "every backend up")
    with RouteWatch(router) as watch:
        killed = time.monotonic()
        os.kill(appliance.dataplane_pid(), signal.SIGKILL)
        wait_for("route withdrawn after the data plane died",
                 lambda: watch.missing_at is not None, 10, explain(router, appliance))
        back = wait_for("route back after the data plane restarted",
                        lambda: bool(router.route()), 30, explain(router, appliance))
    assert watch.missing_at is not None
    figures["dataplane_killed_to_route_gone_s"] = watch.missing_at - killed
    figures["dataplane_killed_to_route_back_s"] = back - killed
    assert "withdrawn: data plane not running" in appliance.log_text_full()

    # 5. kill -9 of `hpclb run`, then a stop with --keep-dataplane: each
    # time the data plane forwards on and the speaker keeps announcing; the
    # restarted control plane adopts the announcement: the route never leaves
    # the router. Killed once every backend is up and the state checkpoint
    # (every second) holds it, as a restart needs.
    appliance.wait_status(lambda s: all(h["up"] for h in s["health"].values()), 10,
                          "every backend up")
    time.sleep(2.0)
    with RouteWatch(router) as watch:
        for how in ("kill -9", "--keep-dataplane"):
            if how == "kill -9":
                appliance.kill()
            else:
                assert appliance.proc is not None
                appliance.proc.send_signal(signal.SIGTERM)
                appliance.proc.wait(30)
                appliance.proc = None
                assert Path(f"/proc/{appliance.dataplane_pid()}").exists()
            time.sleep(2.0)  # the route must outlive the control plane, not just its exit
            # Started with --keep-dataplane after the kill, so that the next
            # stop (SIGTERM) leaves the data plane; then as usual again.
            appliance.keep_dataplane = how == "kill -9"
            resumed = time.time()
            appliance.resume()
            appliance.wait_status(lambda s: s.get("time", 0) > resumed  # noqa: B023
                                  and announcement(s).get("state") == "announced"
                                  and announcement(s).get("cause") == "serving", 15,
                                  f"VIP announced by the control plane restarted after {how}")
        time.sleep(1.0)
    assert watch.missing_at is None, "the route left the router across a control-plane restart"
    log = appliance.log_text_full()
    assert log.count(f"the speaker announces {LAB_VIP}, {LAB_VIP6} from before this start") \
        == 2, log
    assert "bgp: announcements left to the speaker" in log

    # 6. kill -9 of `hpclb run` and of the data plane, the speaker alive:
    # nobody withdraws, but the liveness interface leaves with the data
    # plane and BIRD, told over netlink, withdraws by itself (vips.conf still
    # lists the VIPs). `hpclb run` is killed first, so that it cannot withdraw
    # on seeing the data plane die. Then the restart brings the routes back.
    appliance.wait_status(lambda s: all(h["up"] for h in s["health"].values()), 10,
                          "every backend up")
    time.sleep(1.5)  # the checkpoint holds every backend up (as step 5)
    dp_pid = appliance.dataplane_pid()
    with RouteWatch(router) as watch:
        appliance.kill()
        killed = time.monotonic()
        os.kill(dp_pid, signal.SIGKILL)
        wait_for("route withdrawn after both planes were killed",
                 lambda: watch.missing_at is not None, 10, explain(router, appliance))
        wait_for("IPv6 route withdrawn after both planes were killed",
                 lambda: not router.route(ROUTE6), 10, explain(router, appliance))
    assert watch.missing_at is not None
    assert not alive_interface(lab)
    assert f'route {ROUTE4} via "{ALIVE}";' in (appliance.bird_dir / "vips.conf").read_text()
    figures["both_killed_to_route_gone_s"] = watch.missing_at - killed
    resumed = time.monotonic()
    appliance.resume()
    back = wait_for("route back after both planes restarted", lambda: bool(router.route()), 30,
                    explain(router, appliance))
    figures["both_killed_restart_to_route_back_s"] = back - resumed
    wait_for("IPv6 route back", lambda: bool(router.route(ROUTE6)), 10)

    # 7. The appliance stops: the route is withdrawn before the data plane stops.
    dp_pid = appliance.dataplane_pid()
    with RouteWatch(router) as watch:
        stop_at = time.monotonic()
        appliance.stop()
        dp_gone = wait_for("data plane exit", lambda: not Path(f"/proc/{dp_pid}").exists(), 10)
        wait_for("route withdrawn on stop", lambda: watch.missing_at is not None, 10)
    assert watch.missing_at is not None and watch.missing_at < dp_gone, \
        "the route was still announced when the data plane stopped"
    assert not router.route(ROUTE6)
    figures["stop_to_route_gone_s"] = watch.missing_at - stop_at
    figures["route_gone_before_dataplane_stop_s"] = dp_gone - watch.missing_at

    # 8. Started again: the route comes back.
    again = time.monotonic()
    appliance.start()
    wait_for("route back after the appliance started", lambda: bool(router.route()), 30)
    figures["start_to_route_back_s"] = time.monotonic() - again
    wait_for("IPv6 route back after the appliance started",
             lambda: bool(router.route(ROUTE6)), 10)

    # 9. Last (BIRD would then wait its error wait time, 60 s, before
    # connecting again): the link goes silent (the router drops what comes
    # from the appliance). BFD drops the session within about interval x
    # multiplier, and with it the route, well before the hold time (9 s).
    cut = ["ip", "netns", "exec", router.ns, "nft"]
    subprocess.run([*cut, "add table inet hpclb_cut; add chain inet hpclb_cut in { type "
                    "filter hook input priority 0; policy accept; }; add rule inet hpclb_cut "
                    f"in iifname {lab.prefix}r drop"], check=True, timeout=10)
    try:
        cut_at = time.monotonic()
        gone = wait_for("route withdrawn by BFD after the link went silent",
                        lambda: not router.route(), 8, explain(router, appliance))
        figures["silent_link_to_route_gone_s"] = gone - cut_at
    finally:
        subprocess.run([*cut, "delete table inet hpclb_cut"], check=False, timeout=10)

    rounded = {k: round(v, 3) for k, v in figures.items()}
    print("BGP convergence in the lab:", json.dumps(rounded))
    if out := os.environ.get("HPCLB_BGP_FIGURES"):
        Path(out).write_text(json.dumps(rounded, indent=1) + "\n")
