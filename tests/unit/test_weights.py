"""Telemetry -> weights: formula, outliers, dynamics, slow start, determinism.

Hand-computed cases pin the default weight formula; one test per rejection
reason checks that the last good value survives a bad sample; the dynamics (EWMA,
hysteresis, rate limit) are checked with the other stages switched off where they
would blur the one under test; slow start is the one pure function both pool kinds
ramp through (``slow_start_steps``; how the controller applies it, and zeroes a down
backend, is tests/unit/test_backends.py); hypothesis checks the grid and that two
trackers fed the same calls publish bit-identical weights.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hpclb.balancing.weights import (
    REJECT_REASONS,
    GpuSample,
    NodeSample,
    WeightTracker,
    score,
    slow_start_steps,
    to_us,
)
from hpclb.config.weights import ONE, WeightPolicy

#: Only the formula and the clamp: no smoothing, no hysteresis, no rate limit (and,
#: where the controller applies it, no slow start).
RAW_KW: dict = {"alpha": 1.0, "step": 0.0, "max_rate": None, "slow_start_s": 0.0}
RAW = WeightPolicy(**RAW_KW)


def raw(**kw: object) -> WeightPolicy:
    """RAW with some stages switched back on (validated, unlike model_copy)."""
    return WeightPolicy(**{**RAW_KW, **kw})


def sample(node: str = "n1", time: float = 0.0, cpu: float = 0.0, mem: float = 0.0,
           rtt: float | None = 0.0, gpus: tuple[GpuSample, ...] = ()) -> NodeSample:
    """A sample with memory given as a used share of a 64 GiB node."""
    total = 64.0 * 2**30
    return NodeSample(node, time, cpu, mem * total, total, rtt, gpus)


def tracker_at(policy: WeightPolicy, **kw: float) -> WeightTracker:
    t = WeightTracker(policy)
    assert t.observe(sample(**kw), now=kw.get("time", 0.0))
    return t


# --- the formula -----------------------------------------------------------------------


@pytest.mark.parametrize(("cpu", "mem", "rtt", "expected"), [
    (0.5, 0.5, 50.0, 0.5),  # the default formula: 0.4·0.5 + 0.3·0.5 + 0.3·0.5
    (0.0, 0.0, 0.0, 0.0),
    (1.0, 1.0, 100.0, 1.0),
    (1.0, 0.0, 0.0, 0.4),
    (0.0, 1.0, 0.0, 0.3),
    (0.0, 0.0, 100.0, 0.3),
    (0.0, 0.0, 5000.0, 0.3),  # latency saturates at latency_scale_ms
    (0.0, 0.0, None, 0.3),  # no probe answer: worst latency
    (0.25, 0.5, 20.0, 0.1 + 0.15 + 0.06),
])
def test_default_score(cpu: float, mem: float, rtt: float | None, expected: float) -> None:
    assert score(sample(cpu=cpu, mem=mem, rtt=rtt)) == pytest.approx(expected, abs=1 / ONE)


def test_brief_example_gives_weight_half_exactly() -> None:
    t = tracker_at(RAW, cpu=0.5, mem=0.5, rtt=50.0)
    assert t.weights(0.0) == {"n1": 0.5}


@pytest.mark.parametrize(("cpu", "mem", "rtt", "steps"), [
    (0.0, 0.0, 0.0, 256),  # idle: ceiling
    (1.0, 1.0, 100.0, 13),  # saturated: floor 0.05 rounded up to the grid, 13/256
    (0.0, 0.0, None, 179),  # 1 - 0.3 = 0.7 -> 179.2 -> 179
    (0.5, 0.5, 50.0, 128),
])
def test_weight_is_capacity_left_clamped(cpu: float, mem: float, rtt: float | None,
                                         steps: int) -> None:
    assert tracker_at(RAW, cpu=cpu, mem=mem, rtt=rtt).weight("n1", 0.0) == steps / 256


def test_ceiling_clamps() -> None:
    policy = raw(ceiling=0.5)
    assert tracker_at(policy).weight("n1", 0.0) == 0.5


def test_coefficients_are_normalised() -> None:
    policy = WeightPolicy(cpu=2, mem=1, net=1)
    assert policy.coefficients == {"cpu": 0.5, "mem": 0.25, "net": 0.25, "gpu": 0.0}
    assert score(sample(cpu=1.0), policy) == 0.5
    assert score(sample(mem=1.0), policy) == 0.25


def test_latency_scale() -> None:
    policy = WeightPolicy(cpu=0, mem=0, net=1, latency_scale_ms=200)
    assert score(sample(rtt=100.0), policy) == 0.5
    assert score(sample(rtt=400.0), policy) == 1.0


def test_gpu_term_uses_best_gpu() -> None:
    # GPUs 90% and 40% full: best free share 0.6 -> GPU term 0.4.
    gpus = (GpuSample(90, 100, 0.5, 0), GpuSample(40, 100, 0.9, 1))
    only_gpu = WeightPolicy(cpu=0, mem=0, net=0, gpu=1)
    assert score(sample(gpus=gpus), only_gpu) == pytest.approx(0.4, abs=1 / ONE)
    mixed = WeightPolicy(cpu=0.3, mem=0.2, net=0.1, gpu=0.4)
    expected = 0.3 * 0.5 + 0.2 * 0.5 + 0.1 * 0.5 + 0.4 * 0.4
    assert score(sample(cpu=0.5, mem=0.5, rtt=50.0, gpus=gpus), mixed) == pytest.approx(
        expected, abs=1 / ONE)


def test_gpus_ignored_when_the_pool_does_not_score_them() -> None:
    full = (GpuSample(100, 100, 1.0, 0),)
    assert score(sample(cpu=0.5, mem=0.5, rtt=50.0, gpus=full)) == 0.5


# --- outliers ------------------------------------------------------------------------

GOOD_GPU = GpuSample(10, 100, 0.5, 0)
BAD: list[tuple[str, NodeSample]] = [
    ("non_finite", sample(time=1, cpu=math.nan)),
    ("non_finite", sample(time=1, rtt=math.inf)),
    ("non_finite", sample(time=math.nan)),
    ("non_finite", NodeSample("n1", 1, 0, math.nan, 10, 0)),
    ("non_finite", sample(time=1, gpus=(GpuSample(math.nan, 100, 0, 0),))),
    ("negative", sample(time=1, cpu=-0.1)),
    ("negative", sample(time=1, rtt=-1.0)),
    ("negative", NodeSample("n1", 1, 0, -1, 10, 0)),
    ("negative", sample(time=1, gpus=(GpuSample(1, 100, 0.1, -1),))),
    ("ratio_above_1", sample(time=1, cpu=1.5)),
    ("ratio_above_1", sample(time=1, gpus=(GpuSample(1, 100, 1.01, 0),))),
    ("used_above_total", NodeSample("n1", 1, 0, 11, 10, 0)),
    ("used_above_total", sample(time=1, gpus=(GpuSample(101, 100, 0.1, 0),))),
    ("zero_total", NodeSample("n1", 1, 0, 0, 0, 0)),
    ("zero_total", sample(time=1, gpus=(GpuSample(0, 0, 0.1, 0),))),
    ("stale", sample(time=-20)),  # older than now - 15 s
    ("future", sample(time=20)),  # newer than now + 15 s
    ("out_of_order", sample(time=-1)),  # older than the last accepted (t = 0)
    ("out_of_order", sample(time=0)),  # the same timestamp again: a replay
]


@pytest.mark.parametrize(("reason", "bad"), BAD)
def test_outlier_rejected_counted_last_good_kept(reason: str, bad: NodeSample) -> None:
    policy = RAW
    if bad.gpus:  # GPU cases run in a GPU pool, whose samples all carry a GPU
        policy = raw(gpu=0.3)
    good = sample(time=0, cpu=0.5, mem=0.5, rtt=50.0, gpus=(GOOD_GPU,) if bad.gpus else ())
    t = WeightTracker(policy)
    assert t.observe(good, now=0.0)
    before = t.weights(1.0)
    assert not t.observe(bad, now=0.0)
    assert t.rejected == {reason: 1}
    assert t.rejection_counts()[reason] == 1
    assert t.weights(1.0) == before
    assert t.accepted == 1


def test_gpu_pool_rejects_samples_without_gpu() -> None:
    t = WeightTracker(raw(gpu=0.5))
    assert not t.observe(sample(), now=0.0)
    assert t.rejected == {"no_gpus": 1}
    assert t.weights(0.0) == {}  # never heard a usable word from it


def test_rejection_counts_lists_every_reason() -> None:
    t = WeightTracker()
    t.observe(sample(cpu=2.0), now=0.0)
    t.observe(sample(cpu=3.0), now=0.0)
    counts = t.rejection_counts()
    assert set(counts) == set(REJECT_REASONS)
    assert counts["ratio_above_1"] == 2
    assert sum(counts.values()) == 2


def test_first_bad_sample_does_not_invent_a_node() -> None:
    t = WeightTracker()
    assert not t.observe(sample(cpu=math.nan), now=0.0)
    assert t.nodes() == []


# --- EWMA, hysteresis, rate limit, grid ------------------------------------------------


def test_ewma_converges_exactly_and_monotonically() -> None:
    policy = raw(alpha=0.3)
    t = tracker_at(policy, cpu=0.0, mem=0.0, rtt=0.0)  # weight 1.0
    seen = [t.weight("n1", 0.0)]
    for i in range(1, 60):
        assert t.observe(sample(time=i * 0.1, cpu=0.5, mem=0.5, rtt=50.0), now=i * 0.1)
        seen.append(t.weight("n1", i * 0.1))
    assert all(a >= b for a, b in itertools.pairwise(seen))
    assert seen[1] == pytest.approx(1 - 0.3 * 0.5, abs=1 / 256)  # one step of 0.3
    assert seen[-1] == 0.5  # reached, not stuck a unit short


def test_ewma_smooths_a_spike() -> None:
    policy = raw(alpha=0.2)
    t = tracker_at(policy)
    t.observe(sample(time=1, cpu=1.0, mem=1.0, rtt=100.0), now=1)  # one bad second
    assert t.weight("n1", 1) == pytest.approx(0.8, abs=1 / 256)


def test_hysteresis_suppresses_small_moves_passes_big_ones() -> None:
    policy = raw(step=0.1)
    t = tracker_at(policy, cpu=0.5, mem=0.5, rtt=50.0)  # 0.5
    t.observe(sample(time=1, cpu=0.6, mem=0.5, rtt=50.0), now=1)  # 0.46: 0.04 away
    assert t.weight("n1", 1) == 0.5
    t.observe(sample(time=2, cpu=0.7, mem=0.6, rtt=60.0), now=2)  # 0.38: 0.12 away
    assert t.weight("n1", 2) == round((1 - (0.28 + 0.18 + 0.18)) * 256) / 256
    # Drifting back by less than the step keeps the new value.
    t.observe(sample(time=3, cpu=0.65, mem=0.6, rtt=60.0), now=3)
    assert t.weight("n1", 3) == round((1 - (0.28 + 0.18 + 0.18)) * 256) / 256


def test_hysteresis_compares_with_the_published_value_not_the_last_sample() -> None:
    # Creeping by less than the step each time must still move once the total
    # difference from the published weight exceeds the step.
    policy = raw(step=0.1)
    t = tracker_at(policy)  # 1.0
    for i, cpu in enumerate((0.05, 0.1, 0.2), start=1):  # 0.98, 0.96, 0.92
        t.observe(sample(time=i, cpu=cpu), now=i)
    assert t.weight("n1", 3) == 1.0
    t.observe(sample(time=4, cpu=0.4), now=4)  # 0.84: 0.16 below 1.0
    assert t.weight("n1", 4) == round(0.84 * 256) / 256


@settings(max_examples=40, deadline=None)
@given(rate=st.sampled_from([0.05, 0.1, 0.37, 1.0]),
       times=st.lists(st.floats(0, 30, allow_nan=False), min_size=2, max_size=20))
def test_rate_limit_bounds_change_per_second(rate: float, times: list[float]) -> None:
    policy = raw(max_rate=rate)
    t = tracker_at(policy)  # 1.0
    t.observe(sample(time=1, cpu=1.0, mem=1.0, rtt=100.0), now=1)  # goal: floor
    times = sorted(times)
    points = [(x, t.weight("n1", x)) for x in times]
    for (t1, w1), (t2, w2) in itertools.pairwise(points):
        assert abs(w2 - w1) <= rate * (t2 - t1) + 1 / 256  # one grid step of rounding
        assert w2 <= w1  # heading one way only
    assert t.weight("n1", 1.0) == 1.0  # not moved at the moment the goal was set


def test_rate_limit_reaches_goal_and_is_a_straight_ramp() -> None:
    policy = raw(max_rate=0.1)
    t = tracker_at(policy)
    t.observe(sample(time=10, cpu=1.0, mem=1.0, rtt=100.0), now=10)
    assert t.weight("n1", 15) == pytest.approx(0.5, abs=1 / 256)
    assert t.weight("n1", 10 + (1 - 13 / 256) / 0.1 + 0.01) == 13 / 256
    assert t.weight("n1", 100) == 13 / 256


def test_rate_limit_re_aims_from_where_the_ramp_is() -> None:
    policy = raw(max_rate=0.1)
    t = tracker_at(policy)  # 1.0
    t.observe(sample(time=1, cpu=1.0, mem=1.0, rtt=100.0), now=1)  # heading to the floor
    mid = t.weight("n1", 4)
    assert mid == pytest.approx(0.7, abs=1 / 256)
    t.observe(sample(time=4, cpu=0.0), now=4)  # back to idle: heading to 1.0
    assert t.weight("n1", 4) == mid  # no jump
    assert t.weight("n1", 5) == pytest.approx(0.8, abs=1 / 256)
    assert t.weight("n1", 10) == 1.0


@settings(max_examples=60, deadline=None)
@given(cpu=st.floats(0, 1), mem=st.floats(0, 1), rtt=st.floats(0, 1000),
       grid=st.sampled_from([256, 100, 7, 1024]))
def test_published_weights_lie_on_the_grid(cpu: float, mem: float, rtt: float,
                                           grid: int) -> None:
    policy = raw(grid=grid, floor=0.0)
    w = tracker_at(policy, cpu=cpu, mem=mem, rtt=rtt).weight("n1", 0.0)
    assert w == round(w * grid) / grid  # k/grid for an integer k, as close as a float gets
    assert 0.0 <= w <= 1.0
    assert w == pytest.approx(1 - score(sample(cpu=cpu, mem=mem, rtt=rtt)), abs=0.5 / grid +
                              1 / ONE)


# --- health ----------------------------------------------------------------------------


def test_health_does_not_move_the_published_weight() -> None:
    # Zeroing a down node is the controller's (controller.backends): the tracker
    # goes on publishing the capacity the node has left, whatever its health.
    t = tracker_at(WeightPolicy(max_rate=0.01))
    assert t.weight("n1", 0.0) == 1.0
    t.set_up("n1", False)
    assert t.weights(0.5) == {"n1": 1.0}
    # Samples still arriving while down are kept.
    assert t.observe(sample(time=1, cpu=1.0, mem=1.0, rtt=100.0), now=1)
    assert t.accepted == 2


def test_a_node_without_telemetry_gets_the_floor_up_or_down() -> None:
    t = WeightTracker()
    t.set_up("n2", False)
    t.set_up("n3", True)
    assert t.weights(0) == {"n2": 13 / 256, "n3": 13 / 256}
    assert t.weight("never-heard", 0) == 13 / 256


def test_up_again_reseeds_from_fresh_telemetry() -> None:
    # A rebooted node's old load says nothing: the first sample after it is taken as is.
    t = tracker_at(WeightPolicy(alpha=0.1, slow_start_s=0), cpu=1.0, mem=1.0, rtt=100.0)
    t.set_up("n1", False)
    t.set_up("n1", True)
    assert t.observe(sample(time=3), now=3)
    assert t.weight("n1", 3) == 1.0


def test_set_up_true_on_a_new_or_up_node_does_not_reseed() -> None:
    policy = raw(alpha=0.5)
    t = tracker_at(policy)  # 1.0
    t.set_up("n1", True)  # never down: the smoothing goes on
    t.observe(sample(time=1, cpu=1.0, mem=1.0, rtt=100.0), now=1)
    assert t.weight("n1", 1) == 0.5


def test_forget() -> None:
    t = tracker_at(WeightPolicy())
    t.forget("n1")
    assert t.weights(0) == {}


# --- slow start ----------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(slow=st.sampled_from([1.0, 10.0, 30.0, 7.3]), cpu=st.floats(0, 1))
def test_slow_start_ramps_monotonically_from_the_floor_to_target(slow: float,
                                                                 cpu: float) -> None:
    policy = raw(slow_start_s=slow)
    target = tracker_at(policy, cpu=cpu).weight_steps("n1", 0)
    up = to_us(2.0)

    def at(t: float) -> int:
        return slow_start_steps(target, policy.floor_steps, up, to_us(t),
                                to_us(policy.slow_start_s))

    ramp = [at(2 + slow * i / 50) for i in range(51)]
    assert ramp[0] == min(13, target)
    assert all(a <= b for a, b in itertools.pairwise(ramp))
    assert ramp[-1] == target  # reached at slow_start_s exactly...
    last_us = up + to_us(policy.slow_start_s) - 1  # ...and not a microsecond before
    assert slow_start_steps(target, policy.floor_steps, up, last_us,
                            to_us(policy.slow_start_s)) < target or target <= 13
    assert at(2 + 2 * slow) == target


def test_slow_start_midpoint_and_off() -> None:
    up, slow = to_us(2.0), to_us(10.0)
    assert slow_start_steps(256, 13, up, to_us(7.0), slow) == 13 + (256 - 13) // 2
    assert slow_start_steps(256, 13, up, to_us(7.0), 0) == 256  # slow_start_s = 0: off


def test_slow_start_needs_a_return() -> None:
    # Never seen down (no up_since): nothing cold to ease in, the target at once.
    assert slow_start_steps(200, 13, None, to_us(1.0), to_us(30.0)) == 200
    # A target below the floor (none the tracker publishes: it clamps to the floor)
    # is never raised by the ramp.
    assert slow_start_steps(5, 13, to_us(0.0), to_us(1.0), to_us(30.0)) == 5
    # A clock stepped back before the return holds the floor share.
    assert slow_start_steps(200, 13, to_us(10.0), to_us(9.0), to_us(30.0)) == 13


@settings(max_examples=60, deadline=None)
@given(target=st.integers(0, 1024), floor=st.integers(0, 1024),
       since=st.integers(-10**12, 10**12), dt=st.integers(-10**9, 10**9),
       slow=st.integers(0, 10**9))
def test_slow_start_stays_between_the_floor_share_and_the_target(
        target: int, floor: int, since: int, dt: int, slow: int) -> None:
    got = slow_start_steps(target, floor, since, since + dt, slow)
    assert min(floor, target) <= got <= target
    assert isinstance(got, int)


# --- determinism -------------------------------------------------------------------------

ratio = st.one_of(st.floats(0, 1), st.sampled_from([math.nan, -0.5, 1.5]))
event = st.one_of(
    st.tuples(st.just("sample"), st.sampled_from(["a", "b", "c"]), st.floats(-30, 60),
              ratio, ratio, st.one_of(st.none(), st.floats(0, 300)),
              st.lists(st.tuples(st.floats(0, 80), st.floats(1, 80), ratio), max_size=3)),
    st.tuples(st.just("health"), st.sampled_from(["a", "b", "c"]), st.booleans()),
)


def replay(policy: WeightPolicy, events: list[tuple], clock_step: float) -> list[dict]:
    t = WeightTracker(policy)
    out = []
    now = 0.0
    for ev in events:
        now += clock_step
        if ev[0] == "sample":
            _, node, ts, cpu, mem, rtt, gpus = ev
            t.observe(NodeSample(node, ts, cpu, mem * 64, 64.0, rtt,
                                 tuple(GpuSample(u, tot, ut, 0) for u, tot, ut in gpus)), now)
        else:
            t.set_up(ev[1], ev[2])
        out.append(t.weights(now + 0.3))
    out.append(dict(t.rejection_counts()))
    return out


@settings(max_examples=60, deadline=None)
@given(events=st.lists(event, max_size=40), gpu=st.sampled_from([0.0, 0.25]))
def test_two_trackers_fed_the_same_calls_agree_bit_for_bit(events: list[tuple],
                                                           gpu: float) -> None:
    policy = WeightPolicy(gpu=gpu, slow_start_s=2.0, max_rate=0.2)
    a, b = replay(policy, events, 0.7), replay(policy, events, 0.7)
    assert a == b
    hexes = [{k: v.hex() for k, v in w.items()} for w in a[:-1]]
    assert hexes == [{k: v.hex() for k, v in w.items()} for w in b[:-1]]
    for w in a[:-1]:
        assert all(0.0 <= v <= 1.0 and v * 256 == int(v * 256) for v in w.values())


def test_weights_does_not_change_state() -> None:
    # Polling more or less often must not change what is published.
    policy = WeightPolicy(max_rate=0.1, slow_start_s=5)
    quiet, busy = WeightTracker(policy), WeightTracker(policy)
    for i in range(20):
        s = sample(time=float(i), cpu=(i % 5) / 4, mem=0.3, rtt=float(i * 7 % 100))
        quiet.observe(s, now=i)
        busy.observe(s, now=i)
        for k in range(10):
            busy.weights(i + k / 10)
    assert quiet.weights(25.0) == busy.weights(25.0)


# --- policy validation -------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"cpu": -0.1},
    {"gpu": -1},
    {"cpu": 0, "mem": 0, "net": 0, "gpu": 0},
    {"mem": math.nan},
    {"net": math.inf},
    {"floor": 0.6, "ceiling": 0.5},
    {"floor": 0.51, "ceiling": 0.52, "grid": 10},  # no grid point in between
    {"ceiling": 0.001},  # rounds to 0 on the grid
    {"ceiling": 0},
    {"floor": 1.5},
    {"alpha": 0},
    {"alpha": 1.5},
    {"step": -0.1},
    {"step": 1},
    {"max_rate": 0},
    {"grid": 0},
    {"grid": 2.5},
    {"latency_scale_ms": 0},
    {"slow_start_s": -1},
    {"stale_after_s": 0},
    {"bogus": 1},
])
def test_policy_validation(kwargs: dict) -> None:
    with pytest.raises(ValidationError):
        WeightPolicy(**kwargs)


def test_policy_is_frozen_and_defaults_are_the_default_formula() -> None:
    p = WeightPolicy()
    assert p.coefficients == {"cpu": 0.4, "mem": 0.3, "net": 0.3, "gpu": 0.0}
    assert p.latency_scale_ms == 100
    with pytest.raises(ValidationError):
        p.cpu = 0.9  # type: ignore[misc]


def golden_run() -> str:
    """A fixed scenario through every stage; the digest of every published weight.

    Down and slow start are applied as controller.backends applies them to a
    backend of configured weight 1 (0 while down; else the tracker's weight through
    slow_start_steps from the return), so the digest is the one these stages gave
    when the tracker zeroed and ramped by itself: not a bit moved in the move.
    """
    policy = WeightPolicy(cpu=0.35, mem=0.25, net=0.2, gpu=0.2, slow_start_s=4.0)
    t = WeightTracker(policy)
    down: set[str] = set()
    up_since: dict[str, int] = {}

    def published(now: float) -> dict[str, float]:
        return {n: 0.0 if n in down else slow_start_steps(
                    t.weight_steps(n, now), policy.floor_steps, up_since.get(n), to_us(now),
                    to_us(policy.slow_start_s)) / policy.grid
                for n in t.nodes()}

    out = []
    for i in range(40):
        node = "abc"[i % 3]
        gpus = (GpuSample(i % 7 * 10.0, 80.0, 0.5, 0), GpuSample(33.3, 80.0, 0.1, 1))
        t.observe(NodeSample(node, 1.7e9 + i * 0.37, (i * 0.137) % 1, (i * 3.1) % 64, 64.0,
                             None if i % 11 == 0 else (i * 13.7) % 150, gpus), 1.7e9 + i * 0.4)
        if i == 17:
            t.set_up("b", False)
            down.add("b")
        if i == 23:
            t.set_up("b", True)
            down.discard("b")
            up_since["b"] = to_us(1.7e9 + i * 0.4)
        out.append(published(1.7e9 + i * 0.4 + 0.1))
    return hashlib.sha256(repr(out).encode()).hexdigest()


def test_golden_weights() -> None:
    # Appliances of one fleet may run different releases or CPUs: a change in the
    # arithmetic that moves any published weight by a bit must show up here.
    assert golden_run() == GOLDEN


GOLDEN = "a87879e6ca595f13412db7a41a55a6b3f3ae278c71e263ba7e6f116d39a5c865"
