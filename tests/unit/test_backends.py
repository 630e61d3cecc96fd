"""The control plane's view of each backend: health from probes and
heartbeats (health/backend.py), and the state and ring weight decided from
configuration, health, telemetry and MAC resolution (controller/backends.py),
driven with explicit times."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpclb.balancing.weights import slow_start_steps, to_us
from hpclb.config import parse_config
from hpclb.contract.tables import BackendState
from hpclb.controller import backends
from hpclb.controller.backends import BackendDecider, BackendDecision
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


def weights(decider: BackendDecider, pool: str, now: float) -> dict[str, float]:
    return {d.name: d.weight for d in decider.decisions(pool, now)}


def decision(decider: BackendDecider, pool: str, name: str, now: float) -> BackendDecision:
    [d] = [d for d in decider.decisions(pool, now) if d.name == name]
    return d


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


# --- decisions ------------------------------------------------------------------------


def test_dynamic_weight_is_configured_weight_times_capacity_left() -> None:
    decider = BackendDecider(parse_config(CONFIG))
    accepted, change = decider.telemetry(msg("c1", 0.25, 100.0), rtt_ms=1.0, mono=1.0,
                                         wall=100.0)
    assert accepted and change is None
    decider.telemetry(msg("c2", 0.5, 100.0), rtt_ms=None, mono=1.0, wall=100.0)
    assert weights(decider, "cpu", 100.0) == {"c1": pytest.approx(2 * 0.75, abs=1 / 256),
                                              "c2": pytest.approx(0.5, abs=1 / 256)}
    # A static pool keeps its configured weight.
    assert decider.decisions("web", 100.0) == (BackendDecision("w1", BackendState.UP, 3.0),)


def test_garbage_telemetry_is_rejected_and_the_last_good_weight_kept() -> None:
    decider = BackendDecider(parse_config(CONFIG))
    decider.telemetry(msg("c2", 0.5, 100.0), None, 1.0, 100.0)
    before = decider.decisions("cpu", 101.0)
    for i, bad in enumerate((float("nan"), -0.5, 1.5)):
        accepted, _ = decider.telemetry(msg("c2", bad, 101.0 + i), None, 2.0, 103.0)
        assert not accepted
    assert decider.decisions("cpu", 103.0) == before
    rejected = decider.report(103.0)["samples_rejected"]["cpu"]  # type: ignore[index]
    assert sum(rejected.values()) == 3


def test_admin_draining_or_down_is_that_state_at_weight_0() -> None:
    config = CONFIG.replace("weight: 2}", "weight: 2, state: draining}").replace(
        "weight: 3}", "weight: 3, state: down}")
    decider = BackendDecider(parse_config(config))
    decider.telemetry(msg("c1", 0.0, 100.0), None, 1.0, 100.0)  # idle: it would weigh 2
    assert decision(decider, "cpu", "c1", 100.0) == BackendDecision(
        "c1", BackendState.DRAINING, 0.0)
    assert decision(decider, "cpu", "c2", 100.0).state is BackendState.UP
    assert decider.decisions("web", 100.0) == (BackendDecision("w1", BackendState.DOWN, 0.0),)
    # The status shows the weight the ring is built with.
    assert decider.report(100.0)["weights"]["cpu"]["c1"] == 0.0  # type: ignore[index]


def test_an_unresolved_mac_is_down_at_weight_0_until_resolved() -> None:
    decider = BackendDecider(parse_config(CONFIG))
    decider.set_unresolved({"w1"})
    assert decider.decisions("web", 100.0) == (BackendDecision("w1", BackendState.DOWN, 0.0),)
    decider.set_unresolved(set())
    assert decider.decisions("web", 100.0) == (BackendDecision("w1", BackendState.UP, 3.0),)
    # A backend that left the configuration is no longer listed as unresolved.
    decider.set_unresolved({"w1"})
    decider.reconfigure(parse_config(CONFIG.replace(
        "    backends:\n      - {name: w1, address: 198.18.0.21, weight: 3}\n",
        "    backends: []\n")))
    assert decider.unresolved == frozenset()


def test_health_down_is_down_at_weight_0_at_once_whatever_the_rate_limit() -> None:
    decider = BackendDecider(parse_config(CONFIG.replace("max_rate: null", "max_rate: 0.01")))
    decider.telemetry(msg("c1", 0.0, 100.0), None, 1.0, 100.0)
    assert decision(decider, "cpu", "c1", 100.0).weight == 2.0
    assert decider.probe("c1", False, "3 consecutive failures", 100.5) is not None
    assert decision(decider, "cpu", "c1", 100.5) == BackendDecision("c1", BackendState.DOWN, 0.0)
    # Samples still arriving while down are taken, the decision stays DOWN.
    accepted, _ = decider.telemetry(msg("c1", 0.5, 101.0), None, 2.0, 101.0)
    assert accepted and decision(decider, "cpu", "c1", 101.0).weight == 0.0
    # Down before any sample: DOWN too (the tracker would give the floor).
    decider.probe("c2", False, "timeout", 101.0)
    assert decision(decider, "cpu", "c2", 101.0) == BackendDecision("c2", BackendState.DOWN, 0.0)


def test_a_down_backend_weighs_nothing_and_ramps_back_up() -> None:
    decider = BackendDecider(parse_config(CONFIG))
    decider.telemetry(msg("c1", 0.0, 100.0), None, 1.0, 100.0)
    assert decider.probe("c1", False, "3 consecutive failures", 100.5) is not None
    assert decision(decider, "cpu", "c1", 101.0) == BackendDecision("c1", BackendState.DOWN, 0.0)
    decider.probe("c1", True, "2 consecutive successes", 102.0)
    ramp = [decision(decider, "cpu", "c1", 102.0 + t).weight
            for t in (0.0, 2.5, 5.0, 7.5, 10.0, 20.0)]
    assert ramp == sorted(ramp) and ramp[0] == 2 * 13 / 256 and ramp[-1] == 2.0, ramp
    # Static pools ramp the same way, from the floor share over their own slow start.
    decider.probe("w1", False, "down", 200.0)
    assert decider.decisions("web", 200.0)[0].weight == 0.0
    decider.probe("w1", True, "up", 201.0)
    assert decider.decisions("web", 201.0)[0].weight == 3 * 13 / 256
    assert decider.decisions("web", 205.0)[0].weight == 3 * (13 + (256 - 13) // 2) / 256
    assert decider.decisions("web", 209.0)[0].weight == 3.0  # reached at slow_start_s


def test_a_backend_never_down_does_not_slow_start() -> None:
    # A new node (or one up since the appliance started) has nothing to come back from.
    decider = BackendDecider(parse_config(CONFIG))
    assert decider.probe("w1", True, "2 consecutive successes", 100.0) is None
    assert decider.decisions("web", 100.0)[0].weight == 3.0
    decider.telemetry(msg("c1", 0.0, 100.0), None, 1.0, 100.0)
    assert decision(decider, "cpu", "c1", 100.0).weight == 2.0


def test_static_and_dynamic_pools_ramp_through_the_same_function(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both kinds call balancing.weights.slow_start_steps, from the floor: the
    target is the tracker's weight in a dynamic pool, the whole grid in a static
    one; the decided weight is configured weight x steps / grid."""
    calls: list[tuple[int, int, int | None, int, int]] = []

    def spy(*args: Any) -> int:
        calls.append(args)
        return slow_start_steps(*args)

    monkeypatch.setattr(backends, "slow_start_steps", spy)
    decider = BackendDecider(parse_config(CONFIG))
    decider.telemetry(msg("c1", 0.25, 100.0), None, 1.0, 100.0)  # capacity 0.75: 192 steps
    for name in ("c1", "w1"):
        decider.probe(name, False, "down", 100.0)
        decider.probe(name, True, "up", 101.0)
    for t in (101.0, 103.0, 105.0, 111.0):
        calls.clear()
        c1 = decision(decider, "cpu", "c1", t)
        w1 = decider.decisions("web", t)[0]
        # c1's target, c2's (no telemetry yet: the floor; never down), w1's: the grid.
        assert [c[0] for c in calls] == [192, 13, 256]
        assert calls[0][1:] == (13, to_us(101.0), to_us(t), to_us(10.0))  # cpu's policy
        assert calls[1][2] is None
        assert calls[2][1:] == (13, to_us(101.0), to_us(t), to_us(8.0))  # web's
        assert c1.weight == 2 * (slow_start_steps(192, 13, to_us(101.0), to_us(t),
                                                  to_us(10.0)) / 256)
        assert w1.weight == 3 * (slow_start_steps(256, 13, to_us(101.0), to_us(t),
                                                  to_us(8.0)) / 256)


