"""Each backend's data-plane state and ring weight, decided in one place.

:class:`BackendDecider` turns four inputs into one :class:`BackendDecision`
(state, weight) per backend:

* the configuration: the operator's ``AdminState``, the configured weight, the
  pool's ``weights`` mode and ``policy``;
* the health verdict (:class:`~hpclb.health.backend.BackendHealth`: probes and
  missed heartbeats);
* telemetry, in a ``dynamic`` pool: the capacity the node has left, as its pool's
  :class:`~hpclb.balancing.weights.WeightTracker` publishes it (validation,
  score, smoothing, hysteresis, rate limit, on the fixed-point grid);
* whether the controller resolved the backend's MAC (``set_unresolved``).

The rules, in the order they apply, and why each is there:

1. **No MAC: DOWN.** A frame cannot be addressed to a backend that did not
   answer ARP; DOWN makes the data plane re-hash its flows rather than send
   them nowhere.
2. **Health down: DOWN**, at once, whatever the rate limit or the slow start:
   a dead node's flows must move at their next packet, not after a ramp.
3. **Otherwise the operator's state**, ``AdminState`` to ``BackendState``: UP,
   DRAINING (pinned flows stay, new ones go elsewhere) or DOWN.
4. **Weight 0 unless UP.** The ring only places new flows; a backend that may
   not take one (draining, down) gets no slot, so new flows hash straight to
   backends that may instead of leaning on the data plane's 8-slot probe to skip
   it (pinned flows do not consult the ring, so a draining backend keeps them).
5. **A pinned weight wins**: an operator's pin (REST API, ``pin``) holds an
   UP backend's ring weight at the pinned value until the pin expires by
   itself; health and admin state still apply (rules 1-4 come first).
6. **An UP backend weighs configured weight x capacity x slow start.**
   Capacity is the tracker's published weight in a dynamic pool (what the node
   has left: a busy node gets fewer new flows) and 1 in a static pool. Slow
   start (:func:`~hpclb.balancing.weights.slow_start_steps`, the same function
   for both pool kinds) eases a backend that came back up (the health verdict's
   ``up_since``) from the pool's floor share to that capacity over
   ``policy.slow_start_s``, so a cold node is not handed a full share of new
   flows at once; a backend never seen down is not slowed.

Everything from capacity to slow start is integer grid steps (times in integer
microseconds), divided by the pool's grid only at the end, so appliances of a
fleet fed the same events decide bit-identical weights, and hence build the same
Maglev rings. ``hpclb.controller.core`` only asks: its tables carry each
decision's state, its rings each decision's weight.

**In a fleet** (``config.fleet``), the appliances are not fed the same events:
each hears the agents at its own moments, probes with its own round trips and
may miss a sample or restart. So rule 6 takes inputs that do not depend on the
appliance: a dynamic pool's capacity comes from a
:class:`~hpclb.balancing.fleet_weights.FleetWeightTracker` (a pure function of
each node's last ``fleet.window`` samples, evaluated at the last sample's
time), its network term is the round trip the agent measured to the fleet
(``extra["fleet_rtt_ms"]``; absent: the worst, everywhere alike) rather than
this appliance's probe, and its slow start is the tracker's (timed by the
agent's ``seq`` and interval: a restarted agent eases in on every member
alike). A static pool gets no slow start in a fleet: its only clock would be
each appliance's own health verdict (``up_since``), which the members do not
share, so a returning backend would weigh differently on each member for
``slow_start_s`` and the rings would differ exactly then. Rules 1-5 stay
local: health, MACs, the operator's state and pins are each appliance's (a
backend one member cannot reach is DOWN there only).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from hpclb.balancing.fleet_weights import FleetWeightTracker
from hpclb.balancing.weights import (
    GpuSample,
    NodeSample,
    WeightTracker,
    check_sample,
    score,
    slow_start_steps,
    to_us,
)
from hpclb.config import AdminState, BackendConfig, HpclbConfig, PoolConfig, WeightsMode
from hpclb.config.weights import WeightPolicy
from hpclb.contract.tables import BackendState
from hpclb.health.backend import BackendHealth, Change
from hpclb.telemetry.message import FLEET_RTT, TelemetryMessage

log = logging.getLogger(__name__)

#: Health changes kept for the status (flapping shows there).
TRANSITIONS_KEPT = 256
#: After a restore, how long an agent heard before the restart has to be heard
#: again (at least its missed intervals): it reconnects to a receiver that just
#: started, which can take a few seconds (lab: 3 s at a 0.5 s interval).
HEARD_AGAIN_GRACE_S = 30.0

Tracker = WeightTracker | FleetWeightTracker

# The operator's word, as the data plane spells it (rule 3).
_ADMIN_STATE = {
    AdminState.UP: BackendState.UP,
    AdminState.DRAINING: BackendState.DRAINING,
    AdminState.DOWN: BackendState.DOWN,
}


def to_node_sample(msg: TelemetryMessage, rtt_ms: float | None) -> NodeSample:
    """The weights' view of a message. ``rtt_ms`` is the health probe's round trip
    (None: no answer), which the agent cannot measure itself.

    With a cgroup block, the cgroup's CPU load and memory stand for the node's:
    the node's capacity for new work is what its job container has left, which
    is also how each backend namespace of the lab gets a load of its own.
    """
    cpu, used, total = msg.cpu_load, msg.mem_used, msg.mem_total
    cg = msg.cgroup
    if cg is not None:
        if cg.cpu_load is not None:
            cpu = cg.cpu_load
        if cg.mem_used is not None and cg.mem_limit is not None:
            used, total = cg.mem_used, cg.mem_limit
    gpus = tuple(
        GpuSample(mem_used=g.mem_used, mem_total=g.mem_total,
                  util=0.0 if g.util is None else g.util, numa_node=g.numa_node)
        for g in msg.gpus)
    return NodeSample(node=msg.node, time=msg.time, cpu_load=cpu, mem_used=used,
                      mem_total=total, rtt_ms=rtt_ms, gpus=gpus, seq=msg.seq,
                      interval_s=msg.interval_s)


@dataclass(frozen=True, slots=True)
class BackendDecision:
    """What the data plane gets for one backend: its table entry's state and its
    weight in the pool's Maglev ring (0.0 unless ``state`` is UP)."""

    name: str
    state: BackendState
    weight: float


