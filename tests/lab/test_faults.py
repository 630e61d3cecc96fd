"""Lab fault suite: faults on the appliance's own side never take traffic down
and never mark a healthy backend down.

Client, appliance and three backends in network namespaces, as in test_e2e; a
static pool with a TCP probe every 0.5 s (rise 2, fall 3) and a real agent per
backend publishing heartbeats over CURVE (so missed heartbeats can take a
backend down), the metrics exporter on the management address. Each fault is
reproduced as an operator would meet it, with traffic through the VIP counted
sent against answered:

1. a start that fails after adopting the data plane (metrics port taken, key
   file missing): the adopted data plane keeps forwarding, 0 datagrams lost;
2. a reload that fails (key file missing, metrics port taken) with a weight
   change in it: refused, named, nothing applied;
3. 1,000+ idle and garbage connections to the telemetry port from the client
   network: no backend marked down, no stream broken, the status fresh;
4. a valid key flooding thousands of messages a second: rate limited and
   counted, its node never marked down;
6. a flapping backend held out by damping: logged once with its penalty and
   release time, in the status and the metrics.

(5, the DPDK restart window, is tests/lab/test_dpdk_restart.py.) Every test
that concerns the data path runs on both data planes.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpclb.lab.appliance import LAB_PORT, LAB_TELEMETRY_PORT, LAB_VIP, LabAppliance
from hpclb.lab.topology import Lab, default_pass_obj

from .conftest import AGENT_NAMES, Keys, agents_heard

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="lab tests need root (network namespaces, veth, XDP)")

BACKENDS = AGENT_NAMES
WEIGHTS = dict.fromkeys(BACKENDS, 1.0)
# A probe timeout (the interval) a loaded 2-core host can keep: with DPDK the probes cross the
# forwarder's exception path, and the worker shares its core with the faults'
# own load generators (a 0.25 s timeout saw all three backends time out at
# once under the 3,000 messages/s flood in one DPDK run of two).
PROBE: dict[str, Any] = {"kind": "tcp", "port": LAB_PORT, "interval_s": 0.5, "timeout_s": 0.5,
                         "rise": 2, "fall": 3, "damping": {"enabled": False}}
AGENT_INTERVAL_S = 0.5
METRICS_PORT = 9108
DOWN = 2  # LB_BACKEND_DOWN in the data plane's dump

# Holds IDLE idle and GARBAGE garbage-sending TCP connections to HOST:PORT for
# HOLD seconds, reopening those the server closes; prints a JSON report.
ATTACK = r"""
import json, os, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
n_idle, n_garbage, hold = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
stats = {"opened": 0, "closed_by_server": 0, "garbage_writes": 0, "refused": 0}
conns = []
def open_one(garbage):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex((host, port))
    stats["opened"] += 1
    conns.append((s, garbage))
for i in range(n_idle + n_garbage):
    open_one(i >= n_idle)
end = time.monotonic() + hold
while time.monotonic() < end:
    time.sleep(0.2)
    alive = []
    for s, garbage in conns:
        try:
            if s.recv(4096, socket.MSG_PEEK) == b"":
                raise ConnectionResetError
            s.recv(4096)
        except BlockingIOError:
            pass
        except ConnectionRefusedError:
            stats["refused"] += 1
            s.close()
            continue
        except OSError:
            stats["closed_by_server"] += 1
            s.close()
            continue
        if garbage:
            try:
                s.send(os.urandom(64))
                stats["garbage_writes"] += 1
            except OSError:
                pass
        alive.append((s, garbage))
    missing = len(conns) - len(alive)
    conns[:] = alive
    for i in range(missing):
        open_one(i % 2 == 1)
stats["open_at_end"] = len(conns)
print(json.dumps(stats), flush=True)
"""

# Sends telemetry as NODE with its allow-listed key at RATE messages/s for
# SECONDS seconds; prints how many were sent.
FLOOD = r"""
import json, sys, time
import zmq.auth
from hpclb.agent.publisher import Publisher
from hpclb.telemetry.message import TelemetryMessage, encode
endpoint, server_key, key, node = sys.argv[1:5]
rate, seconds = float(sys.argv[5]), float(sys.argv[6])
server_public, _ = zmq.auth.load_certificate(server_key)
public, secret = zmq.auth.load_certificate(key)
pub = Publisher(endpoint, server_public, public, secret)
deadline = time.monotonic() + 30
while not pub.connected and time.monotonic() < deadline:
    pub.poll_events()
    time.sleep(0.02)
