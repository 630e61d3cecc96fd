"""The agent's side of a fleet: ``--connect`` repeated delivers every message to
every appliance (real ZeroMQ, real CURVE, the real ``hpclb-agent run``), one
endpoint down delays none of the others, and the round trip to the endpoints'
hosts (hpclb.agent.echo, real ICMP on loopback) travels as ``fleet_rtt_ms``."""

from __future__ import annotations

import queue
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from hpclb.agent import Collector
from hpclb.agent import echo as agent_echo
from hpclb.agent.echo import EchoMeter, checksum, echo_request, parse_reply
from hpclb.agent.main import endpoint_host, parser
from tests.unit.test_telemetry_receiver import AGENT, TIMEOUT, Keys, make_keys, running


def test_connect_may_be_repeated_and_hosts_are_taken_from_it() -> None:
    args = parser().parse_args(["run", "--connect", "tcp://10.0.0.1:5557", "--connect",
                                "[fd00::2]:5557", "--node-id", "n1", "--server-key", "s",
                                "--key", "k"])
    assert args.connect == ["tcp://10.0.0.1:5557", "tcp://[fd00::2]:5557"]
    assert [endpoint_host(e) for e in args.connect] == ["10.0.0.1", "fd00::2"]
    assert not args.no_echo


def test_icmp_packets() -> None:
    req = echo_request(socket.AF_INET, 0x1234, 7)
    assert checksum(req) == 0  # a valid checksum sums to zero
    reply = bytes([0, 0]) + req[2:]
    assert parse_reply(socket.AF_INET, False, reply) == (0x1234, 7)
    ip_header = bytes([0x45]) + bytes(19)
    assert parse_reply(socket.AF_INET, True, ip_header + reply) == (0x1234, 7)
    assert parse_reply(socket.AF_INET, False, req) is None  # a request is no reply
    v6 = struct.pack("!BBHHH", 129, 0, 0, 9, 3) + b"x"
    assert parse_reply(socket.AF_INET6, False, v6) == (9, 3)
    assert parse_reply(socket.AF_INET6, False, b"\x81") is None


def test_echo_round_trip_on_loopback() -> None:
    meter = EchoMeter(["127.0.0.1", "[::1]", "name.invalid"])
    start = time.monotonic()
    rtt = meter.measure(0.3)
    # A figure, not a check: how long a round took here.
    print(f"echo round: {(time.monotonic() - start) * 1e3:.1f} ms, per host {meter.last}")
    if rtt is None:
        pytest.skip("no ICMP socket here (ping_group_range and no CAP_NET_RAW)")
    assert meter.last["name.invalid"] is None
    assert meter.last["127.0.0.1"] is not None and meter.last["::1"] is not None
    assert rtt > 0


def test_a_round_ends_at_its_deadline_whatever_came_back() -> None:
    """The round's budget is kept by the meter's clock: a clock already past
    the deadline after the round started lets no echo out, and the round
    reports no figure (not a late one)."""
    calls = iter(range(1_000_000))
    meter = EchoMeter(["127.0.0.1"], clock=lambda: 0.0 if next(calls) == 0 else 10.0)
    opened = meter._open(socket.AF_INET)
    if opened is None:
        pytest.skip("no ICMP socket here (ping_group_range and no CAP_NET_RAW)")
    opened[0].close()
    assert meter.measure(0.3) is None
    assert meter.last == {"127.0.0.1": None}


def test_refused_sockets_are_logged_once(monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    def refuse(*_a: object, **_k: object) -> socket.socket:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(agent_echo.socket, "socket", refuse)
    meter = EchoMeter(["127.0.0.1"])
    assert meter.measure(0.05) is None and meter.measure(0.05) is None
    assert len([r for r in caplog.records if "cannot open an ICMP socket" in r.message]) == 1


def test_agent_figures_of_its_own_come_first() -> None:
    msg = Collector(node_id="n1").collect({"fleet_rtt_ms": 0.25})
    assert msg.extra["fleet_rtt_ms"] == 0.25


def test_agent_publishes_to_every_endpoint(tmp_path: Path) -> None:
    """Three endpoints: two receivers and one where nothing listens. Both
    receivers get the same messages (same seq, time and fleet_rtt_ms), and the
    dead one does not hold them up."""
    if not AGENT.exists():
        pytest.skip(f"{AGENT} not installed (pip install -e .)")
    keys: Keys = make_keys(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # closed before the agent starts
    with running(keys) as rx1, running(keys) as rx2:
        proc = subprocess.Popen(
            [str(AGENT), "run", "--connect", rx1.endpoint, "--connect", dead, "--connect",
             rx2.endpoint, "--node-id", "n1", "--server-key", str(keys.root / "server.key"),
             "--key", str(keys.root / "n1.key_secret"), "--base-interval", "0.2",
             "--min-interval", "0.1", "--max-interval", "0.4"],
            stderr=subprocess.PIPE, text=True)
        try:
            got: list[dict[int, tuple[float, float | None]]] = [{}, {}]
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline and not (set(got[0]) & set(got[1])):
                for i, rx in enumerate((rx1, rx2)):
                    try:
                        m, who = rx.got.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    assert who.node == "n1"
                    got[i][m.seq] = (m.time, m.extra.get("fleet_rtt_ms"))
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    common = set(got[0]) & set(got[1])
    assert common, f"no message reached both receivers: {got}"
    for seq in common:
        assert got[0][seq] == got[1][seq]  # the very same message
    rtts = [r for seq in common for r in (got[0][seq][1],)]
    print(f"fleet_rtt_ms on the messages: {rtts}")
    if "cannot open an ICMP socket" not in err:
        assert all(r is not None and r > 0 for r in rtts)
    assert dead in err and "127.0.0.1" in err  # the log names every endpoint