class BackendDecider:
    """The state and weight of every backend of the configuration in force, from
    its inputs (see the module's rules). Holds the health verdicts and one
    WeightTracker per dynamic pool; pure otherwise: every time is passed in."""

    def __init__(self, config: HpclbConfig) -> None:
        missed = config.telemetry.missed_heartbeats if config.telemetry else 3
        self.health = BackendHealth(missed)
        self.trackers: dict[str, Tracker] = {}
        self.unresolved: frozenset[str] = frozenset()
        # Operator pins: backend -> (ring weight, wall-clock expiry).
        self.pins: dict[str, tuple[float, float]] = {}
        # The last accepted telemetry sample of each backend and when it came
        # (wall clock): the inputs of its weight, for the status and the API.
        self.samples: dict[str, tuple[NodeSample, float]] = {}
        self.transitions: deque[Change] = deque(maxlen=TRANSITIONS_KEPT)
        # The last accepted message itself (the API shows it whole); not kept in
        # the state checkpoint: the next heartbeat brings a fresher one.
        self.messages: dict[str, tuple[TelemetryMessage, float]] = {}
        self.config = config
        self.reconfigure(config)

    def reconfigure(self, config: HpclbConfig) -> None:
        """Follow a new configuration: a pool whose policy changed starts a fresh
        tracker; backends that left are forgotten."""
        self.config = config
        for name, pool in config.pools.items():
            if pool.weights is not WeightsMode.DYNAMIC:
                continue
            old, new = self.trackers.get(name), self._new_tracker(pool)
            if old is None or old.policy_state() != new.policy_state():
                self.trackers[name] = new
        for name in [p for p in self.trackers if p not in config.pools
                     or config.pools[p].weights is not WeightsMode.DYNAMIC]:
            del self.trackers[name]
        present = {b.name for p in config.pools.values() for b in p.backends}
        for tracker in self.trackers.values():
            for node in tracker.nodes():
                if node not in present:
                    tracker.forget(node)
        for name in list(self.health.snapshot()):
            if name not in present:
                self.health.forget(name)
        for table in (self.pins, self.samples, self.messages):
            for name in [n for n in table if n not in present]:
                del table[name]
        self.unresolved &= present

    def _new_tracker(self, pool: PoolConfig) -> Tracker:
        """A dynamic pool's tracker: a fleet's when the appliance is in one."""
        fleet = self.config.fleet
        if fleet is not None:
            return FleetWeightTracker(pool.policy, fleet.window)
        return WeightTracker(pool.policy)

    # --- inputs --------------------------------------------------------------

    def apply(self, change: Change | None) -> Change | None:
        """Log a health change and tell the tracker of the backend's pool, which
        restarts its smoothing from the first sample after a return (the weight
        itself is zeroed and slowly started here, in ``decide``)."""
        if change is None:
            return None
        log.warning("backend %s is %s: %s", change.backend, "up" if change.up else "DOWN",
                    change.reason)
        self.transitions.append(change)
        pool = self.config.pool_of(change.backend)
        if pool in self.trackers:
            self.trackers[pool].set_up(change.backend, change.up)
        return change

    def probe(self, backend: str, up: bool, reason: str, wall: float) -> Change | None:
        return self.apply(self.health.probe(backend, up, reason, wall))

    def telemetry(self, msg: TelemetryMessage, rtt_ms: float | None, mono: float,
                  wall: float) -> tuple[bool, Change | None]:
        """A heartbeat of ``msg.node`` (already authenticated as that node) and,
        in a dynamic pool, a sample. Returns (sample accepted, health change).
        ``rtt_ms``: this appliance's probe round trip, the network term outside
        a fleet; in a fleet the agent's own figure is used instead."""
        change = self.apply(self.health.heartbeat(msg.node, msg.interval_s, mono, wall))
        pool = self.config.pool_of(msg.node)
        tracker = self.trackers.get(pool) if pool else None
        if tracker is None:
            return False, change
        if self.config.fleet is not None:
            rtt_ms = msg.extra.get(FLEET_RTT)
        sample = to_node_sample(msg, rtt_ms)
        accepted = tracker.observe(sample, now=wall)
        if accepted:
            self.samples[msg.node] = (sample, wall)
            self.messages[msg.node] = (msg, wall)
        return accepted, change

    def pin(self, name: str, weight: float | None, until: float) -> None:
        """Hold backend ``name``'s ring weight at ``weight`` until ``until`` (wall
        clock); ``weight`` None removes the pin."""
        if weight is None:
            self.pins.pop(name, None)
        else:
            self.pins[name] = (weight, until)

    def _pinned(self, name: str, now: float) -> float | None:
        pin = self.pins.get(name)
        if pin is None:
            return None
        if now >= pin[1]:  # expired by itself
            del self.pins[name]
            log.info("backend %s: weight pin expired", name)
            return None
        return pin[0]

    def expire(self, mono: float, wall: float,
               heard_since: float | None = -math.inf) -> list[Change]:
        """Missed heartbeats, counted only over time the appliance could hear
        (see BackendHealth.expire)."""
        return [c for c in map(self.apply, self.health.expire(mono, wall, heard_since)) if c]

    def set_unresolved(self, names: Iterable[str]) -> None:
        """The backends whose MAC the controller could not resolve, as of its
        last attempt (rule 1); they stay DOWN until it resolves them."""
        self.unresolved = frozenset(names)

    # --- outputs -------------------------------------------------------------

    def decide(self, pool_name: str, pool: PoolConfig, b: BackendConfig,
               now: float) -> BackendDecision:
        """The state and weight of backend ``b`` of ``pool`` at ``now`` (wall clock)."""
        if b.name in self.unresolved or not self.health.is_up(b.name):
            return BackendDecision(b.name, BackendState.DOWN, 0.0)  # rules 1, 2
        state = _ADMIN_STATE[b.state]  # rule 3
        if state is not BackendState.UP:
            return BackendDecision(b.name, state, 0.0)  # rule 4
        pinned = self._pinned(b.name, now)
        if pinned is not None:
            return BackendDecision(b.name, state, pinned)  # rule 5
        policy = pool.policy
        tracker = self.trackers.get(pool_name)
        if self.config.fleet is not None:
            # The fleet's rule 6: the tracker's weight, slow start included (a
            # pure function of the samples); a static pool's whole grid.
            steps = policy.grid if tracker is None else tracker.weight_steps(b.name, now)
            return BackendDecision(b.name, state, b.weight * (steps / policy.grid))
        # Capacity in grid steps: the tracker's in a dynamic pool, the whole grid
        # (a share of 1) in a static one (rule 5).
        capacity = policy.grid if tracker is None else tracker.weight_steps(b.name, now)
        up_since = self.health.up_since(b.name)
        steps = slow_start_steps(capacity, policy.floor_steps,
                                 None if up_since is None else to_us(up_since), to_us(now),
                                 to_us(policy.slow_start_s))
        # steps / grid first, as the tracker publishes a share (exact for a
        # power-of-two grid), then one multiplication by the configured weight:
        # the same two correctly rounded operations on every appliance.
        return BackendDecision(b.name, state, b.weight * (steps / policy.grid))  # rule 6

    def decisions(self, pool_name: str, now: float) -> tuple[BackendDecision, ...]:
        """The decisions of one pool's backends, in the configuration's order."""
        pool = self.config.pools[pool_name]
        return tuple(self.decide(pool_name, pool, b, now) for b in pool.backends)

    def all_decisions(self, now: float) -> dict[str, tuple[BackendDecision, ...]]:
        """Every pool's decisions, by pool name."""
        return {name: self.decisions(name, now) for name in self.config.pools}

    def ramps(self) -> bool:
        """Whether decisions may change with no new input, as time passes: a
        dynamic pool's rate limit walks its weights, a backend that came back up
        is in (or was in) its slow start. The controller then compares decisions
        every push interval instead of waiting for an event."""
        if self.config.fleet is not None:
            # A fleet's weights move only with samples (events), and its slow
            # start is timed by them too: only a pin expires by itself.
            return bool(self.pins)
        return bool(self.trackers) or bool(self.pins) or any(
            self.health.up_since(b.name) is not None
            for p in self.config.pools.values() for b in p.backends)

    def report(self, now: float) -> dict[str, object]:
        """For the status file: health, the ring weight of each backend as decided
        now, the samples each dynamic pool took and refused."""
        health = self.health.snapshot()
        for pool in self.config.pools.values():
            for b in pool.backends:  # never probed nor heard: up as far as we know
                health.setdefault(b.name, {"up": True, "probe_up": True, "beats_missed": False,
                                          "beats_unknown": False})
        decisions = self.all_decisions(now)
        # Backend -> pool once (pool_of per backend would be quadratic: 1,000
        # dynamic backends, every second).
        pools = {b.name: p for p, pool in self.config.pools.items() for b in pool.backends}
        return {
            "health": dict(sorted(health.items())),
            "weights": {p: {d.name: d.weight for d in ds} for p, ds in decisions.items()},
            "states": {d.name: d.state.name.lower() for ds in decisions.values() for d in ds},
            "pools": pools,
            "configured_weights": {b.name: b.weight for pool in self.config.pools.values()
                                   for b in pool.backends},
            "pins": {name: {"weight": w, "until": until}
                     for name, (w, until) in sorted(self.pins.items())},
            "inputs": {name: self._inputs(sample, received, now, pools.get(name))
                       for name, (sample, received) in sorted(self.samples.items())},
            "telemetry_latest": {name: msg.model_dump(mode="json")
                                 | {"received": received, "age_s": max(now - received, 0.0)}
                                 for name, (msg, received) in sorted(self.messages.items())},
            "transitions": [{"backend": c.backend, "up": c.up, "reason": c.reason,
                             "time": c.time} for c in self.transitions],
            "samples_accepted": {p: t.accepted for p, t in self.trackers.items()},
            "samples_rejected": {p: t.rejection_counts() for p, t in self.trackers.items()},
        }

    def _inputs(self, sample: NodeSample, received: float, now: float,
                pool: str | None) -> dict[str, object]:
        """One backend's weight inputs as the status shows them, scored by the
        policy of its ``pool``."""
        policy = self.config.pools[pool].policy if pool in self.config.pools else None
        return {
            "cpu_load": sample.cpu_load, "mem_used": sample.mem_used,
            "mem_total": sample.mem_total, "rtt_ms": sample.rtt_ms,
            "gpu_mem_used": sum(g.mem_used for g in sample.gpus) if sample.gpus else None,
            "gpu_mem_total": sum(g.mem_total for g in sample.gpus) if sample.gpus else None,
            "score": score(sample, policy), "time": sample.time, "received": received,
            "age_s": max(now - received, 0.0),
        }

    # --- checkpoint (hpclb.controller.statefile) ---------------------------------

    def to_state(self) -> dict[str, Any]:
        """Health, each dynamic pool's tracker, pins, the last samples and the
        transitions, as JSON-able data (``from_state`` takes it back)."""
        return {
            "health": self.health.to_state(),
            "trackers": {p: t.to_state() for p, t in sorted(self.trackers.items())},
            "pins": {n: {"weight": w, "until": u} for n, (w, u) in sorted(self.pins.items())},
            "samples": {n: {"sample": asdict(s), "received": r}
                        for n, (s, r) in sorted(self.samples.items())},
            "transitions": [asdict(c) for c in self.transitions],
        }

    def from_state(self, state: object, mono: float, now: float) -> list[str]:
        """Continue from ``state`` (``to_state``'s) under the configuration in
        force: backends no longer configured, pools no longer dynamic or whose
        policy changed, and expired pins are left out (each named in the notes
        returned). Checked whole before anything is replaced: ValueError naming
        the bad field, and the decider stays as it was."""
        if not isinstance(state, Mapping):
            raise ValueError("decider: expected a mapping")
        present = {b.name: name for name, p in self.config.pools.items() for b in p.backends}
        notes: list[str] = []
        health = BackendHealth(self.health.missed)
        health.from_state(state.get("health", {}), mono, present.__contains__,
                          HEARD_AGAIN_GRACE_S)
        trackers = {name: self._new_tracker(self.config.pools[name])
                    for name in self.trackers}
        raw_trackers = _mapping(state, "trackers")
        for pool, raw in raw_trackers.items():
            tracker = trackers.get(pool)
            if tracker is None:
                notes.append(f"pool {pool} is no longer dynamic: its weight state is dropped")
            elif isinstance(raw, Mapping) and raw.get("policy") != tracker.policy_state():
                notes.append(f"pool {pool}'s policy changed (or its fleet window): its "
                             "weights start afresh")
            else:
                tracker.from_state(raw, f"trackers.{pool}",
                                   lambda n, pool=pool: present.get(n) == pool)
        pins = {str(n): _pin(raw, f"pins.{n}") for n, raw in _mapping(state, "pins").items()}
        samples = {str(n): _sample(raw, f"samples.{n}")
                   for n, raw in _mapping(state, "samples").items()}
        changes = _transitions(state.get("transitions", []))
        gone = sorted({*_mapping(state, "health"), *pins, *samples} - present.keys())
        if gone:
            notes.append(f"backends no longer configured: {', '.join(gone)}")
        expired = sorted(n for n, (_, until) in pins.items() if until <= now)
        if expired:
            notes.append(f"weight pins expired meanwhile: {', '.join(expired)}")
        # Everything checked: only now is anything replaced.
        self.health, self.trackers = health, trackers
        self.pins = {n: p for n, p in pins.items() if n in present and p[1] > now}
        self.samples = {n: s for n, s in samples.items() if present.get(n) in trackers}
        self.transitions = deque(changes, maxlen=TRANSITIONS_KEPT)
        return notes


