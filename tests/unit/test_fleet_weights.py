"""Fleet-consistent weights (hpclb.balancing.fleet_weights and the decider's
fleet mode): appliances fed the same samples at different moments, with their
own probes, some missing samples, restarted or restored from a checkpoint,
publish identical weights (and build rings with identical digests).

Figures (samples until agreement after a miss, cost per sample at 1,000
nodes, how often a weight moves compared with WeightTracker) are printed
(``pytest -s``), never asserted."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpclb.balancing import maglev
from hpclb.balancing.fleet_weights import FleetWeightTracker, WindowSample, publish, run_start
from hpclb.balancing.weights import Dynamics, NodeSample, WeightTracker, to_us
from hpclb.config import ConfigError, parse_config
from hpclb.config.weights import WeightPolicy
from hpclb.controller.backends import BackendDecider
from hpclb.controller.core import Controller, ring_digest
from hpclb.controller.statefile import canonical
from hpclb.telemetry.message import TelemetryMessage

T0 = 1_700_000_000.0
POLICY = WeightPolicy()  # the defaults: alpha 0.3, step 0.02, max_rate 0.1/s, 15 s stale
W = 8

# --- sample streams ---------------------------------------------------------------


def stream(rng: random.Random, n: int, node: str = "n1", interval: float = 5.0,
           restart_every: int = 0) -> list[NodeSample]:
    """n samples of one node, roughly ``interval`` apart, loads wandering; an agent
    restart (seq back to 0) every ``restart_every`` samples when set."""
    out, t, seq, cpu = [], T0, 0, rng.random()
    for i in range(n):
        if restart_every and i and i % restart_every == 0:
            seq = 0
        cpu = min(max(cpu + rng.uniform(-0.2, 0.2), 0.0), 1.0)
        rtt = None if rng.random() < 0.1 else rng.uniform(0.05, 150.0)
        out.append(NodeSample(node=node, time=t, cpu_load=cpu, mem_used=rng.uniform(0, 8),
                              mem_total=8.0, rtt_ms=rtt, seq=seq, interval_s=interval))
        t += interval * rng.uniform(0.5, 1.5)
        seq += 1
    return out


samples_st = st.builds(lambda seed, n, r: stream(random.Random(seed), n, restart_every=r),
                       st.integers(0, 2**32), st.integers(1, 40), st.sampled_from([0, 0, 7]))


def feed(tracker: FleetWeightTracker, s: NodeSample, delay: float) -> bool:
    return tracker.observe(s, now=s.time + delay)


# --- (i) same stream, different arrival and query times -------------------------------


@settings(max_examples=200, deadline=None)
@given(samples=samples_st, data=st.data())
def test_same_samples_at_different_moments_publish_identical_weights(
        samples: list[NodeSample], data: st.DataObject) -> None:
    a, b = FleetWeightTracker(POLICY, W), FleetWeightTracker(POLICY, W)
    delay = st.floats(0.0, 10.0)  # arrival jitter, under stale_after_s
    for s in samples:
        assert feed(a, s, data.draw(delay)) and feed(b, s, data.draw(delay))
        # Asked at unrelated moments (the appliances' own clocks):
        qa, qb = data.draw(st.floats(-1e6, 1e6)), data.draw(st.floats(-1e6, 1e6))
        assert a.weight_steps("n1", s.time + qa) == b.weight_steps("n1", s.time + qb)
    assert a.to_state() == b.to_state()


@settings(max_examples=100, deadline=None)
@given(samples=samples_st, downs=st.lists(st.booleans(), max_size=40))
def test_health_verdicts_do_not_change_the_weight(samples: list[NodeSample],
                                                  downs: list[bool]) -> None:
    a, b = FleetWeightTracker(POLICY, W), FleetWeightTracker(POLICY, W)
    for i, s in enumerate(samples):
        if i < len(downs):
            b.set_up("n1", downs[i])  # local verdicts, different on each appliance
        feed(a, s, 1.0)
        feed(b, s, 2.0)
        assert a.weight_steps("n1") == b.weight_steps("n1")


# --- (ii) missed samples, late start, restore ----------------------------------------


@settings(max_examples=200, deadline=None)
@given(samples=samples_st, data=st.data())
def test_a_member_that_missed_samples_agrees_once_the_last_window_is_the_same(
        samples: list[NodeSample], data: st.DataObject) -> None:
    full, gappy = FleetWeightTracker(POLICY, W), FleetWeightTracker(POLICY, W)
    cut = max(len(samples) - W, 0)  # the last W samples reach both
    missed = data.draw(st.sets(st.integers(0, max(cut - 1, 0)))) if cut else set()
    late = data.draw(st.integers(0, cut))  # or it started only at sample `late`
    for i, s in enumerate(samples):
        feed(full, s, 0.5)
        if i not in missed and i >= late:
            feed(gappy, s, 3.0)
    assert gappy.weight_steps("n1") == full.weight_steps("n1")
    assert gappy.samples("n1") == full.samples("n1")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=samples_st, data=st.data())
def test_a_restored_member_agrees_at_once(samples: list[NodeSample],
                                          data: st.DataObject) -> None:
    live = FleetWeightTracker(POLICY, W)
    at = data.draw(st.integers(0, len(samples)))
    for s in samples[:at]:
        feed(live, s, 1.0)
    restored = FleetWeightTracker(POLICY, W)
    restored.from_state(json.loads(canonical(live.to_state())))
    assert restored.weight_steps("n1") == live.weight_steps("n1")
    for s in samples[at:]:
        feed(live, s, 1.0)
        feed(restored, s, 4.0)
        assert restored.weight_steps("n1") == live.weight_steps("n1")


def test_checkpoint_is_checked_whole() -> None:
    t = FleetWeightTracker(POLICY, W)
    for s in stream(random.Random(1), 5):
        feed(t, s, 0.0)
    state = t.to_state()
    other_window = FleetWeightTracker(POLICY, W + 1)
    with pytest.raises(ValueError, match="policy"):
        other_window.from_state(state)
    with pytest.raises(ValueError, match="policy"):  # nor a WeightTracker's
        t.from_state(WeightTracker(POLICY).to_state())
    bad = json.loads(json.dumps(state))
    bad["nodes"]["n1"][2][0] = bad["nodes"]["n1"][1][0]  # not after the one before
    with pytest.raises(ValueError, match=r"nodes\.n1\.2"):
        t.from_state(bad)
    bad["nodes"]["n1"] = [[1, 2, 3, 1 << 20]]  # score above ONE
    with pytest.raises(ValueError, match="out of range"):
        t.from_state(bad)
    assert t.to_state() == state  # nothing changed


# --- the replay is WeightTracker's arithmetic -----------------------------------------


@settings(max_examples=200, deadline=None)
@given(samples=st.builds(lambda seed, n: stream(random.Random(seed), n),
                         st.integers(0, 2**32), st.integers(1, 30)))
def test_with_the_whole_history_in_the_window_it_is_weight_tracker(
        samples: list[NodeSample]) -> None:
    """One run in a window as long as the history, no hysteresis: the capacity
    is exactly WeightTracker's ramp evaluated at the last sample (the shared
    Dynamics: EWMA, grid, rate limit)."""
    policy = WeightPolicy(step=0)
    fleet, classic = FleetWeightTracker(policy, 64), WeightTracker(policy)
    for s in samples:
        assert fleet.observe(s, s.time) and classic.observe(s, s.time)
        assert fleet.capacity_steps("n1") == classic.weight_steps("n1", s.time)


def test_runs_split_at_agent_restarts_and_gaps() -> None:
    stale = to_us(POLICY.stale_after_s)
    w = [WindowSample(t * 1_000_000, seq, 5_000_000, 100) for t, seq in
         [(0, 5), (5, 6), (10, 0), (15, 1), (40, 2), (45, 3)]]
    assert run_start(w, stale) == 4  # 15 -> 40 s is more than 15 s apart
    assert run_start(w[:4], stale) == 2  # seq back to 0: the agent restarted
    assert run_start(w[:2], stale) == 0


def test_slow_start_is_timed_by_the_agent_seq() -> None:
    """A fresh agent (seq 0) starts at the floor and reaches its capacity after
    slow_start_s worth of its own intervals; a long-running one is not slowed."""
    policy = WeightPolicy(slow_start_s=30.0)
    dyn = Dynamics(policy)
    idle = 0  # score 0: full capacity
    fresh = publish([WindowSample(0, 0, 5_000_000, idle)], dyn)
    assert fresh.capacity == policy.ceiling_steps and fresh.steps == policy.floor_steps
    half = publish([WindowSample(0, 3, 5_000_000, idle)], dyn)  # 15 s of 30
    assert half.steps == policy.floor_steps + (policy.ceiling_steps - policy.floor_steps) // 2
    old = publish([WindowSample(0, 6, 5_000_000, idle)], dyn)
    assert old.steps == policy.ceiling_steps


# --- (iii) the decider in fleet mode --------------------------------------------------

FLEET_CONFIG = """\
appliance: {name: lb1, interfaces: {ingress: eth0}, hash_key: 000102030405060708090a0b0c0d0e0f,
            management_address: 198.18.0.3}
