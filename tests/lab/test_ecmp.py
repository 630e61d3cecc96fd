"""Lab: a fleet of three appliances behind ECMP, announced with BGP (issue 15).

A topology of its own (``hpclb.lab.ecmp.EcmpLab``): the client behind a router
namespace running BIRD 2 (eBGP to the three members, kernel protocol with
``merge paths on``, the kernel's L4 multipath hash), three appliances
``lba``, ``lbb``, ``lbc`` and three backends on the LAN; DSR: the backends
answer the client through the router, never through a member. Every member
runs `hpclb run` on XDP with the fleet's configuration (the same hash_key and
pools; a ``bgp:`` section peering with the router, a TCP probe, a ``fleet:``
section and a dynamic pool fed by one agent per backend that publishes to all
three members where this build has them) and its own BIRD.

A stream keeps its backend on its member (the data plane's flow table); one
the router moves to another member is looked up there in the ring: it keeps
its backend exactly when its slot still names that backend. The members' rings
are identical, so only the weights can have moved the slot since the stream
started (the streams' own load makes idle weights flicker): each stream that
broke or changed backend must be one of those, checked against the slot of its
5-tuple in the taking member's ring, and is reported; any other fails the test.

In order (one fleet for the module): the three members hold the same rings
(read back from each data plane, compared slot by slot by backend address)
and the router spreads new connections over all three; a busy loop in one
backend's cgroup changes the weights twice (loaded, then idle again) and after
each change the three rings are identical; kill -9 of one member's `hpclb run`
and data plane (its BIRD lives) under 200 long-lived TCP streams: the route
loses that next hop, no stream breaks or changes backend (but those above,
reported); the member
restarted, a cut link on another member under the streams: the same; last, a
member whose probes are blocked (it loses every backend) withdraws its route
while the others keep theirs. Figures (failover time per flow, BGP
convergence, flows that changed backend, how long the fleet took to agree on
rings again) are printed and written to $HPCLB_ECMP_FIGURES when set, never
asserted.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hpclb.config.bgp import BgpConfig
from hpclb.config.schema import HpclbConfig
from hpclb.contract.flowhash import flow_slot
from hpclb.lab.appliance import LAB_PORT, LAB_VIP
from hpclb.lab.ecmp import (
    EcmpLab,
    EcmpMember,
    EcmpRouter,
    FlowCapture,
    flow_failover,
    member_rings,
    ring_differences,
    ring_shares,
    tools_missing,
)
from hpclb.lab.topology import Lab, cgroup_controllers_missing, default_pass_obj

from .conftest import Keys
from .fleet_lab import POLL_S, ROUTE, RouteWatch, member_local
from .polling import Watcher, held_at

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="lab tests need root (network namespaces, veth, XDP)"),
    pytest.mark.skipif(bool(tools_missing()),
                       reason=f"the ECMP lab needs {', '.join(tools_missing())} "
                              "(Debian packages bird2, tcpdump, iproute2, nftables)"),
]

RING = f"{LAB_VIP}:{LAB_PORT}/6"  # the TCP VIP's ring in member_rings
BACKENDS = ("b1", "b2", "b3")
WEIGHTS = dict.fromkeys(BACKENDS, 1.0)
STREAMS = 200
# A UDP flow set beside the streams, for the failover time: each of the 30
# flows sends every 30 / UDP_PPS = 0.1 s, the resolution of a flow's gap (a
# stream's line goes once a second).
UDP_SPORTS = (20000, 20029)
UDP_PPS = 300
HOLD_TIME_S = 3
# BFD to the router where this build has it (bgp.bfd): a cut link is seen in
# interval x multiplier instead of the hold time.
HAS_BFD = "bfd" in BgpConfig.model_fields
HAS_ALIVE = "alive_interface" in BgpConfig.model_fields
BFD_INTERVAL_MS, BFD_MULTIPLIER = 100, 3
# Fleet-consistent weights (the fleet: section) and agents publishing to every
# member (hpclb-agent run --connect repeated).
HAS_FLEET = "fleet" in HpclbConfig.model_fields
DYNAMIC = HAS_FLEET and not cgroup_controllers_missing()
AGENT_INTERVAL_S = 0.5
FLEET_WINDOW = 8
# CPU dominates the score so that a loaded backend's weight falls far; no slow
# start: a restarted member must agree with the others once it holds the same
# samples, not after a ramp of its own.
POLICY = {"cpu": 0.8, "mem": 0.1, "net": 0.1, "alpha": 1.0, "step": 0.02, "max_rate": None,
          "floor": 0.05, "slow_start_s": 0.0, "stale_after_s": 60.0}
CPU_QUOTA = 0.5
# Three failures in a row before a backend is down: on a loaded 2-core host a
# single probe that times out on one member only would change that member's
# ring alone (health is each member's own) and move its flows.
PROBE = {"kind": "tcp", "port": LAB_PORT, "interval_s": 0.5, "timeout_s": 0.5, "rise": 2,
         "fall": 3, "damping": {"enabled": False}}
FIGURES: dict[str, Any] = {"conditions": {
    "members": 3, "backends": 3, "mode": "dsr", "dataplane": "xdp native, veth",
    "router": "BIRD 2, kernel protocol merge paths on, fib_multipath_hash_policy=1",
    "hold_time_s": HOLD_TIME_S,
    "bfd": f"{BFD_INTERVAL_MS} ms x {BFD_MULTIPLIER}" if HAS_BFD else None,
    "alive_interface": HAS_ALIVE, "weights": "fleet, dynamic" if DYNAMIC else "static",
    "tcp_streams": STREAMS, "stream_line_interval_s": 1.0, "route_poll_s": POLL_S,
    "host": f"{os.cpu_count()} CPUs shared with other lab tests"}}


@dataclass
class Fleet:
    lab: EcmpLab
    router: EcmpRouter
    apps: dict[str, EcmpMember]
    workdir: Path
    agents: list[subprocess.Popen[str]] = field(default_factory=list)

    def explain(self) -> str:
        try:
            rings = all_rings(self)
            differences: Any = {"slots": ring_differences(rings),
                                "shares": {m: ring_shares(r[RING]) for m, r in rings.items()}}
        except Exception as err:  # a data plane that does not answer
            differences = str(err)
        fleets = {}
        for m, app in self.apps.items():
            try:
                fleets[m] = app.status().get("fleet")
            except Exception as err:  # a member restarting
                fleets[m] = str(err)
        parts = [f"weights: {weights_of(self)}", f"ring differences: {differences}",
                 f"fleet status: {fleets}",
                 f"router protocols:\n{self.router.birdc('show', 'protocols')}",
                 f"router route: {self.router.route(ROUTE)!r}",
                 f"router BIRD log:\n{self.router.log_text()[-1500:]}"]
        for m, app in self.apps.items():
            parts.append(f"--- {m} hpclb run:\n{app.log_text()[-1500:]}\n--- {m} BIRD:\n"
                         f"{app.speaker_log()[-800:]}")
        return "\n".join(parts)

    def addresses(self, *members: str) -> set[str]:
        return {self.lab.ip_of(m) for m in members}


def wait_for(what: str, predicate: Callable[[], Any], timeout_s: float,
             explain: Callable[[], str] | None = None) -> float:
    """Poll until ``predicate()``; returns when it first held (wall clock: the
    captures' timestamps are)."""
    return held_at(what, predicate, timeout_s, POLL_S, explain, clock=time.time)


@pytest.fixture(scope="module")
def lab() -> Iterator[EcmpLab]:
    with EcmpLab(prefix=f"e{uuid.uuid4().hex[:6]}", backends=3,
                 peer_xdp_pass=default_pass_obj()) as lab:
        for i, name in enumerate(BACKENDS, 1):
            cgroup = None
            if DYNAMIC:
                cgroup = name
                lab.create_cgroup(name, cpu_quota=CPU_QUOTA, memory_limit=256 << 20)
            lab.start_backend(i, LAB_PORT, udp=True, cgroup=cgroup)
        yield lab


def all_rings(fleet: Fleet) -> dict[str, dict[str, tuple[str | None, ...]]]:
    return {m: member_rings(app) for m, app in fleet.apps.items()}


def balanced(ring: tuple[str | None, ...]) -> bool:
    """Every backend with about a third of the ring (idle weights)."""
    shares = ring_shares(ring)
    return len(shares) == 3 and all(0.23 < v < 0.43 for v in shares.values())


def weights_of(fleet: Fleet) -> dict[str, Any]:
    """Each member's weights as its status file shows them."""
    out: dict[str, Any] = {}
    for m, app in fleet.apps.items():
        try:
            out[m] = app.status()["weights"]["lab"]
        except Exception as err:  # a member restarting
            out[m] = str(err)
    return out


def full_route(fleet: Fleet) -> bool:
    return fleet.router.next_hops(ROUTE) == fleet.addresses(*fleet.lab.members)


def start_members(fleet: Fleet, members: tuple[str, ...]) -> None:
    """Start `hpclb run` on ``members`` at once (each waits for its first push)."""
    with concurrent.futures.ThreadPoolExecutor(len(members)) as pool:
        for fut in [pool.submit(fleet.apps[m].start, 90.0) for m in members]:
            fut.result()


@pytest.fixture(scope="module")
def fleet(lab: EcmpLab, keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("ecmp")
    router = EcmpRouter(lab, base, hold_time_s=HOLD_TIME_S,
                        bfd=(BFD_INTERVAL_MS, BFD_MULTIPLIER) if HAS_BFD else None)
    apps: dict[str, EcmpMember] = {}
    f = Fleet(lab, router, apps, base)
    extra: dict[str, Any] = {}
    if DYNAMIC:
        extra = {"weights_mode": "dynamic", "policy": POLICY,
                 "telemetry": {"server_key": str(keys.secret("server")),
                               "allow_dir": str(keys.allow)}}
    bgp = {"bfd": {"enabled": True, "interval_ms": BFD_INTERVAL_MS,
                   "multiplier": BFD_MULTIPLIER}} if HAS_BFD else {}
    fleet_section = ({"window": FLEET_WINDOW,
                      "members": [f"{lab.prefix}-{m}" for m in lab.members]}
                     if HAS_FLEET else None)
    started = time.time()
    try:
        router.start()
        for m in lab.members:
            (base / m).mkdir()
            apps[m] = EcmpMember(lab, m, base / m, WEIGHTS, dataplane="xdp", probe=PROBE,
                                 hold_time_s=HOLD_TIME_S, bgp=bgp, fleet=fleet_section,
                                 **extra)
            problem = apps[m].config_problem()
            assert problem is None, problem
        start_members(f, lab.members)
        for app in apps.values():
            app.start_speaker()
        if DYNAMIC:
            endpoints = [apps[m].telemetry_endpoint() for m in lab.members]
            for name in BACKENDS:
                f.agents.append(lab.start_agent(
                    name, connect=endpoints[0], server_key=keys.public("server"),
                    key=keys.secret(name), cgroup=name, base_interval=AGENT_INTERVAL_S,
                    log=base / f"agent-{name}.log",
                    extra=[x for e in endpoints[1:] for x in ("--connect", e)]))
        full = wait_for("the route through the three members", lambda: full_route(f), 60,
                        f.explain)
        agreed = wait_for("the three members' rings identical, every backend with about "
                          "a third", Settled(f).probe(balanced), 90, f.explain)
        FIGURES["start"] = {"start_to_three_next_hops_s": round(full - started, 3),
                            "start_to_rings_identical_s": round(agreed - started, 3)}
        yield f
    finally:
        for agent in f.agents:
            lab.stop_process(agent)
        for app in apps.values():
            app.stop()  # while its speaker runs: the withdrawal on stop reaches it
        for app in apps.values():
            app.stop_speaker()
        router.stop()
        if out := os.environ.get("HPCLB_ECMP_FIGURES"):
            Path(out).write_text(json.dumps(FIGURES, indent=1) + "\n")
        print("ECMP fleet in the lab:", json.dumps(FIGURES))


def test_same_rings_and_ecmp_spreads(lab: EcmpLab, fleet: Fleet) -> None:
    configs = [member_local(fleet.apps[m].config()) for m in lab.members]
    assert configs[0] == configs[1] == configs[2]
    # Compared slot by slot by backend address, every ring of every member;
    # polled: a member that pushed a weight change a moment before another
    # differs for that moment (counted in the figures).
    reads = {"all": 0, "differing": 0}
    found: list[dict[str, dict[str, tuple[str | None, ...]]]] = []

    def agree() -> bool:
        found[:] = [all_rings(fleet)]
        reads["all"] += 1
        reads["differing"] += bool(ring_differences(found[0]))
        return not ring_differences(found[0])

    wait_for("the three members' rings identical", agree, 30, fleet.explain)
    ring = found[0]["lba"][RING]
    assert len(set(ring) - {None}) == 3, ring_shares(ring)
    assert fleet.router.next_hops(ROUTE) == fleet.addresses(*lab.members), fleet.explain()

    capture = FlowCapture(lab, lab.members, LAB_VIP, fleet.workdir)
    capture.start()
    try:
        report = lab.run_client(LAB_VIP, LAB_PORT, connections=300, concurrency=20,
                                timeout=5.0)
    finally:
        capture.stop()
    flows = {m: capture.flows(m) for m in lab.members}
    shares = {m: round(len(f) / 300, 3) for m, f in flows.items()}
    both = [p for p in flows["lba"] if p in flows["lbb"] or p in flows["lbc"]]
    FIGURES["spread"] = {"new_connections": 300, "flow_share_per_member": shares,
                         "backend_counts": report["counts"],
                         "ring_shares": ring_shares(ring), "ring_reads": reads}
    print("spread", json.dumps(FIGURES["spread"]))
    assert report["ok"] == 300, report
    # Every member took a fair part of the new flows (each about a third; an
    # L4 hash over 300 flows leaves each well above a tenth).
    assert all(s >= 0.1 for s in shares.values()), shares
    assert not both, "a connection crossed two members with the route unchanged"
    assert set(report["counts"]) == set(BACKENDS), report


@pytest.mark.skipif(not DYNAMIC, reason="needs the fleet: section (fleet-consistent "
                    "weights) and the lab's v1 cgroups")
def test_weight_changes_keep_rings_identical(lab: EcmpLab, fleet: Fleet) -> None:
    """A busy loop in b1's cgroup, then none: the weights change (several
    steps each way, as each member's window of samples fills); once each
    change has settled the three members' rings are identical, slot by slot."""
    b1 = lab.backend_ip(1)
    watch = Settled(fleet)
    wait_for("rings identical and settled before the load", watch.probe(), 60, fleet.explain)
    before = watch.b1_share(b1)
    weights = {"idle": weights_of(fleet)}
    start = time.time()
    busy = lab.start_busy_loop("b1", "b1")
    try:
        loaded_at = wait_for("b1's share down, the rings identical and settled",
                             watch.probe(lambda r: watch.b1_share(b1, r) < before - 0.1),
                             90, fleet.explain)
        loaded = watch.b1_share(b1)
        weights["loaded"] = weights_of(fleet)
    finally:
        lab.stop_process(busy)
    idle = time.time()
    idle_at = wait_for("b1's share up again, the rings identical and settled",
                       watch.probe(lambda r: watch.b1_share(b1, r) > loaded + 0.1), 90,
                       fleet.explain)
    after = watch.b1_share(b1)
    weights["idle_again"] = weights_of(fleet)
    FIGURES["weights"] = {
        "b1_ring_share": {"idle": before, "loaded": loaded, "idle_again": after},
        "load_to_settled_identical_rings_s": round(loaded_at - start, 3),
        "unload_to_settled_identical_rings_s": round(idle_at - idle, 3),
        "ring_reads": watch.reads, "ring_reads_differing": watch.differing,
        "fleet_ring_states_seen": len(watch.states), "settle_s": SETTLE_S,
        "weights": weights}
    print("weights", json.dumps(FIGURES["weights"]))
    assert loaded < before - 0.1 < after, FIGURES["weights"]
    # The idle ring, the loaded ones and the idle ones again: at least two changes,
    # each seen identical on the three members.
    assert len(watch.states) >= 3, FIGURES["weights"]


SETTLE_S = 1.5


class Settled:
    """Reads the three members' rings: a probe holds once they are identical
    and have stayed the same for SETTLE_S (a change that has settled, not a
    moment between two members' pushes); counts the reads that differed and
    the distinct identical fleet rings seen."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.reads = 0
        self.differing = 0
        self.states: list[tuple[str | None, ...]] = []
        self.last: dict[str, tuple[str | None, ...]] = {}
        self._same_since: tuple[tuple[str | None, ...], float] | None = None

    def b1_share(self, b1: str, ring: tuple[str | None, ...] | None = None) -> float:
        return ring_shares(self.last[RING] if ring is None else ring).get(b1, 0.0)

    def probe(self, pred: Callable[[tuple[str | None, ...]], bool] = lambda r: True
              ) -> Callable[[], bool]:
        def check() -> bool:
            try:
                rings = all_rings(self.fleet)
            except Exception:  # a data plane restarting: not yet
                self._same_since = None
                return False
            self.reads += 1
            if ring_differences(rings):
                self.differing += 1
                self._same_since = None
                return False
            ring = rings["lba"][RING]
            self.last = rings["lba"]
            if not self.states or self.states[-1] != ring:
                self.states.append(ring)
            now = time.monotonic()
            if self._same_since is None or self._same_since[0] != ring:
                self._same_since = (ring, now)
            return now - self._same_since[1] >= SETTLE_S and pred(ring)
        return check


class RingTimeline(Watcher):
    """Reads ``members``' TCP rings every ~0.1 s in a thread, keeping each
    distinct ring with the time it was first read: what a member looked a
    flow up in when the flow reached it (the weights may change meanwhile)."""

    def __init__(self, fleet: Fleet, members: list[str]) -> None:
        super().__init__(0.1)
        self.fleet = fleet
        self.history: dict[str, list[tuple[float, tuple[str | None, ...]]]] = {
            m: [] for m in members}

    def look(self) -> None:
        for m, hist in self.history.items():
            try:
                ring = member_rings(self.fleet.apps[m])[RING]
            except Exception:  # a data plane that does not answer this time
                continue
            if not hist or hist[-1][1] != ring:
                hist.append((time.time(), ring))

    def around(self, member: str, t: float, slack_s: float = 0.3
               ) -> list[tuple[str | None, ...]]:
        """The rings ``member`` may have held within ``slack_s`` of ``t``."""
        hist = self.history[member]
        out = [r for i, (since, r) in enumerate(hist)
               if since <= t + slack_s
               and (i + 1 == len(hist) or hist[i + 1][0] >= t - slack_s)]
        return out or [hist[-1][1]] if hist else []

    def changes(self) -> dict[str, int]:
        return {m: max(0, len(h) - 1) for m, h in self.history.items()}


class DigestWatch(Watcher):
    """Polls each member's status for its TCP ring digest (the `fleet:` status
    block, rewritten every second) in a thread: the ring changes each member
    made while the streams ran."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(0.2)
        self.fleet = fleet
        self.seen: dict[str, list[str]] = {m: [] for m in fleet.apps}

    def look(self) -> None:
        for m, app in self.fleet.apps.items():
            try:
                digest = str(app.status()["fleet"]["rings"]["lab-tcp"])
            except Exception:  # no fleet block in this build, a member restarting
                continue
            if not self.seen[m] or self.seen[m][-1] != digest:
                self.seen[m].append(digest)

    def changes(self) -> dict[str, int]:
        return {m: max(0, len(d) - 1) for m, d in self.seen.items()}


def under_streams(fleet: Fleet, failed: str, inject: Callable[[], None], label: str,
                  duration_s: float) -> dict[str, Any]:
    """200 streams (and a UDP flow set) through the fleet, ``inject()`` once
    every stream is established and has been answered through its member; the
    route must lose ``failed``; every stream checked; figures under ``label``.

    A stream keeps its backend on its own member whatever the weights do (the
    data plane's flow table). One that the router moves to another member is
    looked up there afresh: it keeps its backend exactly when its ring slot
    names that backend on the member that took it. The fleet's rings are the
    same, but the weights may have moved the slot since the stream opened (the
    streams' own load changes the backends' figures): such a stream is
    reported, not failed. Every other stream must be answered to its end on
    its first backend."""
    lab = fleet.lab
    wait_for("rings identical and settled before the failure", Settled(fleet).probe(), 60,
             fleet.explain)
    assert full_route(fleet), fleet.explain()
    key = bytes(fleet.apps[failed].client.dump()["hash_key"])
    ready = fleet.workdir / f"streams-{label}.ready"
    capture = FlowCapture(lab, lab.members, LAB_VIP, fleet.workdir)
    capture.start()
    proc: subprocess.Popen[str] | None = None
    udp: subprocess.Popen[str] | None = None
    failed_ip = lab.ip_of(failed)
    survivors = [m for m in lab.members if m != failed]
    digests = DigestWatch(fleet).__enter__()
    try:
        proc = lab.popen("cli", [sys.executable, "-m", "hpclb.lab.node", "streams", "--vip",
                                 LAB_VIP, "--port", str(LAB_PORT), "--count", str(STREAMS),
                                 "--interval-ms", "1000", "--duration", str(duration_s),
                                 "--timeout", "15", "--open-over", "2", "--ready-file",
                                 str(ready), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for("every stream opened", ready.exists, 30)
        opened = json.loads(ready.read_text())
        udp = lab.popen("cli", [sys.executable, "-m", "hpclb.lab.node", "udpstream", "--vip",
                                LAB_VIP, "--port", str(LAB_PORT), "--sports",
                                f"{UDP_SPORTS[0]}-{UDP_SPORTS[1]}", "--pps", str(UDP_PPS),
                                "--duration", str(duration_s - 3), "--linger", "1", "--json"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(1.5)  # a line answered on each stream, through its member
        before = member_rings(fleet.apps[survivors[0]])[RING]
        # What the members that take moved flows look them up in, around the
        # moment each flow reached them.
        with RouteWatch(fleet.router, failed_ip) as watch, \
                RingTimeline(fleet, survivors) as timeline:
            injected = time.time()
            inject()
            wait_for(f"the route without {failed}", lambda: watch.left_at is not None, 30,
                     fleet.explain)
            time.sleep(2.5)  # every stream sends a line a second: all moved by now
        after = {m: member_rings(fleet.apps[m])[RING] for m in survivors}
        report = Lab.wait_json(proc, timeout=duration_s + 60)
        udp_report = Lab.wait_json(udp, timeout=30)
    finally:
        for p in (proc, udp):
            if p is not None and p.poll() is None:
                lab.stop_process(p)
        capture.stop()
        digests.__exit__()
    flows = {m: capture.flows(m) for m in lab.members}
    udp_ports = range(UDP_SPORTS[0], UDP_SPORTS[1] + 1)
    gap = flow_failover({m: {p: t for p, t in f.items() if p in udp_ports}
                         for m, f in flows.items()}, failed, injected)
    tcp_gap = flow_failover({m: {p: t for p, t in f.items() if p not in udp_ports}
                             for m, f in flows.items()}, failed, injected)
    udp_moved = {f: n for f, n in udp_report["flows"].items() if len(n) > 1}
    on_failed = {p for p, ts in flows[failed].items()
                 if p not in udp_ports and any(t <= injected for t in ts)}
    # Each stream's member before the failure and after it: the router's
    # hash-threshold split moves some of the survivors' flows between them
    # too, not only the failed member's.
    carrier_before: dict[int, str] = {}
    carrier_after: dict[int, str] = {}
    assert watch.left_at is not None
    watch_end = watch.left_at
    for port in {p for f in flows.values() for p in f if p not in udp_ports}:
        lasts = [(max(t for t in flows[m][port] if t <= injected), m) for m in lab.members
                 if any(t <= injected for t in flows[m].get(port, []))]
        firsts = [(min(t for t in flows[m][port] if t > watch_end), m) for m in survivors
                  if any(t > watch_end for t in flows[m].get(port, []))]
        if lasts:
            carrier_before[port] = max(lasts)[1]
        if firsts:
            carrier_after[port] = min(firsts)[1]
    taker = {p: m for p, m in carrier_after.items() if carrier_before.get(p) != m}
    first_on_taker = {p: min(t for t in flows[m][p] if t > watch_end) for p, m in taker.items()}
    names = {lab.backend_ip(i): f"b{i}" for i in range(1, lab.backends + 1)}

    def slot(port: int) -> int:
        return flow_slot(key, lab.ip_of("cli"), LAB_VIP, port, LAB_PORT, 6, len(before))

    streams = report["streams"]
    moved_slot: list[dict[str, Any]] = []  # moved to a member whose slot names another
    unexplained: list[dict[str, Any]] = []
    for st in streams:
        bad = bool(st["error"]) or len(st["backends"]) > 1
        port = st["port"]
        slot_moved = port in taker and bool(st["backends"]) and any(
            names.get(str(ring[slot(port)])) != st["backends"][0]
            for ring in timeline.around(taker[port], first_on_taker[port]))
        if slot_moved:
            moved_slot.append(st)
        elif bad:
            unexplained.append(st)
    broken = [st for st in streams if st["error"]]
    changed = [st for st in streams if len(st["backends"]) > 1]
    slots_changed = sum(1 for a, b in zip(before, after[survivors[0]], strict=True) if a != b)
    figures = {
        "failover_udp": gap, "failover_tcp_lines": tcp_gap,
        "bgp_convergence_s": round(watch.left_at - injected, 4),
        "next_hops_seen": [sorted(h) for h in watch.hops_seen],
        "streams": STREAMS, "streams_opened": opened["opened"],
        "streams_on_failed": len(on_failed), "streams_moved_to_another_member": len(taker),
        "streams_moved_between_survivors": sum(1 for p in taker if p not in on_failed),
        "streams_broken": len(broken), "streams_changed_backend": len(changed),
        "share_changed_backend": round((len(broken) + len(changed)) / STREAMS, 4),
        "streams_moved_whose_slot_changed": len(moved_slot),
        "ring_slots_changed_around_failure": slots_changed,
        "ring_changes_during_streams": digests.changes(),
        "ring_changes_seen_after_failure": timeline.changes(),
        "lines_answered_min": min(s["answered"] for s in streams),
        "udp_flows": len(udp_ports), "udp_pps": UDP_PPS, "udp_sent": udp_report["sent"],
        "udp_answered": udp_report["answered"],
        # Reported, not asserted: a UDP flow the router moves onto a slot the
        # weights changed is answered by another backend, as a TCP stream
        # there is reset (and a UDP flow has no connection to lose).
        "udp_flows_changed_backend": len(udp_moved),
    }
    FIGURES[label] = figures
    print(label, json.dumps(figures))
    # Behaviour, not timing: the route lost the member; every stream opened
    # before was answered to its end on the backend it started on (DSR: the
    # backend's connection is what counts), but those the router moved onto a
    # slot that the weights had given another backend since (reported); the
    # failed member's streams went through the others.
    assert opened["opened"] == STREAMS, opened
    assert failed_ip not in fleet.router.next_hops(ROUTE), fleet.explain()
    details = [
        {**{k: st[k] for k in ("port", "backends", "answered", "error", "last_answer")},
         "carrier_before": carrier_before.get(st["port"]),
         "carrier_after": carrier_after.get(st["port"]), "injected": injected,
         "slot_backend": {m: names.get(str(r[slot(st["port"])])) for m, r in after.items()},
         "slot_backend_timeline": {m: [(round(t - injected, 3), names.get(str(r[slot(st["port"])])))
                                       for t, r in h] for m, h in timeline.history.items()},
         "first_on_taker": round(first_on_taker.get(st["port"], injected) - injected, 3)}
        for st in unexplained[:5]]
    if details:
        print(f"{label}: streams broken or moved that no slot change explains:",
              json.dumps(details))
    assert not unexplained, details
    assert on_failed, "no stream went through the failed member: ECMP did not spread"
    assert tcp_gap["flows_not_seen_elsewhere"] == 0, tcp_gap
    assert on_failed <= set(taker), sorted(on_failed - set(taker))[:5]
    return figures


def restore(fleet: Fleet, label: str, action: Callable[[], None]) -> None:
    """``action()`` repairs a member; the route has three next hops again and
    the rings agree; how long each took goes to the figures."""
    start = time.time()
    action()
    full = wait_for("three next hops again", lambda: full_route(fleet), 60, fleet.explain)
    agreed = wait_for("rings identical and settled again", Settled(fleet).probe(), 60,
                      fleet.explain)
    FIGURES.setdefault(label, {})
    FIGURES[label]["restore_to_three_next_hops_s"] = round(full - start, 3)
    FIGURES[label]["restore_to_rings_identical_settled_s"] = round(agreed - start, 3)


def test_kill9_member_under_streams(lab: EcmpLab, fleet: Fleet) -> None:
    if not HAS_ALIVE:
        pytest.skip("needs bgp.alive_interface: with `hpclb run` and the data plane "
                    "killed and BIRD alive, nothing withdraws the route before the hold "
                    "time would (and BIRD keeps the session up)")
    app = fleet.apps["lba"]
    dp_pid = app.dataplane_pid()

    def kill_both() -> None:
        app.kill()
        os.kill(dp_pid, signal.SIGKILL)

    def restart() -> None:
        app.stop()
        app.start(timeout_s=60)

    try:
        under_streams(fleet, "lba", kill_both, "kill9", duration_s=12.0)
        assert not Path(f"/proc/{dp_pid}").exists()
        assert app.speaker is not None and app.speaker.poll() is None, "its BIRD lives on"
    finally:  # the next steps need the three members
        restore(fleet, "kill9", restart)


def test_cut_link_under_streams(lab: EcmpLab, fleet: Fleet) -> None:
    try:
        figures = under_streams(fleet, "lbb", lambda: lab.set_member_link("lbb", up=False),
                                "link_cut", duration_s=12.0 if HAS_BFD else 16.0)
        figures["detected_by"] = "bfd" if HAS_BFD else f"hold time {HOLD_TIME_S} s"
    finally:
        restore(fleet, "link_cut", lambda: lab.set_member_link("lbb", up=True))


NFT_TABLE = "hpclb_ecmp_test"


def test_member_without_backends_withdraws(lab: EcmpLab, fleet: Fleet) -> None:
    """lbc's probes blocked (nft in its namespace, output hook: its own
    packets only, not what XDP forwards): every backend is down for lbc, which
    withdraws; the others keep their next hops throughout."""
    wait_for("the route through the three members", lambda: full_route(fleet), 60,
             fleet.explain)
    rule = (f"add table inet {NFT_TABLE}\n"
            f"add chain inet {NFT_TABLE} out {{ type filter hook output priority 0; }}\n"
            f"add rule inet {NFT_TABLE} out tcp dport {LAB_PORT} drop\n")
    others = fleet.addresses("lba", "lbb")
    with RouteWatch(fleet.router, gone=next(iter(fleet.addresses("lbc")))) as watch:
        try:
            blocked = time.time()
            lab.exec("lbc", ["nft", "-f", "-"], input=rule)
            gone = wait_for("lbc's next hop withdrawn", lambda: fleet.router.next_hops(ROUTE)
                            == others, 30, fleet.explain)
            status = fleet.apps["lbc"].wait_status(
                lambda s: any(a["address"] == LAB_VIP and a["state"] == "withdrawn"
                              for a in (s.get("bgp") or {}).get("announcements", [])),
                10, "lbc's VIP withdrawn")
            report = lab.run_client(LAB_VIP, LAB_PORT, connections=60, concurrency=10,
                                    timeout=5.0)
        finally:
            lab.exec("lbc", ["nft", "delete", "table", "inet", NFT_TABLE], check=False)
            unblocked = time.time()
        back = wait_for("lbc's next hop back", lambda: full_route(fleet), 60, fleet.explain)
    lost = [hops for hops in watch.hops_seen if not others <= hops]
    cause = next(a for a in status["bgp"]["announcements"] if a["address"] == LAB_VIP)
    FIGURES["no_backends"] = {"probes_blocked_to_route_withdrawn_s": round(gone - blocked, 3),
                              "unblocked_to_route_back_s": round(back - unblocked, 3),
                              "cause": cause.get("cause"), "reason": cause.get("reason")}
    print("no_backends", json.dumps(FIGURES["no_backends"]))
    assert cause.get("cause") == "no_backend", cause
    assert not lost, f"another member's next hop left the route: {lost[:3]}"
    assert report["ok"] == 60, report