sent, seq, start = 0, 1 << 41, time.monotonic()
while (now := time.monotonic()) < start + seconds:
    due = int((now - start) * rate)
    while sent < due:
        msg = TelemetryMessage(node=node, time=time.time(), seq=seq, interval_s=0.5,
                               cpu_load=0.1, mem_used=2e8, mem_total=1e9, numa_nodes=1)
        seq += 1
        sent += bool(pub.send(encode(msg)))
    time.sleep(0.001)
print(json.dumps({"connected": pub.connected, "sent": sent}), flush=True)
pub.close()
"""


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(prefix=f"f{uuid.uuid4().hex[:6]}", backends=3,
             peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT, udp=True)
        yield lab


def telemetry_section(keys: Keys) -> dict[str, Any]:
    # bind: the default, the appliance's management address (its lab address).
    return {"server_key": str(keys.secret("server")), "allow_dir": str(keys.allow),
            "handshake_timeout_s": 1.0}


def make_appliance(lab: Lab, keys: Keys, workdir: Path, dataplane: str,
                   probe: dict[str, Any] | None = None) -> LabAppliance:
    return LabAppliance(lab, workdir, WEIGHTS, dataplane=dataplane, probe=probe or PROBE,
                        telemetry=telemetry_section(keys), metrics=f":{METRICS_PORT}")


@pytest.fixture
def appliance(lab: Lab, keys: Keys, tmp_path: Path, dataplane: str) -> Iterator[LabAppliance]:
    """`hpclb run` with probes, agents and metrics; yields once every agent
    has been heard and every backend is up."""
    app = make_appliance(lab, keys, tmp_path, dataplane)
    with app, agents_heard(lab, app, keys, BACKENDS, AGENT_INTERVAL_S, tmp_path,
                           lambda s: s["telemetry"]["accepted"] >= 6):
        yield app


# --------------------------------------------------------------------------- helpers


def udpstream(lab: Lab, sports: str, seconds: float) -> subprocess.Popen[str]:
    """200 UDP flows at 2000 datagrams/s through the VIP, every one counted."""
    return lab.popen("cli", [sys.executable, "-m", "hpclb.lab.node", "udpstream", "--vip",
                             LAB_VIP, "--port", str(LAB_PORT), "--sports", sports, "--pps",
                             "2000", "--duration", str(seconds), "--linger", "2", "--json"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def host_udp_drops(lab: Lab) -> dict[str, int]:
    """UDP socket-buffer drops counted by the kernel in the client's and the backends'
    namespaces (Udp and Udp6 RcvbufErrors + SndbufErrors): losses of the simulated
    hosts, which share this machine's CPUs with the appliance, not of the balancer."""
    drops: dict[str, int] = {}
    for ns in ["cli", *(f"b{i}" for i in range(1, lab.backends + 1))]:
        total = 0
        for path in ("/proc/net/snmp", "/proc/net/snmp6"):
            text = lab.exec(ns, ["cat", path]).stdout
            total += udp_buffer_errors(text)
        drops[ns] = total
    return drops


def udp_buffer_errors(text: str) -> int:
    """RcvbufErrors + SndbufErrors of Udp (snmp: header line, value line) and Udp6
    (snmp6: one "Udp6RcvbufErrors N" per line)."""
    total = 0
    lines = text.splitlines()
    for head, values in itertools.pairwise(lines):
        if head.startswith("Udp: ") and values.startswith("Udp: ") and head != values:
            row = dict(zip(head.split()[1:], values.split()[1:], strict=False))
            total += int(row.get("RcvbufErrors", 0)) + int(row.get("SndbufErrors", 0))
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[0] in ("Udp6RcvbufErrors", "Udp6SndbufErrors"):
            total += int(fields[1])
    return total


