#!/usr/bin/env python3
"""Measure the telemetry receiver under abuse: idle or garbage TCP connections
that never authenticate, and a valid key flooding messages.

    .venv/bin/python perf/telemetry_abuse.py --idle 10000 --garbage 1000 --seconds 10
    .venv/bin/python perf/telemetry_abuse.py --flood 50000 --seconds 10

One process runs a ReceiverThread (its file-descriptor limit lowered to --fd-limit,
like the controller's) and a well-behaved agent (node n1, --agent-rate msgs/s);
the attacker and the flooder (node n2's key) are child processes, so that their
sockets and CPU are not counted here. Every TICK s the script samples this
process's open fds, the receiver's connection counters and trouble, and prints a
JSON report at the end: peak fds, n1's messages heard during the attack, the
receiver thread's CPU, pauses, timeouts, what the flood got through.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from hpclb.agent.publisher import Publisher
from hpclb.telemetry.message import TelemetryMessage, encode
from hpclb.telemetry.receiver import ReceiverThread, TelemetryReceiver

TICK = 0.1


def payload(node: str, seq: int) -> bytes:
    return encode(TelemetryMessage(node=node, time=time.time(), seq=seq, interval_s=1.0,
                                   cpu_load=0.5, mem_used=1e9, mem_total=4e9, numa_nodes=1))


# -- child roles ------------------------------------------------------------------


def attack(port: int, idle: int, garbage: int, seconds: float, churn: bool) -> None:
    """Open idle and garbage connections; with churn, replace each one closed."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sel = selectors.DefaultSelector()

    def dial(kind: str) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if kind == "garbage" else 0)
        sel.register(s, events, kind)

    for i in range(idle + garbage):
        dial("idle" if i < idle else "garbage")
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, mask in sel.select(0.1):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if mask & selectors.EVENT_WRITE:  # connected: send garbage once
                try:
                    s.send(os.urandom(64))
                except OSError:
                    pass
                sel.modify(s, selectors.EVENT_READ, key.data)
                continue
            try:
                data = s.recv(4096)  # the server's greeting, or its close
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                if churn:
                    dial(key.data)


def flood(endpoint: str, keydir: Path, rate: float, seconds: float) -> None:
    server_pub, _ = zmq.auth.load_certificate(keydir / "server.key")
    pub, sec = zmq.auth.load_certificate(keydir / "n2.key_secret")
    assert sec is not None
    p = Publisher(endpoint, server_pub, pub, sec, linger_ms=0, sndhwm=1000)
    data = payload("n2", 0)
    end = time.monotonic() + seconds
    step = 1.0 / rate if math.isfinite(rate) else 0.0  # inf: as fast as it can
    due = time.monotonic()
    while time.monotonic() < end:
        p.send(data)
        if step:
            due += step
            if (pause := due - time.monotonic()) > 0:
                time.sleep(pause)
    print(json.dumps({"sent": p.sent, "dropped": p.dropped}), flush=True)
    p.close()


# -- the measured side ---------------------------------------------------------------


