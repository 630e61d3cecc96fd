"""Telemetry -> a node's capacity, pure and deterministic (the default formula:
40% CPU, 30% memory, 30% network), and the slow start both pool kinds share.

The pipeline per node, in this order:

1. **Validate** a :class:`NodeSample`. A bad sample (NaN/inf, negative, a ratio above
   1, memory used above total, a zero total, a stale, future or replayed timestamp,
   no GPU in a GPU pool) is rejected and counted by reason in
   :attr:`WeightTracker.rejected`; the node keeps its last good value.
2. **Score** ``cpu·cpu_load + mem·mem_usage + net·min(rtt/latency_scale, 1)
   [+ gpu·(1 - best GPU free share)]`` with the pool's coefficients, normalised to
   sum 1 (default 0.4 / 0.3 / 0.3).
3. **Smooth** the score with an EWMA (``alpha``).
4. **Weight** = capacity left = ``1 - score``, clamped to ``[floor, ceiling]`` and
   quantised to the publication grid (multiples of ``1/grid``).
5. **Hysteresis**: the weight the node is heading for (its *goal*) changes only when
   the new weight differs from it by more than ``step``.
6. **Rate limit**: the published weight walks from where it was towards the goal at
   no more than ``max_rate`` per second (a straight ramp, whatever the polling rate).

Steps 1-5 happen in :meth:`WeightTracker.observe`, timed by the sample's own
timestamp; :meth:`WeightTracker.weight_steps` only reads that state at ``now``
(step 6), so asking for weights more or less often changes nothing.

What is *not* here: whether the node is up. The tracker only hears of health
(:meth:`WeightTracker.set_up`) to restart its smoothing from fresh telemetry after
a return, since a rebooted node's old load says nothing. Zeroing a down backend
and easing a returning one back in are :mod:`hpclb.controller.backends`' call,
the one place a backend's state and weight are decided; the ramp it uses for
that, static and dynamic pools alike, is :func:`slow_start_steps` below, so that
it is integer arithmetic like the rest.

**Determinism.** Every appliance of a fleet fed the same calls (same samples, same
``set_up`` events, same order) must publish bit-identical weights, or their Maglev
rings differ and a flow lands on different backends depending on which appliance
saw it. So nothing after the entry of a sample is computed in floating point:

* each input is turned into an integer of :data:`ONE` (2^16) units right away, with
  one IEEE-754 operation at most (``used/total``, ``rtt/scale``, ``x·2^16``), each
  of which is correctly rounded, so identical on every conforming machine, and
  Python's ``round`` of a float is exact;
* times are integers of microseconds (:func:`to_us`: ``round(t·10^6)``);
* the score, the EWMA, the clamp, the grid, the hysteresis, the rate limit and the
  slow start are integer arithmetic, which is exact, so no summation order, no
  SIMD, no libm can change a bit;
* a published weight is an integer number of grid steps, handed out as
  ``steps / grid`` (exact when ``grid`` is a power of two, as the default 256 is,
  and correctly rounded otherwise).

Nothing here keeps global state, does I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpclb.config.weights import ONE, WeightPolicy

_US = 1_000_000  # microseconds per second

#: Every reason a sample can be rejected for, the keys of ``rejection_counts()``.
REJECT_REASONS: tuple[str, ...] = (
    "non_finite",  # NaN or ±inf in a field
    "negative",  # a quantity below 0
    "ratio_above_1",  # cpu_load or a GPU utilisation above 1
    "used_above_total",  # memory (host or GPU) used > total
    "zero_total",  # memory (host or GPU) total 0: no ratio to take
    "stale",  # timestamp older than now - stale_after_s
    "future",  # timestamp newer than now + stale_after_s (clock gone wrong)
    "out_of_order",  # timestamp not newer than the node's last accepted one
    "no_gpus",  # GPU pool (gpu coefficient > 0) but the sample lists no GPU
)


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU of a node, as the agent reads it from NVML."""

    mem_used: float
    mem_total: float
    util: float = 0.0  # 0..1; validated, not scored (GPU memory is what gates a job)
    numa_node: int | None = None  # for topology-aware placement, not scored here