def test_reconfigure_forgets_departed_backends_and_restarts_changed_policies() -> None:
    decider = BackendDecider(parse_config(CONFIG))
    decider.telemetry(msg("c2", 0.5, 100.0), None, 1.0, 100.0)
    tracker = decider.trackers["cpu"]
    decider.reconfigure(parse_config(CONFIG.replace(
        "      - {name: c2, address: 198.18.0.12}\n", "")))
    assert decider.trackers["cpu"] is tracker and "c2" not in tracker.nodes()
    decider.reconfigure(parse_config(CONFIG.replace("cpu: 1, mem: 0", "cpu: 1, mem: 1")))
    assert decider.trackers["cpu"] is not tracker
    decider.reconfigure(parse_config(CONFIG.replace("weights: dynamic", "weights: static")))
    assert decider.trackers == {}


def test_telemetry_from_a_node_outside_dynamic_pools_is_only_a_heartbeat() -> None:
    decider = BackendDecider(parse_config(CONFIG))
    accepted, change = decider.telemetry(msg("w1", 0.9, 100.0), None, 1.0, 100.0)
    assert (accepted, change) == (False, None)
    assert decider.decisions("web", 100.0)[0].weight == 3.0
    [change] = decider.expire(mono=10.0, wall=110.0)  # 3 x 1 s without the next one
    assert change.backend == "w1" and not change.up
    assert decider.decisions("web", 110.0)[0].state is BackendState.DOWN


