"""A fleet's dynamic weights: a pure function of each node's last samples.

Every appliance of a fleet (``fleet:`` in the configuration) gets the same
configuration, and every node agent publishes each message to every appliance.
For their Maglev rings to be bit-identical (the same backend in every slot),
the weights must then not depend on anything an appliance holds alone.
:class:`~hpclb.balancing.weights.WeightTracker` is integer and deterministic,
but depends on the appliance in four ways, each removed here:

* it evaluates the rate limit's ramp at the appliance's clock
  (``weight_steps(name, now)``): here the ramp is evaluated at the **last
  sample's time** (the agent's clock, carried in the message), so a weight
  moves only when a sample comes, and to the same value everywhere;
* its network term is the appliance's own probe round trip: here the
  controller passes the round trip **the agent measured** to the appliances
  (``extra["fleet_rtt_ms"]``; none: the worst, everywhere alike);
* slow start is timed by the local health verdict: here it is timed by the
  **samples**: the agent started ``seq`` messages ago, ``seq x interval_s``
  before its latest sample, so a rebooted node (or restarted agent) eases in
  on every appliance alike;
* its EWMA and hysteresis carry the node's whole history, so one sample
  missed (or an appliance restart) diverges for good: here each node keeps
  its last ``window`` accepted samples, and everything published is
  **replayed over them** from the first sample of the *run*.

The *run* is the longest suffix of the window whose consecutive samples are at
most ``stale_after_s`` apart with increasing ``seq`` (an agent that restarts
counts from 0 again: a new run, as a return from down restarts
WeightTracker's smoothing). Over the run, :class:`LatticeDynamics` (the
integer EWMA, grid and rate limit of WeightTracker's
:class:`~hpclb.balancing.weights.Dynamics`, with a hysteresis that forgets its
start: see there why) replays sample by sample; the published weight is its
ramp at the last sample, eased in by
:func:`~hpclb.balancing.weights.slow_start_steps`.

So two appliances holding the same last ``window`` samples of a node publish
the same weight for it, bit for bit, whatever their clocks, the order of
their calls or their pasts; one that missed a sample (dropped, late, stale on
arrival) agrees again once ``window`` more samples came, one restarted from
its checkpoint holds the same window. What is given up: the EWMA's memory is
at most ``window`` samples (alpha 0.3 over 16: 0.5 % of the oldest left),
the hysteresis works on a lattice of ``2·step`` (:class:`LatticeDynamics`),
and the rate limit restarts from the run's first sample as the window slides
(at the default 0.1/s and 5 s heartbeats a ramp lasts two samples, well
inside a window).

Health is not an input (``set_up`` is recorded and nothing more): it is each
appliance's own verdict, and :mod:`hpclb.controller.backends` zeroes a down
backend whatever its weight.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpclb.balancing.weights import (
    REJECT_REASONS,
    Dynamics,
    NodeSample,
    NodeState,
    check_sample,
    score_fx,
    slow_start_steps,
    to_us,
)
from hpclb.config.weights import ONE, WeightPolicy

DEFAULT_WINDOW = 16


class LatticeDynamics(Dynamics):
    """WeightTracker's dynamics with the hysteresis made forgetful: a Schmitt
    trigger on a fixed lattice instead of a band around the last goal.

    Why: WeightTracker's hysteresis keeps the goal until the capacity moves
    more than ``step`` away from it, so the goal depends on where it was set,
    possibly long ago; replayed from the first sample of a sliding window it is
    set anew each time the window slides, and a noisy load moved the published
    weight on three samples in four (measured: 0.76 moves per sample, against
    0.03 for WeightTracker on the same load). Here the goals are the tops of
    cells of ``cell = 2·step`` grid steps counted down from the ceiling (so an
    idle node weighs the ceiling exactly), and the goal leaves its cell only
    when the capacity is more than ``margin = step/2`` outside it. Such a
    trigger's state is set by any sample whose capacity lies more than
    ``margin`` from every cell edge (about half of them), whatever came before:
    replayed over a window that holds one such sample, it is what a trigger
    that ran over the whole history says, so the weight moves about as rarely
    as WeightTracker's (tests/unit/test_fleet_weights.py prints the figures).
    The price: a published weight is a multiple of ``2·step`` below the
    ceiling, rounded up (``step`` 0.02: 0.04); ``step`` 0: the grid itself,
    no hysteresis.
    """

    def __init__(self, policy: WeightPolicy) -> None:
        super().__init__(policy)
        step = round(policy.step * policy.grid)
        self.cell = max(2 * step, 1)
        self.margin = (step + 1) // 2 if step else 0
        self.top = policy.ceiling_steps

    def _top_of_cell(self, capacity: int) -> int:
        # Capacity is clamped to [floor, ceiling], so the top of its cell is too.
        return self.top - (self.top - capacity) // self.cell * self.cell

    def first_goal(self, capacity: int) -> int:
        return self._top_of_cell(capacity)

    def next_goal(self, goal: int, target: int) -> int:
        # The goal is the top of its cell: (goal - cell, goal]; widened by the margin.
        if goal - self.cell - self.margin < target <= goal + self.margin:
            return goal
        return self._top_of_cell(target)


@dataclass(frozen=True, slots=True)
class WindowSample:
    """What a node's window keeps of an accepted sample: its time (µs, the
    agent's clock), the agent's ``seq`` and announced interval (µs), and its
    score (ONE units), all integers: nothing after the score is a float."""

    t_us: int
    seq: int
    interval_us: int
    score: int


@dataclass(frozen=True, slots=True)
class Published:
    """What a node's window gives: the capacity (grid steps, rate-limited at the
    last sample), the weight after slow start, and the run's length."""

    capacity: int
    steps: int
    run: int