@dataclass(frozen=True, slots=True)
class NodeSample:
    """One telemetry message of a node's agent (docs/ARCHITECTURE.md, Contracts), normalised.

    ``cpu_load`` is ``1 - idle`` in 0..1; memory in any unit as long as used and
    total share it; ``rtt_ms`` is the probe's round trip, ``None`` when the probe
    got no answer (scored as the worst latency; taking the node down after missed
    heartbeats is the health verdict's call, ``hpclb.health.backend``).
    """

    node: str
    time: float  # seconds, the agent's clock
    cpu_load: float
    mem_used: float
    mem_total: float
    rtt_ms: float | None
    gpus: tuple[GpuSample, ...] = ()
    #: The agent's message counter (0 at its start) and the interval it announced:
    #: a fleet's weights (hpclb.balancing.fleet_weights) tell an agent restart and
    #: time its slow start by them; WeightTracker does not use them.
    seq: int = 0
    interval_s: float = 0.0


# --- fixed-point helpers ------------------------------------------------------------


def _fx(x: float) -> int:
    """A ratio in 0..1 as an integer of ONE units (x·2^16 is exact; round is exact)."""
    return round(x * ONE)


def to_us(t: float) -> int:
    """Seconds as integer microseconds, the unit of every time the integer
    arithmetic here takes (round of a float is exact: the same on every machine)."""
    return round(t * _US)


def _div_round(a: int, b: int) -> int:
    """a / b rounded half up, for a >= 0, b > 0."""
    return (2 * a + b) // (2 * b)


def _toward(start: int, goal: int, budget: int) -> int:
    """Move from start towards goal by at most budget (>= 0)."""
    if goal >= start:
        return min(goal, start + budget)
    return max(goal, start - budget)


# --- the pure formula ---------------------------------------------------------------


def check_sample(sample: NodeSample, now: float, policy: WeightPolicy) -> str | None:
    """Why ``sample`` is unusable (a key of REJECT_REASONS), or None when it is fine.

    Does not know the node's history, so cannot see ``out_of_order``.
    """
    # Not the time: any clock value can be right; the stale/future checks judge it.
    if not math.isfinite(sample.time):
        return "non_finite"
    values = [sample.cpu_load, sample.mem_used, sample.mem_total]
    if sample.rtt_ms is not None:
        values.append(sample.rtt_ms)
    for g in sample.gpus:
        values += [g.mem_used, g.mem_total, g.util]
        if g.numa_node is not None:
            values.append(g.numa_node)
    # Order matters only for which reason is counted; non-finite first since a NaN
    # compares false to everything and would slip through the checks below.
    if not all(math.isfinite(v) for v in values):
        return "non_finite"
    if any(v < 0 for v in values):
        return "negative"
    if sample.cpu_load > 1 or any(g.util > 1 for g in sample.gpus):
        return "ratio_above_1"
    if sample.mem_total == 0 or any(g.mem_total == 0 for g in sample.gpus):
        return "zero_total"
    if sample.mem_used > sample.mem_total or any(g.mem_used > g.mem_total for g in sample.gpus):
        return "used_above_total"
    if policy.gpu > 0 and not sample.gpus:
        return "no_gpus"
    if sample.time < now - policy.stale_after_s:
        return "stale"
    if sample.time > now + policy.stale_after_s:
        return "future"
    return None


def _int_coefficients(policy: WeightPolicy) -> tuple[int, int, int, int]:
    c = policy.coefficients
    return (_fx(c["cpu"]), _fx(c["mem"]), _fx(c["net"]), _fx(c["gpu"]))