def thread_cpu(name: str) -> float:
    """CPU seconds of this process's Python thread called ``name`` (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    for t in threading.enumerate():
        if t.name == name and t.native_id is not None:
            stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick
    return 0.0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    keydir = Path(tempfile.mkdtemp(prefix="hpclb-abuse-"))
    allow = keydir / "allow"
    allow.mkdir()
    for name in ("server", "n1", "n2"):
        zmq.auth.create_certificates(keydir, name)
    for name in ("n1", "n2"):
        (allow / f"{name}.key").write_bytes((keydir / f"{name}.key").read_bytes())
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (args.fd_limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    heard: queue.Queue[tuple[str, float]] = queue.Queue()
    rx = TelemetryReceiver("tcp://127.0.0.1:*", keydir / "server.key_secret", allow,
                           lambda m, i: heard.put((m.node, time.monotonic())),
                           handshake_timeout_s=args.handshake_timeout,
                           max_unauthenticated=args.max_unauthenticated,
                           max_rate_per_agent=args.max_rate)
    th = ReceiverThread(rx)
    th.start()
    endpoint = th.endpoint or ""
    port = int(endpoint.rsplit(":", 1)[1])
    stop = threading.Event()
    server_pub, _ = zmq.auth.load_certificate(keydir / "server.key")
    n1_pub, n1_sec = zmq.auth.load_certificate(keydir / "n1.key_secret")
    assert n1_sec is not None
    agent = Publisher(endpoint, server_pub, n1_pub, n1_sec, linger_ms=0)

    def agent_loop() -> None:
        seq = 0
        while not stop.is_set():
            agent.send(payload("n1", seq))
            seq += 1
            time.sleep(1.0 / args.agent_rate)

    threading.Thread(target=agent_loop, daemon=True).start()
    time.sleep(1.0)  # the agent connects before the attack
    fds_before = len(os.listdir("/proc/self/fd"))
    cpu0, pcpu0, t0 = thread_cpu("hpclb-telemetry"), time.process_time(), time.monotonic()
    children = []
    me = [sys.executable, __file__]
    if args.idle or args.garbage:
        children.append(subprocess.Popen(
            [*me, "attack", str(port), str(args.idle), str(args.garbage), str(args.seconds),
             "1" if args.churn else "0"], stdout=subprocess.PIPE, text=True))
    if args.flood:
        children.append(subprocess.Popen(
            [*me, "flood", endpoint, str(keydir), str(args.flood), str(args.seconds)],
            stdout=subprocess.PIPE, text=True))
    peak_fds, peak_pending, snaps, alarms = fds_before, 0, 0, set()
    while any(c.poll() is None for c in children):
        time.sleep(TICK)
        peak_fds = max(peak_fds, len(os.listdir("/proc/self/fd")))
        snap = th.snapshot()
        snaps += 1
        peak_pending = max(peak_pending, snap["counters"]["connections"]["pending"])
        if snap["alarm"]:
            alarms.add(snap["trouble"][1].split(":")[0])
    wall = time.monotonic() - t0
    cpu = thread_cpu("hpclb-telemetry") - cpu0
    outputs = [c.communicate()[0] for c in children]
    during = [node for node, _ in list(heard.queue)]
    process_cpu = time.process_time() - pcpu0
    time.sleep(args.handshake_timeout + 1.5)
    counters = th.counters()
    stop.set()
    agent.close()
    th.stop()
    flood_out = next((json.loads(line) for out in outputs for line in out.splitlines()
                      if line.startswith("{")), None)
    return {
        "args": vars(args), "wall_s": round(wall, 1), "fd_limit": args.fd_limit,
        "fds_before_attack": fds_before, "peak_fds": peak_fds,
        "peak_pending": peak_pending,
        "receiver_thread_cpu_pct": round(100 * cpu / wall, 1),
        "n1_heard_during": during.count("n1"),
        "n1_expected_during": round(args.agent_rate * wall),
        "process_cpu_pct": round(100 * process_cpu / wall, 1),
        "n2_accepted": during.count("n2"),
        "flood": flood_out, "alarm_kinds": sorted(alarms),
        "connections_after": counters["connections"],
        "handshakes": counters["handshakes"], "rate_limited": counters["rate_limited"],
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "attack":
        a = sys.argv[2:]
        attack(int(a[0]), int(a[1]), int(a[2]), float(a[3]), a[4] == "1")
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "flood":
        a = sys.argv[2:]
        flood(a[0], Path(a[1]), float(a[2]), float(a[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=int, default=0, help="idle connections")
    ap.add_argument("--garbage", type=int, default=0, help="connections sending garbage")
    ap.add_argument("--churn", action="store_true", help="reopen each one closed")
    ap.add_argument("--flood", type=float, default=0,
                    help="n2's messages/s (0: none, inf: as fast as it can)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--agent-rate", type=float, default=5.0, help="n1's messages/s")
    ap.add_argument("--fd-limit", type=int, default=1024, help="this process's RLIMIT_NOFILE")
    ap.add_argument("--handshake-timeout", type=float, default=2.0)
    ap.add_argument("--max-unauthenticated", type=int, default=256)
    ap.add_argument("--max-rate", type=float, default=20.0)
    print(json.dumps(measure(ap.parse_args()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
