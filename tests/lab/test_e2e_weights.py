"""Lab end-to-end: weights follow the backends , on both data planes.

Client, appliance and three backends in network namespaces, as in test_e2e. Each
backend's server runs in a cgroup v1 of its own (cpu, cpuacct, memory; a CPU quota
of half a CPU, so one busy loop inside reads as a load of 1), and a real
``hpclb-agent run --cgroup`` in each backend namespace publishes that cgroup's
figures over CURVE to `hpclb run`, whose telemetry receiver binds the appliance's
lab address inside the appliance namespace. The pool is dynamic with a fast policy
(no smoothing, no rate limit, 6 s slow start) and a TCP probe every 0.3 s (rise 2,
fall 3, no damping), so what the tests wait for happens within seconds. Every test
runs on XDP and on DPDK; with DPDK the appliance's address lives on the forwarder's
exception TAP, so the probes and the telemetry cross the exception path.

The machine is a noisy 2-core box: the tests poll for conditions with generous
deadlines and assert on counts and directions, never on speed; the one bound on
time (a cut backend is out within fall x interval plus one push) carries slack.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpclb.controller.core import PUSH_INTERVAL_S
from hpclb.lab.appliance import LAB_PORT, LAB_TELEMETRY_PORT, LAB_VIP, LabAppliance
from hpclb.lab.topology import Lab, cgroup_controllers_missing, default_pass_obj

from .conftest import Keys

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="lab tests need root (network namespaces, veth, XDP, cgroups)"),
    pytest.mark.skipif(bool(cgroup_controllers_missing()),
                       reason="lab cgroups need the v1 cpu, cpuacct and memory controllers"),
]

BACKENDS = ("b1", "b2", "b3")
WEIGHTS = dict.fromkeys(BACKENDS, 1.0)
CPU_QUOTA = 0.5  # CPUs per backend cgroup: a busy loop inside is a load of 1
MEMORY_LIMIT = 256 << 20
AGENT_INTERVAL_S = 0.5
# CPU dominates the score so that a loaded backend's weight falls far (0.2 for a
# load of 1), alpha 1 and no rate limit so that it falls at the next sample.
POLICY = {"cpu": 0.8, "mem": 0.1, "net": 0.1, "alpha": 1.0, "step": 0.02, "max_rate": None,
          "floor": 0.05, "slow_start_s": 6.0, "stale_after_s": 60.0}
PROBE = {"kind": "tcp", "port": LAB_PORT, "interval_s": 0.3, "timeout_s": 0.25, "rise": 2,
         "fall": 3, "damping": {"enabled": False}}
IDLE_WEIGHT = 0.9  # every backend idle: capacity left ~1 (memory and RTT are small)
# A backend serving the tests' own traffic on a busy 2-core host: ~0.8 seen,
# where a saturated or slow-starting one is below 0.5.
NEAR_IDLE = 0.75
DOWN = 2  # lb_backend_state LB_BACKEND_DOWN, as the data plane's dump reports it
# What a loaded 2-core machine may add to the probe-and-push path of a cut backend.
SLACK_S = 3.0


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(prefix=f"w{uuid.uuid4().hex[:6]}", backends=3,
             peer_xdp_pass=default_pass_obj()) as lab:
        for i, name in enumerate(BACKENDS, 1):
            lab.create_cgroup(name, cpu_quota=CPU_QUOTA, memory_limit=MEMORY_LIMIT)
            lab.start_backend(i, LAB_PORT, udp=True, cgroup=name)
        lab.create_cgroup("rogue", cpu_quota=CPU_QUOTA)
        yield lab


@pytest.fixture
def agents() -> dict[str, subprocess.Popen[str]]:
    """The real agents of the test's appliance, by backend (filled by ``appliance``)."""
    return {}