telemetry: {server_key: /etc/hpclb/server.key_secret, allow_dir: /etc/hpclb/agents}
fleet: {members: [lb1, lb2], window: 8}
pools:
  cpu:
    weights: dynamic
    policy: {slow_start_s: 10}
    backends:
      - {name: c1, address: 198.18.0.11, weight: 2}
      - {name: c2, address: 198.18.0.12}
  web:
    policy: {slow_start_s: 8}
    backends:
      - {name: w1, address: 198.18.0.21}
vips:
  - {name: v1, address: 198.18.1.1, port: 80, pool: cpu}
"""


def fleet_config(name: str = "lb1", **replace: str) -> Any:
    text = FLEET_CONFIG.replace("name: lb1,", f"name: {name},")
    for old, new in replace.items():
        text = text.replace(old, new)
    return parse_config(text)


def message(node: str, seq: int, t: float, cpu: float, rtt: float | None) -> TelemetryMessage:
    return TelemetryMessage(node=node, time=t, seq=seq, interval_s=1.0, cpu_load=cpu,
                            mem_used=1.0, mem_total=4.0, numa_nodes=1,
                            extra={} if rtt is None else {"fleet_rtt_ms": rtt})


def test_fleet_decider_ignores_the_local_probe_and_clock() -> None:
    a, b = BackendDecider(fleet_config("lb1")), BackendDecider(fleet_config("lb2"))
    rng = random.Random(7)
    for i in range(40):
        for node in ("c1", "c2"):
            m = message(node, 100 + i, T0 + i, rng.random(), rng.choice([None, 0.3, 40.0]))
            # Each appliance's own probe RTT and arrival moment differ:
            assert a.telemetry(m, rng.uniform(0, 100), 1000.0 + i, T0 + i + 0.2)[0]
            assert b.telemetry(m, None, 50.0 + i, T0 + i + 2.5)[0]
        now_a, now_b = T0 + i + rng.uniform(0, 3), T0 + i + rng.uniform(0, 3)
        assert a.all_decisions(now_a) == b.all_decisions(now_b)
    assert not a.ramps()  # nothing moves between samples


def test_fleet_net_term_is_the_agents_figure() -> None:
    d = BackendDecider(fleet_config())
    d.telemetry(message("c1", 100, T0, 0.0, None), 0.1, 1.0, T0)
    d.telemetry(message("c2", 100, T0, 0.0, 0.1), 500.0, 1.0, T0)
    w = {x.name: x.weight for x in d.decisions("cpu", T0)}
    # c1: no figure from the agent, the worst latency whatever the probe said;
    # c2: the agent's 0.1 ms, not the probe's 500.
    assert d.samples["c1"][0].rtt_ms is None and d.samples["c2"][0].rtt_ms == 0.1
    assert w["c1"] / 2 < w["c2"]


def test_fleet_slow_start_comes_from_the_samples_not_local_health() -> None:
    d = BackendDecider(fleet_config())
    d.telemetry(message("c2", 100, T0, 0.0, 0.1), None, 1.0, T0)
    full = {x.name: x.weight for x in d.decisions("cpu", T0)}["c2"]
    # A local down and up (this appliance's probe) changes nothing once up again...
    d.probe("c2", False, "probe", T0 + 1)
    d.probe("c2", True, "probe", T0 + 2)
    d.probe("w1", False, "probe", T0 + 1)
    d.probe("w1", True, "probe", T0 + 2)
    assert {x.name: x.weight for x in d.decisions("cpu", T0 + 2)}["c2"] == full
    assert [x.weight for x in d.decisions("web", T0 + 2)] == [1.0]  # static: no slow start
    # ...while an agent that restarted (seq 0) eases in on every member alike.
    d.telemetry(message("c2", 0, T0 + 3, 0.0, 0.1), None, 4.0, T0 + 3)
    assert {x.name: x.weight for x in d.decisions("cpu", T0 + 3)}["c2"] < full / 4


def test_non_fleet_decider_is_unchanged() -> None:
    cfg = parse_config(FLEET_CONFIG.replace("fleet: {members: [lb1, lb2], window: 8}\n", ""))
    d = BackendDecider(cfg)
    assert type(d.trackers["cpu"]) is WeightTracker and d.ramps()


def test_fleet_checkpoint_round_trip_and_mode_change() -> None:
    a = BackendDecider(fleet_config())
    rng = random.Random(3)
    for i in range(12):
        a.telemetry(message("c1", i + 50, T0 + i, rng.random(), 1.0), None, 1.0, T0 + i)
    state = json.loads(canonical(a.to_state()))
    b = BackendDecider(fleet_config("lb2"))
    assert b.from_state(state, mono=1.0, now=T0 + 12) == []
    assert b.all_decisions(T0 + 99) == a.all_decisions(T0 + 12)
    # The same checkpoint under a non-fleet configuration: that pool starts afresh.
    c = BackendDecider(parse_config(FLEET_CONFIG.replace(
        "fleet: {members: [lb1, lb2], window: 8}\n", "")))
    assert any("fleet window" in n for n in c.from_state(state, mono=1.0, now=T0 + 12))
    # A changed window too.
    d = BackendDecider(fleet_config(**{"window: 8": "window: 9"}))
    assert any("fleet window" in n for n in d.from_state(state, mono=1.0, now=T0 + 12))


# --- the rings' digests ---------------------------------------------------------------


def test_ring_digest_is_by_name_not_by_id() -> None:
    members = [("c1", 1.0), ("c2", 0.5), ("c3", 0.0)]
    ring_a = maglev.build_table([(i, n, w) for i, (n, w) in enumerate(members)], 4099)
    ring_b = maglev.build_table([(i + 7, n, w) for i, (n, w) in enumerate(members)], 4099)
    names_a = {i: n for i, (n, _) in enumerate(members)}
    names_b = {i + 7: n for i, (n, _) in enumerate(members)}
    assert not np.array_equal(ring_a, ring_b)  # ids differ between appliances...
    assert ring_digest(ring_a, names_a) == ring_digest(ring_b, names_b)  # ...slots do not
    moved = maglev.build_table([(0, "c1", 1.0), (1, "c2", 0.75)], 4099)
    assert ring_digest(moved, names_a) != ring_digest(ring_a, names_a)
    empty = maglev.build_table([], 4099)
    assert len(ring_digest(empty, {})) == 16


def _status_of(config: Any, decider: BackendDecider, ids: dict[str, int]) -> dict[str, Any]:
    """Controller.fleet_report on the rings a controller would build (its ring
    cache), without a data plane."""
    fake = SimpleNamespace(config=config, _rings={}, _ring_digests={},
                           checkpoint=SimpleNamespace(backends=SimpleNamespace(ids=ids)))
    for pool, ds in decider.all_decisions(T0).items():
        Controller._ring(fake, pool, ds, config.appliance.ring_size, ids)  # type: ignore[arg-type]
    report = Controller.fleet_report(fake)  # type: ignore[arg-type]
    assert report is not None
    return report


def test_two_members_report_the_same_ring_digests() -> None:
    cfg_a, cfg_b = fleet_config("lb1"), fleet_config("lb2")
    a, b = BackendDecider(cfg_a), BackendDecider(cfg_b)
    rng = random.Random(11)
    for i in range(20):
        for node in ("c1", "c2"):
            m = message(node, 200 + i, T0 + i, rng.random(), rng.uniform(0.1, 50))
            if not (node == "c1" and i == 3):  # lb2 missed one sample, long ago
                b.telemetry(m, rng.uniform(0, 9), 1.0, T0 + i + 1.0)
            a.telemetry(m, None, 1.0, T0 + i)
    ra = _status_of(cfg_a, a, {"c1": 0, "c2": 1, "w1": 2})
    rb = _status_of(cfg_b, b, {"w1": 0, "c2": 5, "c1": 9})  # other ids on lb2
    assert ra["rings"] == rb["rings"] and set(ra["rings"]) == {"v1"}
    assert (ra["members"], ra["window"], ra["appliance"]) == (["lb1", "lb2"], 8, "lb1")


# --- (iv) configuration ---------------------------------------------------------------


def test_fleet_configuration() -> None:
    cfg = fleet_config()
    assert cfg.fleet is not None and cfg.fleet.window == 8 and cfg.fleet.members == ["lb1", "lb2"]
    bare = parse_config(FLEET_CONFIG.replace("fleet: {members: [lb1, lb2], window: 8}",
                                             "fleet: {}"))
    assert bare.fleet is not None and bare.fleet.window == 16 and bare.fleet.members == []
    for bad, says in [("window: 3", "fleet.window"), ("window: 257", "fleet.window"),
                      ("window: 8, hash: x", "fleet.hash"),
                      ("members: [lb1, lb1], window: 8", "named twice"),
                      ("members: [lb2, lb3], window: 8", "not one of the members"),
                      ("members: ['-x'], window: 8", "fleet.members")]:
        text = FLEET_CONFIG.replace("members: [lb1, lb2], window: 8", bad)
        with pytest.raises(ConfigError, match=says):
            parse_config(text)


# --- figures ---------------------------------------------------------------------------


def test_figures_agreement_and_churn() -> None:
    """Printed, not asserted: samples until two members agree again after one
    missed a sample; how often the published weight moves (ring rebuilds)
    against WeightTracker's. (What a sample costs: perf/fleet_weights_cost.py.)"""
    rng = random.Random(2026)
    heal: list[int] = []
    for trial in range(300):
        samples = stream(random.Random(trial), 60)
        miss = rng.randrange(20, 40)
        full, gappy = FleetWeightTracker(POLICY), FleetWeightTracker(POLICY)
        agree_since = None
        for i, s in enumerate(samples):
            feed(full, s, 0.1)
            if i != miss:
                feed(gappy, s, 0.1)
            if i >= miss:
                same = full.weight_steps("n1") == gappy.weight_steps("n1")
                agree_since = (agree_since if agree_since is not None else i) if same else None
        assert agree_since is not None
        heal.append(agree_since - miss)
    heal.sort()
    print(f"\nafter one missed sample (window 16): agree again after median "
          f"{heal[len(heal) // 2]}, max {heal[-1]} samples "
          f"({sum(1 for h in heal if h == 0)}/{len(heal)} never disagreed)")

    moves_fleet = moves_classic = 0
    total = 0
    for trial in range(50):
        steady = random.Random(trial)
        f, c = FleetWeightTracker(POLICY), WeightTracker(POLICY)
        last_f = last_c = None
        t = T0
        for seq in range(200):  # a steady load with noise
            s = NodeSample("n1", t, min(max(0.5 + steady.gauss(0, 0.05), 0), 1), 4.0, 8.0,
                           20.0, seq=seq + 100, interval_s=5.0)
            f.observe(s, t)
            c.observe(s, t)
            wf, wc = f.weight_steps("n1"), c.weight_steps("n1", t)
            moves_fleet += last_f is not None and wf != last_f
            moves_classic += last_c is not None and wc != last_c
            last_f, last_c, t, total = wf, wc, t + 5.0, total + 1
    print(f"weight moves per sample, steady noisy load: fleet {moves_fleet / total:.3f}, "
          f"WeightTracker {moves_classic / total:.3f}")


def test_status_renders_the_fleet_block() -> None:
    from rich.console import Console

    from hpclb.faces.render import render_status

    console = Console(width=120, record=True)
    console.print(render_status({"appliance": "lb1", "fleet": {
        "appliance": "lb1", "members": ["lb1", "lb2"], "window": 16,
        "rings": {"v1": "0123456789abcdef"}}}))
    text = console.export_text()
    assert "lb1, lb2 (window 16 samples)" in text and "v1: 0123456789abcdef" in text
    console = Console(width=120, record=True)
    console.print(render_status({"appliance": "lb1"}))
    assert "ring digests" not in console.export_text()  # no fleet, no block