def test_ramps_while_a_dynamic_pool_or_a_returned_backend_may_move() -> None:
    static = BackendDecider(parse_config(CONFIG.replace("weights: dynamic", "weights: static")))
    assert not static.ramps()  # nothing moves without an event
    static.probe("w1", False, "down", 100.0)
    static.probe("w1", True, "up", 101.0)
    assert static.ramps()  # slow start
    assert BackendDecider(parse_config(CONFIG)).ramps()  # the rate limit


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


# --- fleet determinism ---------------------------------------------------------------

FLEET = CONFIG.replace("max_rate: null", "max_rate: 0.2").replace(
    "alpha: 1, step: 0", "alpha: 0.5, step: 0.02")
ratio = st.one_of(st.floats(0, 1), st.sampled_from([math.nan, -0.5, 1.5]))
event = st.one_of(
    st.tuples(st.just("sample"), st.sampled_from(["c1", "c2", "w1"]), st.floats(-30, 60),
              ratio, st.one_of(st.none(), st.floats(0, 300))),
    st.tuples(st.just("probe"), st.sampled_from(["c1", "c2", "w1"]), st.booleans()),
)


def apply_event(decider: BackendDecider, ev: tuple[Any, ...], i: int, now: float) -> None:
    """One generated event (a telemetry sample or a probe verdict) at ``now``."""
    if ev[0] == "sample":
        _, node, dt, cpu, rtt = ev
        decider.telemetry(TelemetryMessage(node=node, time=now + dt, seq=i, interval_s=1.0,
                                           cpu_load=cpu, mem_used=1.0, mem_total=4.0,
                                           numa_nodes=1), rtt, mono=now, wall=now)
    else:
        decider.probe(ev[1], ev[2], "verdict", now)


def replay(events: list[tuple[Any, ...]]) -> list[dict[str, tuple[BackendDecision, ...]]]:
    decider = BackendDecider(parse_config(FLEET))
    out = []
    now = 1.7e9
    for i, ev in enumerate(events):
        now += 0.7
        apply_event(decider, ev, i, now)
        out.append(decider.all_decisions(now + 0.3))
    return out


@settings(max_examples=40, deadline=None)
@given(events=st.lists(event, max_size=40))
def test_two_deciders_fed_the_same_events_decide_bit_for_bit_alike(
        events: list[tuple[Any, ...]]) -> None:
    """Appliances of a fleet build the same rings only if they decide the same
    weights, to the bit, slow start included."""
    a, b = replay(events), replay(events)
    assert a == b
    bits = [[(d.name, d.state, d.weight.hex()) for ds in turn.values() for d in ds] for turn in a]
    assert bits == [[(d.name, d.state, d.weight.hex()) for ds in turn.values() for d in ds]
                    for turn in b]
    for turn in a:
        for d in (d for ds in turn.values() for d in ds):
            assert d.weight == 0.0 or d.state is BackendState.UP