@pytest.fixture
def appliance(lab: Lab, keys: Keys, tmp_path: Path, dataplane: str,
              agents: dict[str, subprocess.Popen[str]]) -> Iterator[LabAppliance]:
    """`hpclb run` with a dynamic pool, probes and telemetry, and one agent per
    backend; yields once every backend is up with an idle weight."""
    telemetry = {"bind": f"tcp://{lab.ip_of('lb')}:{LAB_TELEMETRY_PORT}",
                 "server_key": str(keys.secret("server")), "allow_dir": str(keys.allow)}
    with LabAppliance(lab, tmp_path, WEIGHTS, dataplane=dataplane, weights_mode="dynamic",
                      policy=POLICY, probe=PROBE, telemetry=telemetry) as app:
        try:
            for name in BACKENDS:
                agents[name] = start_agent(lab, app, keys, name, tmp_path)
            app.wait_status(lambda s: all(w >= IDLE_WEIGHT for w in weights(s).values())
                            and all(h["up"] for h in s["health"].values()),
                            timeout_s=60, what="idle weights")
            # ...and the data plane has them (the next push, within a second).
            wait_ring(app, lambda r: all(abs(v - 1 / 3) < 0.05 for v in r.values()))
            yield app
        finally:
            for agent in agents.values():  # before the receiver goes
                lab.stop_process(agent)


def start_agent(lab: Lab, app: LabAppliance, keys: Keys, name: str, logdir: Path, *,
                key: str | None = None, cgroup: str | None = None) -> subprocess.Popen[str]:
    return lab.start_agent(name, connect=app.telemetry_endpoint(),
                           server_key=keys.public("server"), key=keys.secret(key or name),
                           cgroup=cgroup or name, base_interval=AGENT_INTERVAL_S,
                           log=logdir / f"agent-{key or name}.log")


# --------------------------------------------------------------------------- helpers


def weights(status: dict[str, Any]) -> dict[str, float]:
    return dict(status["weights"]["lab"])


def udp_flows(lab: Lab, sports: str) -> dict[str, str]:
    return lab.udp_flows(LAB_VIP, LAB_PORT, sports)


def new_connections(lab: Lab, n: int = 600) -> dict[str, float]:
    """Shares of ``n`` new TCP connections (fresh source ports) per backend."""
    report = lab.run_client(LAB_VIP, LAB_PORT, connections=n, concurrency=20, timeout=5.0,
                            deadline=120.0)
    assert report["failures"] == 0, report["errors"]
    return {name: report["counts"].get(name, 0) / report["ok"] for name in BACKENDS}


def backend_ids(app: LabAppliance) -> dict[str, int]:
    return {f"b{bytes(b['addr'])[3] - 10}": b["id"] for b in app.client.dump()["backends"]}


def backend_states(app: LabAppliance) -> dict[str, int]:
    return {f"b{bytes(b['addr'])[3] - 10}": b["state"] for b in app.client.dump()["backends"]}


def ring_shares(app: LabAppliance) -> dict[str, float]:
    """Each backend's share of the TCP VIP's ring in the data plane."""
    ring = app.client.get_ring(0)
    return {name: float((ring == bid).sum()) / len(ring)
            for name, bid in backend_ids(app).items()}


