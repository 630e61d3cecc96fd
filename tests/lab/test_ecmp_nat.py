"""Lab: NAT backends behind the ECMP fleet (issue 15, part 3, NAT).

A topology of its own (``hpclb.lab.ecmp_nat.EcmpNatLab``): ``test_ecmp``'s
client behind a BIRD 2 router that spreads the VIP over three members by ECMP
(eBGP, ``merge paths on``, the kernel's L4 multipath hash, BFD 100 ms x 3);
each member is also a NAT gateway to a cluster network where the backends are,
with an SNAT address of its own (``nat.snat.addresses``: the one member-local
field of the NAT section): a backend answers the member that translated the
connection. The members' configurations are otherwise the fleet's (the same
hash_key, pools, ``fleet:`` section, ``bgp:`` with ``alive_interface`` on);
static weights, so the rings never change during the run.

In order (one fleet for the module):

1. new connections (long-lived streams) spread over the three members, all
   are answered, and the backends see, for each, the SNAT address of the member
   the router sent it through, never the client;
2. kill -9 of lba's `hpclb run` and data plane under long-lived streams (its
   BIRD lives; the liveness interface goes with the data plane and the route
   loses lba's next hop). Every stream the router did *not* move (the same
   member before and after, from a capture per member) is answered to its end
   by its first backend. A stream the router moved (lba's, and those the
   router's hash-threshold split moves between the two survivors) reaches a
   member without its translation: that member opens one of its own, with its
   own SNAT address, a tuple the backend has no socket for, and the backend's
   reset comes back to the client. That is checked where it is deterministic
   (each moved stream ended with a reset; each taking member opened at least
   one new translation per stream it took), and how many broke is reported (printed,
   written to $HPCLB_ECMP_NAT_FIGURES when set), never asserted as a count.
   New connections after the failure are all served.
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
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hpclb.lab.appliance import LAB_PORT, LAB_VIP
from hpclb.lab.ecmp import EcmpRouter, member_rings, ring_differences, tools_missing
from hpclb.lab.ecmp_nat import MEMBER_SNAT, SNAT_PORTS, EcmpNatLab, EcmpNatMember, NatFlowCapture
from hpclb.lab.topology import Lab, default_pass_obj

from .fleet_lab import POLL_S, ROUTE, RouteWatch, member_local
from .polling import held_at

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="lab tests need root (network namespaces, veth, XDP)"),
    pytest.mark.skipif(bool(tools_missing()),
                       reason=f"the ECMP lab needs {', '.join(tools_missing())} "
                              "(Debian packages bird2, tcpdump, iproute2, nftables)"),
]

RING = f"{LAB_VIP}:{LAB_PORT}/6"
BACKENDS = ("b1", "b2", "b3")
WEIGHTS = dict.fromkeys(BACKENDS, 1.0)
HOLD_TIME_S = 3
BFD_INTERVAL_MS, BFD_MULTIPLIER = 100, 3
PROBE = {"kind": "tcp", "port": LAB_PORT, "interval_s": 0.5, "timeout_s": 0.5, "rise": 2,
         "fall": 3, "damping": {"enabled": False}}
FLEET_WINDOW = 8
SPREAD_STREAMS = 90
STREAMS = 150
STREAM_TIMEOUT_S = 8.0
SNAT_LOW, SNAT_HIGH = (int(p) for p in SNAT_PORTS.split("-"))
FIGURES: dict[str, Any] = {"conditions": {
    "members": 3, "backends": 3, "mode": "nat, SNAT per member", "weights": "static",
    "dataplane": "xdp native, veth",
    "router": "BIRD 2, kernel protocol merge paths on, fib_multipath_hash_policy=1",
    "hold_time_s": HOLD_TIME_S, "bfd": f"{BFD_INTERVAL_MS} ms x {BFD_MULTIPLIER}",
    "alive_interface": True, "tcp_streams": STREAMS, "stream_line_interval_s": 1.0,
    "route_poll_s": POLL_S, "host": f"{os.cpu_count()} CPUs shared with other lab tests"}}


@dataclass
class NatFleet:
    lab: EcmpNatLab
    router: EcmpRouter
    apps: dict[str, EcmpNatMember]
    workdir: Path

    def explain(self) -> str:
        parts = [f"router protocols:\n{self.router.birdc('show', 'protocols')}",
                 f"router route: {self.router.route(ROUTE)!r}",
                 f"router BIRD log:\n{self.router.log_text()[-1500:]}"]
        for m, app in self.apps.items():
            parts.append(f"--- {m} hpclb run:\n{app.log_text()[-1500:]}\n--- {m} BIRD:\n"
                         f"{app.speaker_log()[-800:]}")
        return "\n".join(parts)

    def addresses(self, *members: str) -> set[str]:
        return {self.lab.ip_of(m) for m in members}

    def full_route(self) -> bool:
        return self.router.next_hops(ROUTE) == self.addresses(*self.lab.members)


def wait_for(what: str, predicate: Callable[[], Any], timeout_s: float,
             explain: Callable[[], str] | None = None) -> float:
    """Poll until ``predicate()``; the wall-clock time it first held (the
    captures' timestamps are wall clock)."""
    return held_at(what, predicate, timeout_s, POLL_S, explain, clock=time.time)


@pytest.fixture(scope="module")
def lab() -> Iterator[EcmpNatLab]:
    with EcmpNatLab(prefix=f"n{uuid.uuid4().hex[:6]}", backends=len(BACKENDS),
                    peer_xdp_pass=default_pass_obj()) as lab:
        for i in range(1, len(BACKENDS) + 1):
            lab.start_backend(i, LAB_PORT)
        yield lab


def rings_agree(fleet: NatFleet) -> bool:
    try:
        rings = {m: member_rings(app) for m, app in fleet.apps.items()}
    except Exception:  # a data plane not answering yet
        return False
    return (not ring_differences(rings)
            and len(set(rings["lba"][RING]) - {None}) == len(BACKENDS))


@pytest.fixture(scope="module")
def fleet(lab: EcmpNatLab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatFleet]:
    base = tmp_path_factory.mktemp("ecmp-nat")
    router = EcmpRouter(lab, base, hold_time_s=HOLD_TIME_S,
                        bfd=(BFD_INTERVAL_MS, BFD_MULTIPLIER))
    apps: dict[str, EcmpNatMember] = {}
    f = NatFleet(lab, router, apps, base)
    bgp = {"bfd": {"enabled": True, "interval_ms": BFD_INTERVAL_MS,
                   "multiplier": BFD_MULTIPLIER}}
    fleet_section = {"window": FLEET_WINDOW,
                     "members": [f"{lab.prefix}-{m}" for m in lab.members]}
    started = time.time()
    try:
        for m in lab.members:
            (base / m).mkdir()
            apps[m] = EcmpNatMember(lab, m, base / m, WEIGHTS, dataplane="xdp", probe=PROBE,
                                    hold_time_s=HOLD_TIME_S, bgp=bgp, fleet=fleet_section)
            problem = apps[m].config_problem()
            if problem is not None:
                pytest.skip(f"this build's configuration refuses a NAT fleet member: {problem}")
        router.start()
        with concurrent.futures.ThreadPoolExecutor(len(apps)) as pool:
            for fut in [pool.submit(app.start, 90.0) for app in apps.values()]:
                fut.result()
        capabilities = apps["lba"].client.hello().get("capabilities", [])
        if "nat" not in capabilities:
            pytest.skip(f"the XDP data plane has no NAT mode: {capabilities}")
        for app in apps.values():
            app.start_speaker()
        full = wait_for("the route through the three members", f.full_route, 60, f.explain)
        agreed = wait_for("the three members' rings identical, every backend in them",
                          lambda: rings_agree(f), 60, f.explain)
        FIGURES["start"] = {"start_to_three_next_hops_s": round(full - started, 3),
                            "start_to_rings_identical_s": round(agreed - started, 3)}
        yield f
    finally:
        for app in apps.values():
            app.stop()  # while its speaker runs: the withdrawal on stop reaches it
        for app in apps.values():
            app.stop_speaker()
        router.stop()
        if out := os.environ.get("HPCLB_ECMP_NAT_FIGURES"):
            Path(out).write_text(json.dumps(FIGURES, indent=1) + "\n")
        print("ECMP NAT fleet in the lab:", json.dumps(FIGURES))


def start_streams(lab: EcmpNatLab, ready: Path, count: int, duration_s: float
                  ) -> subprocess.Popen[str]:
    return lab.popen("cli", [sys.executable, "-m", "hpclb.lab.node", "streams", "--vip",
                             LAB_VIP, "--port", str(LAB_PORT), "--count", str(count),
                             "--interval-ms", "1000", "--duration", str(duration_s),
                             "--timeout", str(STREAM_TIMEOUT_S), "--open-over", "2",
                             "--ready-file", str(ready), "--json"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def backend_peers(lab: EcmpNatLab) -> dict[str, list[tuple[str, int]]]:
    """Per backend, the (address, port) of every established connection to
    LAB_PORT: whom the backend sees."""
    out: dict[str, list[tuple[str, int]]] = {}
    for i, name in enumerate(BACKENDS, 1):
        text = lab.exec(f"b{i}", ["ss", "-Htn", "state", "established",
                                  f"( sport = :{LAB_PORT} )"]).stdout
        out[name] = [(addr, int(port)) for addr, _, port in
                     (line.split()[-1].rpartition(":") for line in text.splitlines())]
    return out


def carriers(flows: dict[str, dict[int, list[float]]], before: float | None = None
             ) -> dict[int, set[str]]:
    """Per client source port, the members the router sent its frames to
    (before ``before`` when given)."""
    out: dict[int, set[str]] = {}
    for m, f in flows.items():
        for port, times in f.items():
            if before is None or any(t <= before for t in times):
                out.setdefault(port, set()).add(m)
    return out


def test_nat_connections_spread_and_backends_see_each_members_snat(
        lab: EcmpNatLab, fleet: NatFleet) -> None:
    configs = [member_local(fleet.apps[m].config()) for m in lab.members]
    assert configs[0] == configs[1] == configs[2]
    assert fleet.full_route(), fleet.explain()
    ready = fleet.workdir / "spread.ready"
    capture = NatFlowCapture(lab, lab.members, LAB_VIP, fleet.workdir)
    capture.start()
    proc: subprocess.Popen[str] | None = None
    try:
        proc = start_streams(lab, ready, SPREAD_STREAMS, 5.0)
        wait_for("every stream opened", ready.exists, 30)
        time.sleep(0.5)  # the last ones' handshakes completed at the backends
        peers = backend_peers(lab)
        report = Lab.wait_json(proc, timeout=60)
    finally:
        if proc is not None and proc.poll() is None:
            lab.stop_process(proc)
        capture.stop()
    flows = {m: capture.flows(m) for m in lab.members}
    carried = carriers(flows)
    streams = report["streams"]
    member_of = {st["port"]: next(iter(carried.get(st["port"], {"?"}))) for st in streams}
    snat_member = {v: k for k, v in MEMBER_SNAT.items()}
    # Per (backend, member): streams by the client's report and the capture,
    # connections by what the backends see (the member whose SNAT address).
    expected = Counter((st["backends"][0], member_of[st["port"]]) for st in streams
                       if st["backends"])
    seen = Counter((b, snat_member.get(addr, addr)) for b, ps in peers.items()
                   for addr, _ in ps if addr in snat_member)
    shares = {m: round(sum(1 for v in member_of.values() if v == m) / len(streams), 3)
              for m in lab.members}
    FIGURES["spread"] = {"streams": len(streams), "stream_share_per_member": shares,
                         "backend_counts": dict(Counter(st["backends"][0] for st in streams
                                                        if st["backends"])),
                         "backend_peers_by_member": {f"{b}<-{m}": n
                                                     for (b, m), n in sorted(seen.items())}}
    print("spread", json.dumps(FIGURES["spread"]))
    assert report["opened"] == SPREAD_STREAMS, report
    assert not [st for st in streams if st["error"] or len(st["backends"]) != 1], streams
    assert not [p for p, ms in carried.items() if len(ms) > 1], \
        "a connection crossed two members with the route unchanged"
    assert all(s >= 0.1 for s in shares.values()), shares
    assert {st["backends"][0] for st in streams} == set(BACKENDS)
    # The backends see SNAT addresses (never the client), each connection
    # from the member the router sent it through, ports from the range.
    all_peers = [p for ps in peers.values() for p in ps]
    assert not [p for p in all_peers if p[0] == lab.ip_of("cli")], peers
    assert seen == expected, (seen, expected)
    assert all(SNAT_LOW <= port <= SNAT_HIGH for addr, port in all_peers
               if addr in snat_member), peers


def conn_new(app: EcmpNatMember) -> int:
    return int(app.client.stats()["counters"]["conn_new"])


def error_kind(error: str | None) -> str:
    """A stream's error as "reset" (an RST), "fin" (closed by the peer), its name."""
    if error is None:
        return "none"
    if error.startswith("reset") and "closed" in error:
        return "fin"
    return error.split(":", 1)[0]


def test_kill9_member_under_nat_streams(lab: EcmpNatLab, fleet: NatFleet) -> None:
    failed = "lba"
    survivors = [m for m in lab.members if m != failed]
    app = fleet.apps[failed]
    dp_pid = app.dataplane_pid()
    wait_for("the route through the three members", fleet.full_route, 60, fleet.explain)
    ready = fleet.workdir / "kill9.ready"
    capture = NatFlowCapture(lab, lab.members, LAB_VIP, fleet.workdir)
    capture.start()
    proc: subprocess.Popen[str] | None = None
    try:
        proc = start_streams(lab, ready, STREAMS, 12.0)
        wait_for("every stream opened", ready.exists, 30)
        opened = json.loads(ready.read_text())
        time.sleep(1.5)  # a line answered on each stream, through its member
        new_before = {m: conn_new(fleet.apps[m]) for m in survivors}
        with RouteWatch(fleet.router, lab.ip_of(failed)) as watch:
            injected = time.time()
            app.kill()
            os.kill(dp_pid, signal.SIGKILL)
            wait_for(f"the route without {failed}", lambda: watch.left_at is not None, 30,
                     fleet.explain)
            time.sleep(2.5)  # every stream sends a line a second: all moved by now
        new_after = {m: conn_new(fleet.apps[m]) for m in survivors}
        report = Lab.wait_json(proc, timeout=60 + 4 * STREAM_TIMEOUT_S)
    finally:
        if proc is not None and proc.poll() is None:
            lab.stop_process(proc)
        capture.stop()
    assert watch.left_at is not None
    moved_at = watch.left_at
    after_report = lab.run_client(LAB_VIP, LAB_PORT, connections=60, concurrency=10,
                                  timeout=5.0)
    flows = {m: capture.flows(m) for m in lab.members}
    before: dict[int, str] = {}
    after: dict[int, set[str]] = {}
    for port in {p for f in flows.values() for p in f}:
        lasts = [(max(t for t in flows[m][port] if t <= injected), m) for m in lab.members
                 if any(t <= injected for t in flows[m].get(port, []))]
        if lasts:
            before[port] = max(lasts)[1]
        # After the failure, not after the route was seen changed: polled every
        # POLL_S, the change is seen up to that late, and a moved stream sends
        # one segment to its new member and is reset.
        after[port] = {m for m in lab.members
                       if any(t > injected for t in flows[m].get(port, []))}
    streams = report["streams"]
    # Each stream's member before the failure and the members after it (the
    # failed one's XDP program forwards until the route changes). The router's
    # hash-threshold split moves some of the survivors' streams between them
    # too, not only the failed member's.
    stayed = [st for st in streams if before.get(st["port"]) in survivors
              and after[st["port"]] <= {before[st["port"]]}]
    of_failed = [st for st in streams if before.get(st["port"]) == failed]
    between = [st for st in streams if before.get(st["port"]) in survivors
               and not after[st["port"]] <= {before[st["port"]]}]
    unplaced = [st for st in streams if st["port"] not in before]
    moved = of_failed + between
    taken = Counter(m for st in moved for m in after[st["port"]] if m in survivors
                    and m != before[st["port"]])

    # When each moved stream reached its new member (its one segment there:
    # the reset answers it), after the failure.
    reached = sorted(min(t for m in after[st["port"]] - {before[st["port"]], failed}
                         for t in flows[m][st["port"]] if t > injected) - injected
                     for st in moved if after[st["port"]] - {before[st["port"]], failed})

    def broke(group: list[dict[str, Any]]) -> int:
        return sum(1 for st in group if st["error"])

    figures = {
        "streams": STREAMS, "streams_opened": opened["opened"],
        "bgp_convergence_s": round(moved_at - injected, 4),
        "streams_on_failed": len(of_failed), "streams_on_failed_broken": broke(of_failed),
        "streams_moved_between_survivors": len(between),
        "streams_moved_between_survivors_broken": broke(between),
        "streams_not_moved": len(stayed), "streams_not_moved_broken": broke(stayed),
        "streams_not_moved_changed_backend": sum(1 for st in stayed
                                                 if len(st["backends"]) > 1),
        "streams_not_seen_before_failure": len(unplaced),
        "error_kinds_of_moved": dict(Counter(error_kind(st["error"]) for st in moved)),
        "streams_taken_per_survivor": dict(taken),
        "moved_reached_new_member_after_failure_s": {
            "min": round(reached[0], 3) if reached else None,
            "median": round(reached[len(reached) // 2], 3) if reached else None,
            "max": round(reached[-1], 3) if reached else None},
        "new_translations_per_survivor": {m: new_after[m] - new_before[m] for m in survivors},
        "new_connections_after": {"ok": after_report["ok"],
                                  "failures": after_report["failures"]},
    }
    FIGURES["kill9"] = figures
    print("kill9", json.dumps(figures))
    assert opened["opened"] == STREAMS, opened
    assert lab.ip_of(failed) not in fleet.router.next_hops(ROUTE), fleet.explain()
    assert not Path(f"/proc/{dp_pid}").exists()
    assert app.speaker is not None and app.speaker.poll() is None, "its BIRD lives on"
    assert of_failed, "no stream went through the failed member: ECMP did not spread"
    assert stayed, "every stream moved: no survivor kept one"
    assert not unplaced, unplaced[:5]
    # Behaviour: a stream the router left on its member is untouched by the
    # other member's loss: answered to its end, by its first backend.
    unbroken = [st for st in stayed if st["error"] or len(st["backends"]) != 1]
    assert not unbroken, unbroken[:5]
    # The mechanism, where it is deterministic: a moved stream reaches a member
    # without its translation, which opens its own (a new SNAT tuple: at least
    # one new entry per stream it took) and the backend, which has no socket
    # for that tuple, resets it.
    assert all(new_after[m] - new_before[m] >= taken[m] for m in survivors), figures
    not_reset = [st for st in moved if error_kind(st["error"]) != "reset"]
    assert not not_reset, not_reset[:5]
    assert after_report["ok"] == 60 and after_report["failures"] == 0, after_report
