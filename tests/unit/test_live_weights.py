"""The control plane's view of each backend: health from probes and
heartbeats (backend_health.py) and the weight it publishes (live_weights.py),
driven with explicit times."""

from __future__ import annotations

import pytest

from hpclb.config import parse_config
from hpclb.controller.backends import STATIC_RAMP_STEPS, LiveWeights, static_ramp
from hpclb.health.backend import BackendHealth
from hpclb.telemetry.message import TelemetryMessage

CONFIG = """\
appliance: {name: gw, interfaces: {ingress: eth0}, hash_key: 000102030405060708090a0b0c0d0e0f,
            management_address: 198.18.0.3}
telemetry: {server_key: /etc/hpclb/server.key_secret, allow_dir: /etc/hpclb/agents,
            missed_heartbeats: 3}
pools:
  cpu:
    weights: dynamic
    policy: {cpu: 1, mem: 0, net: 0, alpha: 1, step: 0, max_rate: null, slow_start_s: 10,
             stale_after_s: 1000}
    backends:
      - {name: c1, address: 198.18.0.11, weight: 2}
      - {name: c2, address: 198.18.0.12}
  web:
    policy: {slow_start_s: 8}
    backends:
      - {name: w1, address: 198.18.0.21, weight: 3}
"""


def msg(node: str, cpu: float, t: float, interval: float = 1.0) -> TelemetryMessage:
    return TelemetryMessage(node=node, time=t, seq=int(t), interval_s=interval, cpu_load=cpu,
                            mem_used=1.0, mem_total=4.0, numa_nodes=1)


# --- health -------------------------------------------------------------------------


def test_probe_verdicts_change_health_once_each() -> None:
    h = BackendHealth()
    assert h.is_up("b") and h.up_since("b") is None  # unknown: up, never came back
    down = h.probe("b", False, "3 consecutive failures", 10.0)
    assert down is not None and (down.up, down.time) == (False, 10.0)
    assert h.probe("b", False, "again", 11.0) is None
    up = h.probe("b", True, "2 consecutive successes", 12.0)
    assert up is not None and up.up and h.up_since("b") == 12.0


def test_missed_heartbeats_take_a_backend_down_until_the_next_one() -> None:
    h = BackendHealth(missed=3)
    assert h.expire(mono=100.0, wall=0.0) == []  # never heard: not held to heartbeats
    assert h.heartbeat("b", 2.0, mono=100.0, wall=1.0) is None
    assert h.expire(mono=105.9, wall=2.0) == []  # 3 x 2 s not yet over
    [change] = h.expire(mono=106.1, wall=3.0)
    assert not change.up and "missed 3 heartbeats" in change.reason
    assert h.expire(mono=200.0, wall=4.0) == []  # reported once
    back = h.heartbeat("b", 2.0, mono=201.0, wall=5.0)
    assert back is not None and back.up and back.reason == "agent heard again"


def test_up_needs_both_witnesses() -> None:
    h = BackendHealth(missed=1)
    h.heartbeat("b", 1.0, mono=0.0, wall=0.0)
    h.probe("b", False, "timeout", 1.0)
    assert h.expire(mono=5.0, wall=5.0) == []  # already down: no second change
    assert h.heartbeat("b", 1.0, mono=6.0, wall=6.0) is None  # probes still say down
    assert not h.is_up("b")
    assert h.probe("b", True, "ok", 7.0) is not None and h.is_up("b")


# --- weights --------------------------------------------------------------------------


def test_static_ramp_steps_up_to_one() -> None:
    assert static_ramp(None, 5.0, 8.0) == 1.0
    assert static_ramp(0.0, 0.0, 8.0) == 1 / STATIC_RAMP_STEPS
    assert static_ramp(0.0, 4.0, 8.0) == 0.5
    assert static_ramp(0.0, 8.0, 8.0) == 1.0
    assert static_ramp(0.0, 1.0, 0.0) == 1.0  # slow start off
    ramp = [static_ramp(0.0, t / 10, 8.0) for t in range(0, 81)]
    assert ramp == sorted(ramp) and len(set(ramp)) == STATIC_RAMP_STEPS


def test_dynamic_weight_is_configured_weight_times_capacity_left() -> None:
    live = LiveWeights(parse_config(CONFIG))
    accepted, change = live.telemetry(msg("c1", 0.25, 100.0), rtt_ms=1.0, mono=1.0, wall=100.0)
    assert accepted and change is None
    live.telemetry(msg("c2", 0.5, 100.0), rtt_ms=None, mono=1.0, wall=100.0)
    weights = {m.name: m.weight for m in live.members("cpu", 100.0)}
    assert weights == {"c1": pytest.approx(2 * 0.75, abs=1 / 256),
                       "c2": pytest.approx(0.5, abs=1 / 256)}
    # A static pool keeps its configured weight.
    assert [(m.name, m.weight) for m in live.members("web", 100.0)] == [("w1", 3.0)]