def score_fx(sample: NodeSample, policy: WeightPolicy) -> int:
    """The load score of a valid sample, an integer in 0..ONE (ONE = fully loaded)."""
    cpu = _fx(sample.cpu_load)
    mem = _fx(sample.mem_used / sample.mem_total)
    net = ONE if sample.rtt_ms is None else _fx(min(sample.rtt_ms / policy.latency_scale_ms, 1.0))
    # A job needs one GPU with room, not room summed over GPUs: 8 GPUs each 90% full
    # cannot take a job needing 40% of one. So the node's GPU headroom is its best GPU's.
    best_free = max((_fx((g.mem_total - g.mem_used) / g.mem_total) for g in sample.gpus),
                    default=0)
    gpu = ONE - best_free
    coef = _int_coefficients(policy)
    # Dividing by the integer sum of the coefficients normalises exactly, whatever
    # rounding _fx did to each of them.
    return _div_round(coef[0] * cpu + coef[1] * mem + coef[2] * net + coef[3] * gpu, sum(coef))


def score(sample: NodeSample, policy: WeightPolicy | None = None) -> float:
    """The load score of a valid sample as a float in 0..1 (for display and tests)."""
    return score_fx(sample, policy or WeightPolicy()) / ONE


def capacity_steps(score_units: int, policy: WeightPolicy) -> int:
    """Capacity left (1 - score), on the grid, clamped to [floor, ceiling]: grid steps."""
    steps = _div_round((ONE - score_units) * policy.grid, ONE)
    return min(max(steps, policy.floor_steps), policy.ceiling_steps)


# --- slow start -------------------------------------------------------------------


def slow_start_steps(target_steps: int, floor_steps: int, up_since_us: int | None,
                     now_us: int, slow_start_us: int) -> int:
    """The share of ``target_steps`` (grid steps) a backend that came back up at
    ``up_since_us`` gets at ``now_us``: a straight ramp from the floor share
    (``min(floor_steps, target_steps)``) to the target over ``slow_start_us``,
    reached exactly at its end; the target at once when the backend never came
    back (``None``: it was never down, so nothing cold to ease in) or when slow
    start is off (``slow_start_us <= 0``).

    The one slow start of both pool kinds (``controller.backends``: a dynamic
    pool's target is the tracker's published weight, a static pool's the whole
    grid). Why it exists: a node back from down has cold caches and no
    connections, and a full share at once would hand it a whole share of new
    flows. Why from the floor: the floor is the least a healthy node gets, so a
    returning one is sampled by traffic from its first moment. Integers only, as
    the tracker's arithmetic, so a fleet fed the same events ramps in lockstep.
    """
    if up_since_us is None or slow_start_us <= 0:
        return target_steps
    elapsed = now_us - up_since_us
    if elapsed >= slow_start_us:
        return target_steps
    lo = min(floor_steps, target_steps)
    # A clock stepped back before up_since (elapsed < 0) holds the floor, never less.
    return lo + (target_steps - lo) * max(elapsed, 0) // slow_start_us


# --- the stateful part --------------------------------------------------------------


@dataclass(slots=True)
class NodeState:
    """One node's smoothing, hysteresis and ramp (integers), what :class:`Dynamics`
    moves sample by sample."""

    up: bool = True  # the health verdict, only to see a down -> up transition
    last_time_us: int | None = None  # last accepted sample
    reseed: bool = False  # next accepted sample restarts smoothing and the rate limit
    smoothed: int | None = None  # EWMA of the score, ONE units
    goal: int = 0  # weight the node is heading for, grid steps (after hysteresis)
    anchor: int = 0  # published weight when the goal was set, grid steps
    anchor_us: int = 0  # sample time when the goal was set


_Node = NodeState  # the name this module used first