def assert_all_answered(report: dict[str, Any], lab: Lab | None = None,
                        drops_before: dict[str, int] | None = None) -> None:
    """Every datagram answered, on one backend per flow. A loss is allowed only where
    the kernel counted at least as many socket-buffer drops on the simulated hosts
    during the stream (given ``lab`` and the counts from before it started)."""
    assert report["errors"] == {}, report
    assert report["sent"] > 1000, report
    lost = report["sent"] - report["answered"]
    if lost and lab is not None and drops_before is not None:
        after = host_udp_drops(lab)
        host_side = {ns: after[ns] - drops_before.get(ns, 0) for ns in after}
        print(f"\n{lost} datagrams lost; host socket-buffer drops during the stream "
              f"{host_side}")
        assert lost <= sum(host_side.values()), \
            f"{lost} datagrams lost, host socket-buffer drops only {host_side}"
    else:
        assert lost == 0, f"{lost} datagrams lost"
    moved = {p: names for p, names in report["flows"].items() if len(names) != 1}
    assert moved == {}, f"flows answered by more than one backend: {moved}"


def hold_port(lab: Lab, host: str, port: int) -> subprocess.Popen[str]:
    """A listener on host:port in the appliance's namespace (a port taken)."""
    proc = lab.popen("lb", [sys.executable, "-c",
                            "import socket, sys, time\n"
                            "s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2])))\n"
                            "s.listen(); print('ready', flush=True); time.sleep(600)",
                            host, str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def dataplane_states(app: LabAppliance) -> list[int]:
    return [b["state"] for b in app.client.dump()["backends"]]


def ring_of(app: LabAppliance) -> bytes:
    return bytes(app.client.get_ring(0).tobytes())


def watch(app: LabAppliance, seconds: float, samples: list[dict[str, Any]]) -> None:
    """Poll the status and the data plane for ``seconds``: every sample keeps
    whether all backends were up, how old the status was, the alarms."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s = app.status()
        samples.append({"age": time.time() - s["time"],
                        "down": sorted(n for n, h in s["health"].items() if not h["up"]),
                        "dp_down": sum(st == DOWN for st in dataplane_states(app)),
                        "alarms": [a["source"] for a in s.get("alarms", [])],
                        "telemetry": s.get("telemetry", {})})
        time.sleep(0.3)


# --------------------------------------------------------------------------- 1. failed start


def test_a_failed_start_after_adoption_leaves_the_data_plane_forwarding(
        lab: Lab, appliance: LabAppliance, keys: Keys) -> None:
    """kill -9 `hpclb run`; a new one with the metrics port taken cannot start
    (exit 1, says why), one with a key file missing neither (exit 2, names the
    file): the adopted data plane keeps forwarding every datagram and the TCP
    stream; a correct start then adopts it with a zero-change push."""
    pid = appliance.dataplane_pid()
    stream = lab.start_stream(LAB_VIP, LAB_PORT, interval_ms=100, duration=14.0, timeout=5.0)
    udp_drops = host_udp_drops(lab)
    udp = udpstream(lab, "30000-30199", 10.0)
    time.sleep(1.0)
    appliance.kill()
    taken = hold_port(lab, lab.ip_of("lb"), METRICS_PORT)
    try:
        res = appliance.run_to_exit()
    finally:
        lab.stop_process(taken)
    assert res.returncode == 1, res.stderr
    assert "cannot start" in res.stderr and f":{METRICS_PORT}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr

    config = copy.deepcopy(appliance.config())
    config["telemetry"]["server_key"] = str(keys.dir / "absent.key_secret")
    res = appliance.run_to_exit(config)
    assert res.returncode == 2, res.stderr
    assert "telemetry.server_key" in res.stderr and "absent.key_secret" in res.stderr
    assert os.path.exists(f"/proc/{pid}"), "the adopted data plane was stopped"
    assert appliance.dataplane_pid() == pid

    report = lab.wait_json(udp, timeout=60)
    appliance.start()  # the configuration that works: adopts, pushes nothing new
    stream_report = lab.wait_json(stream, timeout=60)
    log = appliance.log_text()
    print(f"\nUDP sent {report['sent']} answered {report['answered']}; TCP stream "
          f"{len(stream_report['names'])} lines, errors {stream_report['errors']}")
    assert_all_answered(report, lab, udp_drops)
    assert stream_report["errors"] == [] and len(set(stream_report["distinct"])) == 1
    assert "adopted running data plane" in log
    last_push = [line for line in log.splitlines() if "pushed tables" in line][-1]
    assert last_push.endswith("key=same backends=0 vips=0 vips_deleted=0 full_rings=0 "
                              "patched_slots=0"), log


# --------------------------------------------------------------------------- 2. failed reload


def test_a_failed_reload_changes_nothing_and_says_why(
        lab: Lab, keys: Keys, tmp_path: Path) -> None:
    """A reload whose telemetry key file is missing, and one whose new metrics
    port is taken, each with a weight change: "reload refused: <reason>", no
    push, the ring and the telemetry as they were; a good reload then applies."""
    with make_appliance(lab, keys, tmp_path, "xdp") as app:
        ring = ring_of(app)
        pushes = app.pushes()
        config = copy.deepcopy(app.config())
        config["pools"]["lab"]["backends"][2]["weight"] = 5.0
        config["telemetry"]["server_key"] = str(keys.dir / "absent.key_secret")
        line = app.reload_refused(config)
        assert "absent.key_secret" in line, line

        config = copy.deepcopy(app.config())
        config["pools"]["lab"]["backends"][2]["weight"] = 5.0
        config["appliance"]["metrics"] = f":{METRICS_PORT + 1}"
        taken = hold_port(lab, lab.ip_of("lb"), METRICS_PORT + 1)
        try:
            line = app.reload_refused(config)
        finally:
            lab.stop_process(taken)
        assert f":{METRICS_PORT + 1}" in line, line
        time.sleep(1.5)  # a push would have happened by now
        assert app.pushes() == pushes and ring_of(app) == ring
        status = app.status()
        assert "Traceback" not in app.log_text_full()
        assert status["weights"]["lab"]["b3"] == 1.0

        # Least privilege: the run folder is not for every local user.
        run_dir = tmp_path / "run"
        assert run_dir.stat().st_mode & 0o777 == 0o750
        assert app.status_path.stat().st_mode & 0o777 == 0o640

        app.set_weight("b3", 5.0)  # the same change, with nothing missing
        assert ring_of(app) != ring
        assert app.status()["weights"]["lab"]["b3"] == 5.0 or app.wait_status(
            lambda s: s["weights"]["lab"]["b3"] == 5.0, what="b3 at weight 5")


# --------------------------------------------------------------------------- 3. connections


def test_idle_and_garbage_connections_on_the_telemetry_port_change_nothing_but_counters(
        lab: Lab, appliance: LabAppliance) -> None:
    """1,200 idle and 300 garbage-sending connections from the client network to
    the telemetry port for 12 s, reopened as the receiver closes them: no
    backend marked down (status or data plane), the status rewritten on time,
    UDP and TCP through the VIP untouched; the receiver counted and alarmed.
    The port is not reachable through the VIP."""
    endpoint = appliance.telemetry_endpoint()
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    probe_vip = lab.exec("cli", [sys.executable, "-c",
                                 "import socket, sys\n"
                                 "s = socket.socket(); s.settimeout(3)\n"
                                 "print(s.connect_ex((sys.argv[1], int(sys.argv[2]))))",
                                 LAB_VIP, str(LAB_TELEMETRY_PORT)]).stdout.strip()
    assert probe_vip != "0", "the telemetry port answered on the VIP"

    before = appliance.status()
    stream = lab.start_stream(LAB_VIP, LAB_PORT, interval_ms=100, duration=16.0, timeout=5.0)
    udp_drops = host_udp_drops(lab)
    udp = udpstream(lab, "31000-31199", 14.0)
    attack = lab.popen("cli", [sys.executable, "-c", ATTACK, host, str(LAB_TELEMETRY_PORT),
                               "1200", "300", "12"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    samples: list[dict[str, Any]] = []
    watch(appliance, 14.0, samples)
    attack_report = lab.wait_json(attack, timeout=60)
    report = lab.wait_json(udp, timeout=60)
    stream_report = lab.wait_json(stream, timeout=60)
    after = appliance.wait_status(lambda s: s["telemetry"]["accepted"]
                                  > before["telemetry"]["accepted"] + 6, what="agents heard")
    conns = after["telemetry"].get("connections", {})
    print(f"\nattack {attack_report}; receiver {conns}; status age max "
          f"{max(s['age'] for s in samples):.2f}s; alarms seen "
          f"{sorted({a for s in samples for a in s['alarms']})}; UDP {report['sent']}/"
          f"{report['answered']}")

    assert attack_report["opened"] >= 1500, attack_report
    assert [s for s in samples if s["down"] or s["dp_down"]] == [], "a backend was marked down"
    assert max(s["age"] for s in samples) < 3.0, "the status went stale"
    assert_all_answered(report, lab, udp_drops)
    assert stream_report["errors"] == [] and len(set(stream_report["distinct"])) == 1
    assert all(h["up"] for h in after["health"].values())
    assert conns.get("handshake_timeouts", 0) + conns.get("listener_pauses", 0) > 0, conns
    assert "telemetry" in {a for s in samples for a in s["alarms"]}


# --------------------------------------------------------------------------- 4. flood


def test_a_valid_key_flooding_is_rate_limited_and_its_node_stays_up(
        lab: Lab, appliance: LabAppliance, keys: Keys) -> None:
    """b1's own key sends 3,000 messages a second for 8 s beside b1's agent:
    the excess is dropped and counted, b1 is never marked down, the status
    stays fresh, and traffic through the VIP is untouched."""
    before = appliance.status()
    udp_drops = host_udp_drops(lab)
    udp = udpstream(lab, "32000-32199", 10.0)
    flood = lab.popen("b1", [sys.executable, "-c", FLOOD, appliance.telemetry_endpoint(),
                             str(keys.public("server")), str(keys.secret("b1")), "b1",
                             "3000", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    samples: list[dict[str, Any]] = []
    watch(appliance, 10.0, samples)
    flood_report = lab.wait_json(flood, timeout=60)
    report = lab.wait_json(udp, timeout=60)
    after = appliance.status()
    limited = after["telemetry"].get("rate_limited", {}).get("b1", 0)
    print(f"\nflood {flood_report}; rate_limited {limited}; accepted "
          f"{after['telemetry']['accepted'] - before['telemetry']['accepted']}; status age "
          f"max {max(s['age'] for s in samples):.2f}s")

    assert flood_report["connected"] and flood_report["sent"] > 10_000, flood_report
    assert limited > flood_report["sent"] // 2, "the flood was not rate limited"
    assert [s for s in samples if s["down"] or s["dp_down"]] == [], "a backend was marked down"
    assert max(s["age"] for s in samples) < 3.0, "the status went stale"
    assert_all_answered(report, lab, udp_drops)


# --------------------------------------------------------------------------- 6. damping


def test_a_backend_held_out_by_damping_is_logged_shown_and_exported(
        lab: Lab, keys: Keys, tmp_path: Path) -> None:
    """b2's server stops and starts until flap damping holds it out: one log
    line names its penalty and release time, the status and the metrics show
    it held with that release time."""
    probe = dict(PROBE, damping={"enabled": True, "penalty": 1000, "suppress": 1500,
                                 "reuse": 800, "half_life_s": 60})
    with make_appliance(lab, keys, tmp_path, "xdp", probe=probe) as app:
        for _ in range(2):
            lab.stop_backend(2)
            app.wait_status(lambda s: not s["health"]["b2"]["up"], what="b2 down")
            lab.start_backend(2, LAB_PORT, udp=True)
            time.sleep(2.0)  # rise x interval and more: b2 answers again
        app.wait_status(
            lambda s: (s["health"]["b2"].get("damping") or {}).get("suppressed", False),
            timeout_s=20, what="b2 held by damping")
        time.sleep(1.5)
        status = app.status()
        text = lab.exec("lb", [sys.executable, "-c",
                               "import urllib.request, sys\n"
                               "print(urllib.request.urlopen(sys.argv[1], timeout=5)"
                               ".read().decode())",
                               f"http://{lab.ip_of('lb')}:{METRICS_PORT}/metrics"]).stdout
        damping = status["health"]["b2"]["damping"]
        held = [line for line in app.log_text_full().splitlines()
                if "backend b2" in line and "flap damping holds it out" in line]
        print(f"\nb2 damping {json.dumps(damping)}; log: {held}")
        assert not status["health"]["b2"]["up"]
        assert damping["release_at"] is not None and damping["release_at"] > time.time()
        assert damping["penalty"] >= 800
        assert len(held) == 1 and "release expected at" in held[0], held
        assert 'hpclb_backend_damped{backend="b2"} 1.0' in text
        assert "hpclb_backend_damping_release_timestamp_seconds" in text