def _mapping(state: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = state.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}: expected a mapping")
    return value


def _number(raw: Mapping[str, Any], key: str, where: str, optional: bool = False) -> float:
    value = raw.get(key)
    if optional and value is None:
        return math.nan  # the caller maps it back to None
    if not isinstance(value, (int, float)) or isinstance(value, bool) \
            or not math.isfinite(value):
        raise ValueError(f"{where}.{key}: expected a finite number, got {value!r}")
    return float(value)


def _count(raw: Mapping[str, Any], key: str, where: str) -> int:
    """An integer >= 0, 0 when absent (a checkpoint written before it existed)."""
    value = raw.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}.{key}: expected an integer >= 0, got {value!r}")
    return value


def _pin(raw: object, where: str) -> tuple[float, float]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping")
    weight = _number(raw, "weight", where)
    if weight < 0:
        raise ValueError(f"{where}.weight: expected a number >= 0")
    return weight, _number(raw, "until", where)


def _sample(raw: object, where: str) -> tuple[NodeSample, float]:
    """A checkpointed sample, valid as the tracker took it (so the status can
    score it: a zero total would divide by zero)."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("sample"), Mapping):
        raise ValueError(f"{where}: expected a mapping with a sample")
    s, at = raw["sample"], f"{where}.sample"
    gpus_raw = s.get("gpus", [])
    if not isinstance(gpus_raw, list) or not all(isinstance(g, Mapping) for g in gpus_raw):
        raise ValueError(f"{at}.gpus: expected a list of mappings")
    gpus = []
    for i, g in enumerate(gpus_raw):
        numa = g.get("numa_node")
        if numa is not None and (not isinstance(numa, int) or isinstance(numa, bool)):
            raise ValueError(f"{at}.gpus.{i}.numa_node: expected an integer or null")
        gpus.append(GpuSample(_number(g, "mem_used", f"{at}.gpus.{i}"),
                              _number(g, "mem_total", f"{at}.gpus.{i}"),
                              _number(g, "util", f"{at}.gpus.{i}"), numa))
    rtt = _number(s, "rtt_ms", at, optional=True)
    if not isinstance(s.get("node"), str):
        raise ValueError(f"{at}.node: expected a string")
    sample = NodeSample(node=s["node"], time=_number(s, "time", at),
                        cpu_load=_number(s, "cpu_load", at), mem_used=_number(s, "mem_used", at),
                        mem_total=_number(s, "mem_total", at),
                        rtt_ms=None if math.isnan(rtt) else rtt, gpus=tuple(gpus),
                        seq=_count(s, "seq", at), interval_s=_number(s, "interval_s", at)
                        if "interval_s" in s else 0.0)
    # Its own time as "now": only the values are judged, not their age.
    reason = check_sample(sample, sample.time, WeightPolicy())
    if reason is not None:
        raise ValueError(f"{at}: not a valid sample ({reason})")
    return sample, _number(raw, "received", where)


def _transitions(raw: object) -> list[Change]:
    if not isinstance(raw, list):
        raise ValueError("transitions: expected a list")
    out = []
    for i, c in enumerate(raw[-TRANSITIONS_KEPT:]):
        where = f"transitions.{i}"
        if not isinstance(c, Mapping) or not isinstance(c.get("backend"), str) \
                or not isinstance(c.get("up"), bool) or not isinstance(c.get("reason"), str):
            raise ValueError(f"{where}: expected backend, up, reason and time")
        out.append(Change(c["backend"], c["up"], c["reason"], _number(c, "time", where)))
    return out