def wait_ring(app: LabAppliance, predicate: Any, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll the data plane's ring until ``predicate(shares)``: weights reach it at
    the next push, at most PUSH_INTERVAL_S after the status file shows them."""
    deadline = time.monotonic() + timeout_s
    while not predicate(shares := ring_shares(app)):
        assert time.monotonic() < deadline, shares
        time.sleep(0.1)
    return shares


def rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in sorted(d.items())}


# --------------------------------------------------------------------------- tests


def test_loaded_backend_gets_fewer_new_connections_established_ones_stay(
        lab: Lab, appliance: LabAppliance) -> None:
    """A busy loop in b1's cgroup: b1's weight falls (its agent reports the
    cgroup's CPU against its quota), its share of the ring and of new connections
    falls, b2's and b3's rise; UDP flows and a TCP connection established before
    stay on their backends."""
    flows_before = udp_flows(lab, "27000-27299")
    assert set(flows_before.values()) == set(BACKENDS)
    ring_before = ring_shares(appliance)
    share_before = new_connections(lab)
    stream = lab.start_stream(LAB_VIP, LAB_PORT, interval_ms=100, duration=10.0, timeout=5.0)
    busy = lab.start_busy_loop("b1", "b1")
    try:
        # Load 1 of the quota: score 0.8 + a little memory and RTT, weight ~0.2.
        loaded = appliance.wait_status(lambda s: weights(s)["b1"] < 0.35, timeout_s=30,
                                       what="b1's weight below 0.35")
        ring_after = wait_ring(appliance, lambda r: r["b1"] < 0.2)
        share_after = new_connections(lab)
        flows_after = udp_flows(lab, "27000-27299")
        during = appliance.status()
    finally:
        lab.stop_process(busy)
    stream_report = lab.wait_json(stream, timeout=60)
    print(f"\nweights loaded: {rounded(weights(loaded))}, {rounded(weights(during))}; "
          f"ring {rounded(ring_before)} -> {rounded(ring_after)}; "
          f"new connections {rounded(share_before)} -> {rounded(share_after)}")

    w = weights(loaded)
    # b2 and b3 serve the stream meanwhile (0.5 CPU quota each): ~0.8 when the
    # host is busy, ~0.97 when it is quiet; b1 is far below either way.
    assert w["b1"] < 0.35 and min(w["b2"], w["b3"]) >= 0.6, w
    assert w["b1"] < 0.5 * min(w["b2"], w["b3"]), w
    w = weights(during)  # after 600 connections: b2 and b3 worked a little too
    assert w["b1"] < 0.5 and w["b1"] < min(w["b2"], w["b3"]), w
    assert ring_after["b1"] < ring_before["b1"] - 0.1, (ring_before, ring_after)
    assert share_after["b1"] < share_before["b1"] - 0.1, (share_before, share_after)
    for name in ("b2", "b3"):
        assert ring_after[name] > ring_before[name], (ring_before, ring_after)
        assert share_after[name] > share_before[name], (share_before, share_after)
    assert flows_after == flows_before, "established UDP flows moved"
    assert stream_report["errors"] == [], stream_report
    assert len(stream_report["distinct"]) == 1, "the TCP connection changed backend"
    assert len(stream_report["names"]) >= 30


def test_cut_backend_is_out_within_fall_intervals_its_flows_move_nothing_else(
        lab: Lab, appliance: LabAppliance) -> None:
    """b2's link goes down: the data plane holds it DOWN within fall x interval
    (plus a probe's timeout and one push); no new connection reaches it; its UDP
    flows are answered by the others; every other flow stays where it was."""
    flows_before = udp_flows(lab, "28000-28299")
    on_b2 = {p for p, name in flows_before.items() if name == "b2"}
    assert on_b2 and len(on_b2) < len(flows_before)
    bound = PROBE["fall"] * PROBE["interval_s"] + PROBE["timeout_s"] + PUSH_INTERVAL_S
    cut = time.monotonic()
    lab.set_backend_link(2, up=False)
    try:
        while backend_states(appliance)["b2"] != DOWN:
            assert time.monotonic() - cut < 30, appliance.log_text()
            time.sleep(0.02)
        out_after = time.monotonic() - cut
        status = appliance.wait_status(lambda s: not s["health"]["b2"]["up"], timeout_s=10,
                                       what="b2 down in the status")
        shares = new_connections(lab, 300)
        flows_after = udp_flows(lab, "28000-28299")
    finally:
        lab.set_backend_link(2, up=True)
    print(f"\nb2 DOWN in the data plane {out_after:.2f}s after the cut (fall x interval "
          f"{PROBE['fall'] * PROBE['interval_s']:.1f}s, bound with timeout and one push "
          f"{bound:.2f}s); health {status['health']['b2']}; new connections {rounded(shares)}")

    assert out_after <= bound + SLACK_S, (out_after, bound)
    assert weights(status)["b2"] == 0.0
    assert shares["b2"] == 0.0, shares
    moved = {p for p in flows_before if flows_after[p] != flows_before[p]}
    assert moved == on_b2, "exactly b2's flows moved"
    assert "b2" not in flows_after.values()


def test_returning_backend_reenters_after_rise_probes_and_ramps_up(
        lab: Lab, appliance: LabAppliance) -> None:
    """b2's server is killed (probes refused: DOWN after fall), then started
    again in its cgroup: b2 is up after `rise` successful probes, and its weight
    (status file) and its share of the data plane's ring climb over
    slow_start_s through intermediate values instead of jumping back."""
    lab.stop_backend(2)
    appliance.wait_status(lambda s: not s["health"]["b2"]["up"] and weights(s)["b2"] == 0.0,
                          timeout_s=30, what="b2 down")
    assert backend_states(appliance)["b2"] == DOWN
    assert "backend b2 is DOWN: probe: 3 consecutive failures" in appliance.log_text()
    lab.start_backend(2, LAB_PORT, udp=True, cgroup="b2")
    back = time.monotonic()
    samples: list[tuple[float, bool, float, float]] = []  # (t, up, weight, ring share)
    deadline = back + 4 * POLICY["slow_start_s"] + 20
    while True:
        status = appliance.status()
        up, w = status["health"]["b2"]["up"], weights(status)["b2"]
        samples.append((time.monotonic() - back, up, w, ring_shares(appliance)["b2"]))
        if up and w >= NEAR_IDLE:
            break
        assert time.monotonic() < deadline, (samples, appliance.log_text())
        time.sleep(0.2)
    ramp = [(t, w, r) for t, up, w, r in samples if up]
    t_up = ramp[0][0]
    t_full = ramp[-1][0]
    distinct = sorted({w for _, w, _ in ramp})
    ring_seq = [r for _, _, r in ramp]
    print(f"\nb2 up {t_up:.2f}s after its server restarted, full weight {t_full - t_up:.2f}s "
          f"later; weights {distinct}; ring share "
          f"{[round(r, 3) for r in dict.fromkeys(ring_seq)]}")

    assert "backend b2 is up: probe: 2 consecutive successes" in appliance.log_text()
    assert ramp[0][1] < 0.5, "b2 came back at a small weight"
    assert all(b[1] >= a[1] - 0.1 for a, b in itertools.pairwise(ramp)), ramp
    assert len([w for w in distinct if 0.05 < w < NEAR_IDLE]) >= 2, distinct
    assert t_full - t_up >= POLICY["slow_start_s"] / 2, "the weight ramped, not jumped"
    assert len(set(ring_seq)) >= 3 and ring_seq[-1] > ring_seq[0], ring_seq
    shares = new_connections(lab, 300)
    assert shares["b2"] > 0.15, shares


def test_agent_with_an_unknown_key_is_refused_counted_and_changes_nothing(
        lab: Lab, appliance: LabAppliance, keys: Keys, tmp_path: Path) -> None:
    """An agent with a key outside the allow-list, in b3's namespace, claiming to
    be b3 and reporting a saturated cgroup: its handshakes are refused and counted
    under its key id; b3's weight stays what its real agent says."""
    before = appliance.status()
    busy = lab.start_busy_loop("b3", "rogue")
    rogue = start_agent(lab, appliance, keys, "b3", tmp_path, key="rogue", cgroup="rogue")
    observed: list[float] = []
    try:
        def refused_twice(s: dict[str, Any]) -> bool:
            observed.append(weights(s)["b3"])
            return bool(s["telemetry"]["rejected_key_total"]
                        >= before["telemetry"]["rejected_key_total"] + 2)

        status = appliance.wait_status(refused_twice, timeout_s=30, what="two refusals")
        time.sleep(2 * AGENT_INTERVAL_S + 1)  # what an accepted message would have done
        status = appliance.status()
        observed.append(weights(status)["b3"])
    finally:
        lab.stop_process(rogue)
        lab.stop_process(busy)
    key_id = keys.key_id("rogue")
    tele = status["telemetry"]
    print(f"\nrefused: {tele['rejected_keys']} (total {tele['rejected_key_total']}), "
          f"handshakes {tele['handshakes']}; b3 weights seen {sorted(set(observed))}")

    assert tele["rejected_keys"].get(key_id, 0) >= 2, tele
    assert tele["handshakes"]["failed_auth"] >= 2, tele
    assert tele["accepted"] > before["telemetry"]["accepted"], "the real agents carry on"
    assert min(observed) >= NEAR_IDLE, observed
    assert status["health"]["b3"]["up"]
    assert "refused this agent's key" in (tmp_path / "agent-rogue.log").read_text()


# Sends telemetry as node NODE with an allow-listed key, one JSON list of CPU loads
# per line of stdin (NaN included), one message per load; prints what was sent.
CRAFTED_SENDER = r"""
import json, sys, time
import zmq.auth
from hpclb.agent.publisher import Publisher
from hpclb.telemetry.message import TelemetryMessage, encode

endpoint, server_key, key, node = sys.argv[1:5]
server_public, _ = zmq.auth.load_certificate(server_key)
public, secret = zmq.auth.load_certificate(key)
pub = Publisher(endpoint, server_public, public, secret)
deadline = time.monotonic() + 30
while not pub.connected and time.monotonic() < deadline:
    pub.poll_events()
    time.sleep(0.02)
print(json.dumps({"connected": pub.connected}), flush=True)
seq = 1 << 40
for line in sys.stdin:
    sent = []
    for cpu in json.loads(line):
        msg = TelemetryMessage(node=node, time=time.time(), seq=seq, interval_s=30.0,
                               cpu_load=cpu, mem_used=2e8, mem_total=1e9, numa_nodes=1)
        seq += 1
        sent.append(pub.send(encode(msg)))
    print(json.dumps({"sent": sent}), flush=True)
pub.close()
"""


def _reply(proc: subprocess.Popen[str], timeout: float = 30.0) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the sender did not answer"
    line = proc.stdout.readline()
    assert line, f"the sender exited: {proc.stderr.read() if proc.stderr else ''}"
    reply: dict[str, Any] = json.loads(line)
    return reply


def test_garbage_telemetry_is_rejected_and_the_last_good_weight_kept(
        lab: Lab, appliance: LabAppliance, keys: Keys,
        agents: dict[str, subprocess.Popen[str]]) -> None:
    """With b1's real agent paused, b1's key sends a good sample (CPU 0.5), then
    three with garbage CPU figures (NaN, -0.5, 1.7): each garbage one is counted
    by reason in samples_rejected, and b1 keeps the weight of the good one."""
    sender = lab.popen("b1", [sys.executable, "-c", CRAFTED_SENDER,
                              appliance.telemetry_endpoint(), str(keys.public("server")),
                              str(keys.secret("b1")), "b1"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    agent = agents["b1"]
    assert sender.stdin is not None
    try:
        assert _reply(sender) == {"connected": True}
        os.kill(agent.pid, signal.SIGSTOP)  # from now on b1's figures are ours
        sender.stdin.write("[0.5]\n")
        sender.stdin.flush()
        assert _reply(sender) == {"sent": [True]}
        good = appliance.wait_status(lambda s: 0.45 < weights(s)["b1"] < 0.7, timeout_s=30,
                                     what="b1 at the good sample's weight")
        time.sleep(1.5)  # a status rewrite later: settled
        good = appliance.status()
        sender.stdin.write(json.dumps([float("nan"), -0.5, 1.7]) + "\n")
        sender.stdin.flush()
        assert _reply(sender) == {"sent": [True, True, True]}
        before = good["samples_rejected"]["lab"]

        def counted(s: dict[str, Any]) -> bool:
            now = s["samples_rejected"]["lab"]
            return all(now[r] > before[r] for r in ("non_finite", "negative", "ratio_above_1"))

        after = appliance.wait_status(counted, timeout_s=30, what="three rejections")
        time.sleep(1.5)
        after = appliance.status()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.pid, signal.SIGCONT)
        sender.stdin.close()
        lab.stop_process(sender)
    rejected = after["samples_rejected"]["lab"]
    print(f"\nb1 weight after the good sample {weights(good)['b1']}, after the garbage "
          f"{weights(after)['b1']}; rejected {({k: v for k, v in rejected.items() if v})}; "
          f"malformed {after['telemetry']['malformed']}")

    for reason in ("non_finite", "negative", "ratio_above_1"):
        assert rejected[reason] == before[reason] + 1, (reason, before, rejected)
    assert after["telemetry"]["accepted"] >= good["telemetry"]["accepted"] + 3
    assert after["telemetry"]["malformed"] == good["telemetry"]["malformed"], \
        "well-formed messages: judged by the weights, not refused by the decoder"
    assert weights(after)["b1"] == weights(good)["b1"], "the last good weight is kept"
    assert after["health"]["b1"]["up"]