def test_garbage_telemetry_is_rejected_and_the_last_good_weight_kept() -> None:
    live = LiveWeights(parse_config(CONFIG))
    live.telemetry(msg("c2", 0.5, 100.0), None, 1.0, 100.0)
    before = live.members("cpu", 101.0)
    for i, bad in enumerate((float("nan"), -0.5, 1.5)):
        accepted, _ = live.telemetry(msg("c2", bad, 101.0 + i), None, 2.0, 103.0)
        assert not accepted
    assert live.members("cpu", 103.0) == before
    rejected = live.report(103.0)["samples_rejected"]["cpu"]  # type: ignore[index]
    assert sum(rejected.values()) == 3


def test_a_down_backend_weighs_nothing_and_ramps_back_up() -> None:
    live = LiveWeights(parse_config(CONFIG))
    live.telemetry(msg("c1", 0.0, 100.0), None, 1.0, 100.0)
    assert live.probe("c1", False, "3 consecutive failures", 100.5) is not None
    [c1, _] = live.members("cpu", 101.0)
    assert (c1.weight, c1.down) == (0.0, True)
    live.probe("c1", True, "2 consecutive successes", 102.0)
    ramp = [live.members("cpu", 102.0 + t)[0].weight for t in (0.0, 2.5, 5.0, 7.5, 10.0, 20.0)]
    assert ramp == sorted(ramp) and ramp[0] < 0.5 and ramp[-1] == 2.0, ramp
    # Static pools ramp too, in 1/16 steps over their own slow start.
    live.probe("w1", False, "down", 200.0)
    assert live.members("web", 200.0)[0].weight == 0.0
    live.probe("w1", True, "up", 201.0)
    assert live.members("web", 205.0)[0].weight == 1.5  # halfway through 8 s
    assert live.members("web", 209.5)[0].weight == 3.0


def test_reconfigure_forgets_departed_backends_and_restarts_changed_policies() -> None:
    live = LiveWeights(parse_config(CONFIG))
    live.telemetry(msg("c2", 0.5, 100.0), None, 1.0, 100.0)
    tracker = live.trackers["cpu"]
    live.reconfigure(parse_config(CONFIG.replace("      - {name: c2, address: 198.18.0.12}\n",
                                                 "")))
    assert live.trackers["cpu"] is tracker and "c2" not in tracker.nodes()
    live.reconfigure(parse_config(CONFIG.replace("cpu: 1, mem: 0", "cpu: 1, mem: 1")))
    assert live.trackers["cpu"] is not tracker
    live.reconfigure(parse_config(CONFIG.replace("weights: dynamic", "weights: static")))
    assert live.trackers == {}


def test_telemetry_from_a_node_outside_dynamic_pools_is_only_a_heartbeat() -> None:
    live = LiveWeights(parse_config(CONFIG))
    accepted, change = live.telemetry(msg("w1", 0.9, 100.0), None, 1.0, 100.0)
    assert (accepted, change) == (False, None)
    assert live.members("web", 100.0)[0].weight == 3.0
    [change] = live.expire(mono=10.0, wall=110.0)  # 3 x 1 s without the next one
    assert change.backend == "w1" and not change.up
    assert live.members("web", 110.0)[0].down


def test_heartbeats_are_only_missed_over_time_the_appliance_could_hear() -> None:
    """A local fault (stalled loop, paused receiver) makes an overdue agent
    unknown, not DOWN; once the appliance hears again, the agent has `missed`
    whole intervals from then before it is taken down."""
    h = BackendHealth(missed=3)
    h.heartbeat("b", 1.0, mono=100.0, wall=0.0)
    assert h.expire(mono=110.0, wall=1.0, heard_since=None) == []  # cannot hear now
    assert h.snapshot()["b"]["beats_unknown"] and h.is_up("b")
    assert h.expire(mono=111.0, wall=2.0, heard_since=110.5) == []  # 0.5 s of hearing
    assert h.snapshot()["b"]["beats_unknown"]
    [change] = h.expire(mono=113.6, wall=3.0, heard_since=110.5)  # 3.1 s of hearing
    assert not change.up and not h.snapshot()["b"]["beats_unknown"]
    assert h.heartbeat("b", 1.0, mono=114.0, wall=4.0) is not None
    h.expire(mono=118.0, wall=5.0, heard_since=None)
    h.heartbeat("b", 1.0, mono=118.5, wall=6.0)  # heard again: no longer unknown
    assert not h.snapshot()["b"]["beats_unknown"] and h.is_up("b")