def run_start(window: Sequence[WindowSample], stale_us: int) -> int:
    """Index in ``window`` of the first sample of its run (see the module)."""
    i = len(window) - 1
    while i > 0 and window[i].t_us - window[i - 1].t_us <= stale_us \
            and window[i].seq > window[i - 1].seq:
        i -= 1
    return i


def publish(window: Sequence[WindowSample], dynamics: Dynamics) -> Published:
    """The published weight of a node whose window is ``window`` (not empty):
    a pure function of it and of the policy."""
    policy = dynamics.policy
    first = run_start(window, to_us(policy.stale_after_s))
    state = NodeState()
    dynamics.start(state, window[first].score, window[first].t_us)
    for i in range(first + 1, len(window)):
        dynamics.advance(state, window[i].score, window[i].t_us)
    last = window[-1]
    capacity = dynamics.published(state, last.t_us)
    # The agent started `seq` messages ago: seq x interval before its latest
    # sample (up_since 0, now = elapsed), in integer µs like the rest.
    steps = slow_start_steps(capacity, policy.floor_steps, 0, last.seq * last.interval_us,
                             to_us(policy.slow_start_s))
    return Published(capacity, steps, len(window) - first)


class FleetWeightTracker:
    """Per-pool state of a fleet member: each node's last ``window`` samples and
    what they publish; rejection counters. The interface of WeightTracker that
    :class:`~hpclb.controller.backends.BackendDecider` uses."""

    def __init__(self, policy: WeightPolicy | None = None, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, not {window}")
        self.policy = policy or WeightPolicy()
        self.window = window
        self.rejected: Counter[str] = Counter()
        self.accepted = 0
        self._dynamics = LatticeDynamics(self.policy)
        self._windows: dict[str, deque[WindowSample]] = {}
        self._published: dict[str, Published] = {}  # recomputed on each accepted sample
        self._up: dict[str, bool] = {}

    # -- inputs --

    def observe(self, sample: NodeSample, now: float) -> bool:
        """Take a sample received at ``now`` (the appliance's clock, which only
        judges staleness); True if accepted."""
        reason = check_sample(sample, now, self.policy)
        window = self._windows.get(sample.node)
        t_us = 0 if reason is not None else to_us(sample.time)
        if reason is None and window and t_us <= window[-1].t_us:
            reason = "out_of_order"  # a replay, or overtaken by a newer one
        if reason is None and not (0 <= sample.seq and sample.interval_s >= 0):
            reason = "negative"
        if reason is not None:
            self.rejected[reason] += 1
            return False
        if window is None:
            window = self._windows[sample.node] = deque(maxlen=self.window)
        self.accepted += 1
        window.append(WindowSample(t_us, sample.seq, to_us(sample.interval_s),
                                   score_fx(sample, self.policy)))
        self._published[sample.node] = publish(window, self._dynamics)
        return True

    def set_up(self, node: str, up: bool) -> None:
        """Health verdict for ``node``: recorded, no input of the weight (it is
        this appliance's own; the decider zeroes a down backend)."""
        self._up[node] = up

    def forget(self, node: str) -> None:
        """Drop a node removed from the pool."""
        self._windows.pop(node, None)
        self._published.pop(node, None)
        self._up.pop(node, None)

    # -- outputs --

    def weight_steps(self, name: str, now: float | None = None) -> int:
        """Published weight of ``name`` in grid steps, slow start included:
        the same at any ``now`` (which is not read; the interface's)."""
        pub = self._published.get(name)
        return self.policy.floor_steps if pub is None else pub.steps

    def capacity_steps(self, name: str) -> int:
        """The capacity before slow start, grid steps (floor without samples)."""
        pub = self._published.get(name)
        return self.policy.floor_steps if pub is None else pub.capacity

    def run_length(self, name: str) -> int:
        """How many samples of the window the weight is replayed over."""
        pub = self._published.get(name)
        return 0 if pub is None else pub.run

    def samples(self, name: str) -> tuple[WindowSample, ...]:
        return tuple(self._windows.get(name, ()))

    def weight(self, name: str, now: float | None = None) -> float:
        return self.weight_steps(name) / self.policy.grid

    def weights(self, now: float | None = None) -> dict[str, float]:
        return {name: self.weight(name) for name in self.nodes()}

    def rejection_counts(self) -> dict[str, int]:
        return {reason: self.rejected[reason] for reason in REJECT_REASONS}

    def nodes(self) -> list[str]:
        return sorted(self._windows.keys() | self._up.keys())

    # -- checkpoint (hpclb.controller.statefile) --

    def policy_state(self) -> dict[str, Any]:
        """The policy and the window as JSON: the state means something only
        under both (and differs from a WeightTracker's, so neither is restored
        into the other)."""
        return self.policy.model_dump(mode="json") | {"fleet_window": self.window}

    def to_state(self) -> dict[str, Any]:
        """The windows, integers only (restored bit for bit, so a restarted
        appliance publishes what it did and what the others do)."""
        return {"policy": self.policy_state(),
                "nodes": {name: [[s.t_us, s.seq, s.interval_us, s.score] for s in w]
                          for name, w in sorted(self._windows.items())}}

    def from_state(self, state: object, where: str = "tracker",
                   keep: Callable[[str], bool] = lambda name: True) -> None:
        """Replace the windows with ``state``'s (``to_state``'s, under this
        tracker's policy and window), for the nodes ``keep`` accepts. Checked
        whole first: ValueError naming the bad field, and nothing changed."""
        if not isinstance(state, Mapping) or not isinstance(state.get("nodes"), Mapping):
            raise ValueError(f"{where}: expected a mapping with nodes")
        if state.get("policy") != self.policy_state():
            raise ValueError(f"{where}.policy: not this pool's policy and window")
        windows: dict[str, deque[WindowSample]] = {}
        for name, raw in state["nodes"].items():
            at = f"{where}.nodes.{name}"
            if not isinstance(raw, list) or not raw or len(raw) > self.window:
                raise ValueError(f"{at}: expected a list of 1..{self.window} samples")
            window: deque[WindowSample] = deque(maxlen=self.window)
            for i, entry in enumerate(raw):
                if not isinstance(entry, list) or len(entry) != 4 or not all(
                        isinstance(v, int) and not isinstance(v, bool) for v in entry):
                    raise ValueError(f"{at}.{i}: expected [t_us, seq, interval_us, score]")
                s = WindowSample(*entry)
                if s.seq < 0 or s.interval_us < 0 or not 0 <= s.score <= ONE:
                    raise ValueError(f"{at}.{i}: seq, interval or score out of range")
                if window and s.t_us <= window[-1].t_us:
                    raise ValueError(f"{at}.{i}: not after the sample before it")
                window.append(s)
            if keep(str(name)):
                windows[str(name)] = window
        self._windows = windows
        self._published = {name: publish(w, self._dynamics) for name, w in windows.items()}
        self._up = {}
