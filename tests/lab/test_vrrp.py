"""Lab: an active/standby pair with VRRP (keepalived), DSR, XDP.

A topology of its own (``hpclb.lab.vrrp.VrrpLab``): client, two appliances
``lba`` and ``lbb`` and three backends on one bridge; the client routes the VIP
via the VRRP virtual address 198.18.0.1. Both appliances run `hpclb run` on XDP
with the same configuration (same hash_key, same pool: the same rings) but for
their name, namespace, management address and `vrrp.role`, and keepalived
rendered from it by ``hpclb.announce.vrrp.render`` (VRRPv3, advert_int 0.5 s,
nopreempt, a track script), as provisioning renders it.

In order (one pair for the module): the active holds the address and alone
forwards; kill -9 of the active's keepalived, `hpclb run` and data plane moves
the traffic to the standby, the long-lived TCP streams opened before continue
through it on the same backend, new connections are served at once; the killed
member restarted stays BACKUP (nopreempt); then the new active's data plane
stops forwarding (its XDP program detached while its processes live): the track
script fails, that member goes to FAULT and the other takes over, again without
a broken stream; that member repaired, the active dies whole (it stops
forwarding and advertising at once, as a powered-off box); last, that member
repaired, the active's link is cut. The
failover times (last frame through the failed member to first frame through
the other, tcpdump kernel timestamps on the bridge side) are printed and
written to $HPCLB_VRRP_FIGURES when set, never asserted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hpclb.announce.vrrp import render, write_member_files
from hpclb.config.loader import parse_config
from hpclb.config.vrrp import VrrpConfig
from hpclb.lab.appliance import LAB_PORT, LAB_VIP
from hpclb.lab.topology import Lab, default_pass_obj
from hpclb.lab.vrrp import (
    VRRP_ADDRESS,
    Capture,
    Keepalived,
    PairMember,
    VrrpLab,
    failover_gap,
)

from .polling import held_at

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="lab tests need root (network namespaces, veth, XDP)"),
    pytest.mark.skipif(shutil.which("keepalived") is None,
                       reason="keepalived is not installed (Debian package keepalived)"),
    pytest.mark.skipif(shutil.which("tcpdump") is None,
                       reason="tcpdump is not installed (the failover time's capture)"),
]

VRRP: dict[str, Any] = {"next_hop": VRRP_ADDRESS, "advert_int": 0.5}
SETTINGS = VrrpConfig(role="active", **VRRP)  # the pair's settings, as loaded
ROLES = {"lba": "active", "lbb": "standby"}
WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 1.0}
STREAMS = 6
STREAM_S = 10.0
FLOW_SPORTS = "20000-20007"
POLL_S = 0.02
FIGURES: dict[str, Any] = {"conditions": {
    "advert_int_s": SETTINGS.advert_int, "vrrp_version": 3, "check_interval_s":
    SETTINGS.check_interval_s, "fall": SETTINGS.fall, "tcp_streams": STREAMS,
    "udp_pps": 200, "dataplane": "xdp native, veth", "mode": "dsr"}}


@dataclass
class Pair:
    lab: VrrpLab
    apps: dict[str, PairMember]
    kads: dict[str, Keepalived]
    workdir: Path

    def explain(self) -> str:
        return "\n".join(f"--- {m} keepalived:\n{k.log_text()}\n--- {m} hpclb run:\n"
                         f"{self.apps[m].log_text()[-1500:]}" for m, k in self.kads.items())


def wait_for(what: str, predicate: Callable[[], bool], timeout_s: float,
             explain: Callable[[], str] | None = None) -> float:
    """Poll until ``predicate()``; returns when it first held (wall clock: the
    captures' timestamps are)."""
    return held_at(what, predicate, timeout_s, POLL_S, explain, clock=time.time)


@pytest.fixture(scope="module")
def lab() -> Iterator[VrrpLab]:
    with VrrpLab(prefix=f"v{uuid.uuid4().hex[:6]}", backends=3,
                 peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT, udp=True)
        yield lab


def start_keepalived(pair: Pair, member: str) -> None:
    app, kad = pair.apps[member], pair.kads[member]
    config = parse_config(app.config_path.read_text(), str(app.config_path))
    assert config.vrrp is not None and config.vrrp.role == ROLES[member]
    rendered = render(config, run_dir=app.run_dir, check_script=kad.check_script)
    write_member_files(rendered, kad.conf, kad.check_script)
    kad.start()


@pytest.fixture(scope="module")
def pair(lab: VrrpLab) -> Iterator[Pair]:
    # keepalived runs its track script only where no part of the path is
    # writable by others: a root-owned 0700 directory (pytest's are under /tmp).
    base = Path(tempfile.mkdtemp(prefix="hpclb-vrrp-", dir="/run"
                                 if os.access("/run", os.W_OK) else None))
    base.chmod(0o700)
    apps: dict[str, PairMember] = {}
    kads: dict[str, Keepalived] = {}
    p = Pair(lab, apps, kads, base)
    try:
        for member in lab.members:
            work = base / member
            work.mkdir()
            apps[member] = PairMember(lab, member, work, WEIGHTS, VRRP, ROLES[member],
                                      dataplane="xdp")
            kads[member] = Keepalived(lab, member, work)
        for member in lab.members:
            apps[member].start(timeout_s=60)
        # The active first: it wins the first election alone (both start
        # BACKUP with nopreempt), then the standby hears its adverts.
        start_keepalived(p, "lba")
        wait_for("the active holding the virtual address", lambda: lab.holds("lba"), 20,
                 p.explain)
        start_keepalived(p, "lbb")
        wait_for("the standby's keepalived in BACKUP", lambda: "Entering BACKUP STATE" in
                 kads["lbb"].log_path.read_text(), 20, p.explain)
        yield p
    finally:
        for kad in kads.values():
            kad.stop()
        for app in apps.values():
            app.stop()
        shutil.rmtree(base, ignore_errors=True)
        if out := os.environ.get("HPCLB_VRRP_FIGURES"):
            Path(out).write_text(json.dumps(FIGURES, indent=1) + "\n")
        print("VRRP failover in the lab:", json.dumps(FIGURES))


def test_same_tables_and_active_serves(lab: VrrpLab, pair: Pair) -> None:
    # The same configuration but for the member-local fields: the same rings.
    configs = [pair.apps[m].config() for m in lab.members]
    for c in configs:
        for key in ("name", "netns", "management_address", "control_socket"):
            c["appliance"].pop(key)
        c["vrrp"].pop("role")
    assert configs[0] == configs[1]
    assert lab.holds("lba") and not lab.holds("lbb")

    capture = Capture(lab, lab.members, LAB_VIP, pair.workdir)
    capture.start()
    try:
        report = lab.run_client(LAB_VIP, LAB_PORT, connections=60, concurrency=10)
    finally:
        times = capture.stop()
    assert report["ok"] == 60, report
    assert len(report["counts"]) >= 2, report
    assert times["lba"] and not times["lbb"], {m: len(t) for m, t in times.items()}
    mac = lab.mac("lba")
    assert mac in lab.client_neighbour(), lab.client_neighbour()


def failover(pair: Pair, failed: str, other: str, inject: Callable[[], None],
             label: str) -> dict[str, Any]:
    """Streams and a UDP flow set through ``failed``, ``inject()``, the other
    takes the address; new connections at once; every stream checked."""
    lab = pair.lab
    capture = Capture(lab, lab.members, LAB_VIP, pair.workdir)
    capture.start()
    streams: list[subprocess.Popen[str]] = []
    udp: subprocess.Popen[str] | None = None
    try:
        udp = lab.popen("cli", [sys.executable, "-m", "hpclb.lab.node", "udpstream",
                                "--vip", LAB_VIP, "--port", str(LAB_PORT), "--sports",
                                FLOW_SPORTS, "--pps", "200", "--duration", str(STREAM_S),
                                "--linger", "1", "--json"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        streams = [lab.start_stream(LAB_VIP, LAB_PORT, interval_ms=100, duration=STREAM_S,
                                    timeout=15.0) for _ in range(STREAMS)]
        time.sleep(2.5)  # every stream established, through the active
        injected = time.time()
        inject()
        took = wait_for(f"{other} holding the virtual address",
                        lambda: lab.holds(other), 20, pair.explain)
        new = lab.run_client(LAB_VIP, LAB_PORT, connections=30, concurrency=10, timeout=2.0)
        new_done = time.time()
        results = [Lab.wait_json(s, timeout=STREAM_S + 40) for s in streams]
        udp_report = Lab.wait_json(udp, timeout=STREAM_S + 30)
    finally:
        for proc in [*streams, *([udp] if udp is not None else [])]:
            if proc.poll() is None:
                lab.stop_process(proc)
        times = capture.stop()

    gap = failover_gap(times, failed, other, injected)
    broken = [r for r in results if r["errors"]]
    moved = [r for r in results if len(r["distinct"]) != 1]
    flows_moved = [f for f, names in udp_report["flows"].items() if len(names) > 1]
    figures = {
        **gap,
        "injected_to_address_moved_s": took - injected,
        "new_connections_ok": new["ok"], "new_connections": 30,
        "new_connections_elapsed_s": new["elapsed_s"],
        "injected_to_new_connections_done_s": new_done - injected,
        "streams": STREAMS, "streams_broken": len(broken),
        "streams_changed_backend": len(moved),
        "udp_sent": udp_report["sent"], "udp_answered": udp_report["answered"],
        "udp_flows_changed_backend": len(flows_moved),
    }
    FIGURES[label] = {k: (round(v, 4) if isinstance(v, float) else v)
                      for k, v in figures.items()}
    print(label, json.dumps(FIGURES[label]))
    # Behaviour, not timing: the other member forwards after the failure,
    # the streams opened before it continue on their backend, new connections
    # are served.
    assert gap["first_through_other"] is not None, (gap, pair.explain())
    assert new["ok"] == 30, new
    assert not broken, broken
    assert not moved, moved
    # A stream stops at its first error (each step has its own timeout), so one
    # with none was answered to the end of its length, across the failover.
    assert all(r["names"] for r in results), results
    assert not flows_moved, udp_report["flows"]
    assert lab.mac(other) in lab.client_neighbour(), lab.client_neighbour()
    return figures


def test_kill9_active_fails_over(lab: VrrpLab, pair: Pair) -> None:
    app, kad = pair.apps["lba"], pair.kads["lba"]
    dp_pid = app.dataplane_pid()

    def kill_all() -> None:
        kad.kill()
        app.kill()
        os.kill(dp_pid, signal.SIGKILL)

    failover(pair, "lba", "lbb", kill_all, "kill9_active")
    assert not Path(f"/proc/{dp_pid}").exists()

    # The killed keepalived left its address behind (as a crash does); the
    # client's neighbour entry follows the standby's gratuitous ARPs anyway.
    assert lab.holds("lba")
    # The killed member comes back and stays BACKUP: nopreempt, no flapping;
    # its keepalived removes the stale address as it starts.
    app.stop()
    app.start(timeout_s=60)
    start_keepalived(pair, "lba")
    wait_for("lba's keepalived in BACKUP", lambda: "Entering BACKUP STATE" in
             kad.log_path.read_text(), 20, pair.explain)
    # Several advert intervals after it heard the master: still BACKUP.
    time.sleep(6 * SETTINGS.advert_int)
    assert "Entering MASTER STATE" not in kad.log_path.read_text().split(
        "Entering BACKUP STATE")[-1]
    assert lab.holds("lbb") and not lab.holds("lba")


def test_dataplane_dead_is_tracked(lab: VrrpLab, pair: Pair) -> None:
    if not lab.holds("lbb"):
        pytest.skip("needs lbb as the active (test_kill9_active_fails_over before it)")
    # lbb's data plane stops forwarding while every process lives: its XDP
    # program detached. Only the track script can tell.
    failover(pair, "lbb", "lba",
             lambda: lab.exec("lbb", ["ip", "link", "set", "dev", "eth0", "xdp", "off"]),
             "dataplane_detached")
    wait_for("lbb's keepalived in FAULT", lambda: vrrp_state(pair.kads["lbb"]) == "FAULT",
             10, pair.explain)
    assert not lab.holds("lbb")


def vrrp_state(kad: Keepalived) -> str:
    """The state keepalived last entered (MASTER, BACKUP, FAULT), "" before any."""
    states = re.findall(r"Entering (\w+) STATE", kad.log_path.read_text())
    return states[-1] if states else ""


def test_member_dies_whole(lab: VrrpLab, pair: Pair) -> None:
    """A member that dies whole (it stops forwarding and advertising at once,
    as a powered-off box; then its processes are killed): the outage is the
    VRRP detection. Before it, the member of the previous test is repaired (its
    data plane restarted: the track script rises, FAULT -> BACKUP)."""
    if not lab.holds("lba") or vrrp_state(pair.kads["lbb"]) != "FAULT":
        pytest.skip("needs lba active and lbb in FAULT (the tests before it)")
    pair.apps["lbb"].stop()
    pair.apps["lbb"].start(timeout_s=60)
    wait_for("lbb back to BACKUP", lambda: vrrp_state(pair.kads["lbb"]) == "BACKUP", 20,
             pair.explain)
    app, kad = pair.apps["lba"], pair.kads["lba"]
    dp_pid = app.dataplane_pid()

    def die() -> None:
        # Forwarding and adverts stop within milliseconds: one shell in the
        # member detaches the program and kills keepalived; then the rest.
        # (Not the link: a link that goes down makes the bridge flood, see
        # test_link_cut.)
        pids = kad.pids()  # the VRRP child first, the parent last (Keepalived.kill)
        lab.exec("lba", ["sh", "-c", f"ip link set dev eth0 xdp off; kill -STOP {pids[-1]}; "
                                     f"kill -9 {' '.join(map(str, pids))}"])
        kad.kill()
        app.kill()
        os.kill(dp_pid, signal.SIGKILL)

    failover(pair, "lba", "lbb", die, "member_dies_whole")


def test_link_cut(lab: VrrpLab, pair: Pair) -> None:
    """The active's link cut (its eth0 down: both veth ends lose carrier). The
    bridge flushes what it learnt on that port, floods the client's frames for
    the dead member's MAC, and the standby's XDP program forwards them (lb_xdp
    does not look at the destination MAC) before VRRP moves the address."""
    if not lab.holds("lbb") or vrrp_state(pair.kads["lbb"]) != "MASTER":
        pytest.skip("needs lbb active (the tests before it)")
    # lba repaired after test_member_dies_whole: program, processes.
    pair.apps["lba"].stop()
    pair.apps["lba"].start(timeout_s=60)
    start_keepalived(pair, "lba")
    wait_for("lba back to BACKUP", lambda: vrrp_state(pair.kads["lba"]) == "BACKUP", 20,
             pair.explain)
    figures = failover(pair, "lbb", "lba", lambda: lab.set_link("lbb", "eth0", up=False),
                       "link_cut")
    wait_for("lbb's keepalived in FAULT", lambda: vrrp_state(pair.kads["lbb"]) == "FAULT",
             10, pair.explain)
    assert figures["first_through_other"] is not None