class Dynamics:
    """Steps 3-6 of the pipeline (EWMA, capacity on the grid, hysteresis, rate
    limit) for one policy, as integer functions of a :class:`NodeState`: shared
    by :class:`WeightTracker` (over a node's whole history) and
    :class:`hpclb.balancing.fleet_weights.FleetWeightTracker` (replayed over a
    window of samples)."""

    def __init__(self, policy: WeightPolicy) -> None:
        self.policy = policy
        self.alpha = min(max(_fx(policy.alpha), 1), ONE)
        # Rate limit in grid steps per 10^6 s, an integer, so the budget for e µs is
        # rate·e // 10^12 steps, exactly.
        self.rate = (None if policy.max_rate is None
                     else round(policy.max_rate * policy.grid * _US))
        self.step = policy.step * policy.grid  # hysteresis, in grid steps

    def start(self, node: NodeState, raw: int, t_us: int) -> None:
        """Restart ``node`` from the score ``raw`` of a sample at ``t_us``: no
        history, no ramp (what eases a node in is slow start, not the rate limit)."""
        node.smoothed = raw
        node.goal = node.anchor = self.first_goal(capacity_steps(raw, self.policy))
        node.anchor_us = t_us
        node.reseed = False

    def advance(self, node: NodeState, raw: int, t_us: int) -> None:
        """Take the score ``raw`` of the next sample, at ``t_us`` (after the last)."""
        assert node.smoothed is not None
        diff = raw - node.smoothed
        # Integer EWMA, rounded away from the old value so it always moves at least
        # one unit and reaches a constant input exactly instead of stalling short.
        move = -(-self.alpha * abs(diff) // ONE)
        node.smoothed += move if diff >= 0 else -move
        goal = self.next_goal(node.goal, capacity_steps(node.smoothed, self.policy))
        if goal != node.goal:
            # Re-aim from where the ramp is now, timed by the sample (the agent's
            # clock, the same on every appliance of the fleet).
            node.anchor = self.published(node, t_us)
            node.anchor_us = t_us
            node.goal = goal

    def first_goal(self, capacity: int) -> int:
        """The goal of a node's first sample (grid steps): its capacity."""
        return capacity

    def next_goal(self, goal: int, target: int) -> int:
        """Hysteresis: the new goal when the capacity is ``target`` (grid steps);
        it moves only for a change larger than ``step``."""
        return target if abs(target - goal) > self.step else goal

    def published(self, node: NodeState, t_us: int) -> int:
        """Rate-limited weight at t (grid steps): a straight walk from anchor to goal."""
        if self.rate is None:
            return node.goal
        elapsed = max(t_us - node.anchor_us, 0)
        return _toward(node.anchor, node.goal, self.rate * elapsed // (_US * _US))


class WeightTracker:
    """Per-pool state: smoothed scores, published weights (the capacity each node
    has left, health aside), rejection counters."""

    def __init__(self, policy: WeightPolicy | None = None) -> None:
        self.policy = policy or WeightPolicy()
        self.rejected: Counter[str] = Counter()
        self.accepted = 0
        self._nodes: dict[str, _Node] = {}
        self._dynamics = Dynamics(self.policy)

    # -- inputs --

    def observe(self, sample: NodeSample, now: float) -> bool:
        """Take a sample received at ``now`` (the appliance's clock); True if accepted."""
        reason = check_sample(sample, now, self.policy)
        node = self._nodes.get(sample.node)
        t_us = 0 if reason is not None else to_us(sample.time)  # time may be NaN if rejected
        if reason is None and node is not None and node.last_time_us is not None \
                and t_us <= node.last_time_us:
            # Equal counts too: a replayed message must not be averaged in twice.
            reason = "out_of_order"
        if reason is not None:
            self.rejected[reason] += 1
            return False
        if node is None:
            node = self._nodes[sample.node] = _Node()
        self.accepted += 1
        node.last_time_us = t_us
        raw = score_fx(sample, self.policy)
        if node.smoothed is None or node.reseed:
            # First sample, or first after a restart: history says nothing about now,
            # and slow start (controller.backends), not the rate limit, is what eases
            # the node back in.
            self._dynamics.start(node, raw, t_us)
            return True
        self._dynamics.advance(node, raw, t_us)
        return True

    def set_up(self, node: str, up: bool) -> None:
        """Health verdict for ``node``. On a return to up, the next accepted sample
        is taken as is (smoothing and rate limit restart from it). The published
        weight itself does not change: zeroing a down node and slowly starting a
        returning one are the controller's (``controller.backends``)."""
        state = self._nodes.get(node)
        if state is None:
            state = self._nodes[node] = _Node()
        if up and not state.up:
            state.reseed = True
        state.up = up

    def forget(self, node: str) -> None:
        """Drop a node removed from the pool."""
        self._nodes.pop(node, None)

    # -- outputs --

    def weight_steps(self, name: str, now: float) -> int:
        """Published weight of ``name`` at ``now``, in grid steps (floor..ceiling):
        the capacity it has left, whether it is up or not."""
        node = self._nodes.get(name)
        if node is None or node.smoothed is None:
            # No usable telemetry yet: the floor, so an agent that never reports
            # cannot draw a full share.
            return self.policy.floor_steps
        return self._dynamics.published(node, to_us(now))

    def weight(self, name: str, now: float) -> float:
        """Published weight of ``name`` at ``now`` (a multiple of 1/grid)."""
        return self.weight_steps(name, now) / self.policy.grid

    def weights(self, now: float) -> dict[str, float]:
        """Published weights of every known node at ``now``, sorted by name."""
        return {name: self.weight(name, now) for name in sorted(self._nodes)}

    def rejection_counts(self) -> dict[str, int]:
        """Rejections by reason, every reason present (zeros too), for metrics."""
        return {reason: self.rejected[reason] for reason in REJECT_REASONS}

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    # -- checkpoint (hpclb.controller.statefile) --

    def policy_state(self) -> dict[str, Any]:
        """The policy as JSON: a tracker's state means something only under it."""
        return self.policy.model_dump(mode="json")

    def to_state(self) -> dict[str, Any]:
        """Everything the weights continue from, as JSON-able data (integers:
        restored bit for bit). The counters are not kept: they count samples
        this process took."""
        return {"policy": self.policy_state(),
                "nodes": {name: {"up": n.up, "last_time_us": n.last_time_us,
                                 "reseed": n.reseed, "smoothed": n.smoothed, "goal": n.goal,
                                 "anchor": n.anchor, "anchor_us": n.anchor_us}
                          for name, n in sorted(self._nodes.items())}}

    def from_state(self, state: object, where: str = "tracker",
                   keep: Callable[[str], bool] = lambda name: True) -> None:
        """Replace the nodes' state with ``state`` (``to_state``'s, under this
        tracker's policy), for the nodes ``keep`` accepts. Checked whole first:
        ValueError naming the bad field, and nothing changed."""
        if not isinstance(state, Mapping) or not isinstance(state.get("nodes"), Mapping):
            raise ValueError(f"{where}: expected a mapping with nodes")
        if state.get("policy") != self.policy_state():
            raise ValueError(f"{where}.policy: not this pool's policy")
        grid = self.policy.grid
        restored: dict[str, _Node] = {}
        for name, raw in state["nodes"].items():
            at = f"{where}.nodes.{name}"
            if not isinstance(raw, Mapping):
                raise ValueError(f"{at}: expected a mapping")
            for key in ("up", "reseed"):
                if not isinstance(raw.get(key), bool):
                    raise ValueError(f"{at}.{key}: expected true or false")
            node = _Node(up=raw["up"], reseed=raw["reseed"],
                         last_time_us=_int_or_none(raw, "last_time_us", at),
                         smoothed=_int_or_none(raw, "smoothed", at, 0, ONE),
                         goal=_int(raw, "goal", at, 0, grid),
                         anchor=_int(raw, "anchor", at, 0, grid),
                         anchor_us=_int(raw, "anchor_us", at))
            if keep(str(name)):
                restored[str(name)] = node
        self._nodes = restored


def _int(raw: Mapping[str, object], key: str, where: str,
         lo: int | None = None, hi: int | None = None) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) \
            or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = "" if lo is None else f" in {lo}..{hi}"
        raise ValueError(f"{where}.{key}: expected an integer{bounds}, got {value!r}")
    return value


def _int_or_none(raw: Mapping[str, object], key: str, where: str,
                 lo: int | None = None, hi: int | None = None) -> int | None:
    return None if raw.get(key) is None else _int(raw, key, where, lo, hi)
