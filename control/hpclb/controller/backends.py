"""The weight and the health of every backend, as the control plane publishes
them: configuration x probes x heartbeats x telemetry.

* A backend the operator set down or draining keeps that state (config).
* A backend the health verdict takes down (``BackendHealth``) is DOWN in the
  data plane, weight 0: its flows re-hash at their next packet.
* Otherwise its weight is the configured one, times, in a ``dynamic`` pool,
  the capacity its node has left (``WeightTracker``: telemetry, smoothing,
  hysteresis, rate limit, quantisation). After a return, the weight ramps up
  over the pool's ``policy.slow_start_s``: the tracker does it for dynamic
  pools, :func:`static_ramp` for static ones.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from hpclb.balancing.weights import GpuSample, NodeSample, WeightTracker
from hpclb.config import BackendConfig, HpclbConfig, PoolConfig, WeightsMode
from hpclb.health.backend import BackendHealth, Change
from hpclb.telemetry.message import TelemetryMessage

log = logging.getLogger(__name__)

# A static pool's slow start moves in this many steps (each one a ring patch).
STATIC_RAMP_STEPS = 16


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
                      mem_total=total, rtt_ms=rtt_ms, gpus=gpus)


def static_ramp(up_since: float | None, now: float, slow_start_s: float) -> float:
    """Share of its weight a static-pool backend gets ``now`` after coming back
    up at ``up_since``: 1/16 steps from 1/16 to 1 over ``slow_start_s``."""
    if up_since is None or slow_start_s <= 0 or now - up_since >= slow_start_s:
        return 1.0
    done = max(now - up_since, 0.0) / slow_start_s
    return max(1, int(done * STATIC_RAMP_STEPS)) / STATIC_RAMP_STEPS


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    weight: float
    down: bool  # health verdict: DOWN in the data plane


class LiveWeights:
    def __init__(self, config: HpclbConfig) -> None:
        missed = config.telemetry.missed_heartbeats if config.telemetry else 3
        self.health = BackendHealth(missed)
        self.trackers: dict[str, WeightTracker] = {}
        self.config = config
        self.reconfigure(config)

    def reconfigure(self, config: HpclbConfig) -> None:
        """Follow a new configuration: a pool whose policy changed starts a fresh
        tracker; backends that left are forgotten."""
        self.config = config
        for name, pool in config.pools.items():
            old = self.trackers.get(name)
            if pool.weights is WeightsMode.DYNAMIC and (old is None or old.policy != pool.policy):
                self.trackers[name] = WeightTracker(pool.policy)
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

    # --- inputs --------------------------------------------------------------

    def apply(self, change: Change | None) -> Change | None:
        """Tell the tracker of the backend's pool (weight 0 now; slow start later)."""
        if change is None:
            return None
        log.warning("backend %s is %s: %s", change.backend, "up" if change.up else "DOWN",
                    change.reason)
        pool = self.config.pool_of(change.backend)
        if pool in self.trackers:
            self.trackers[pool].set_up(change.backend, change.up, change.time)
        return change

    def probe(self, backend: str, up: bool, reason: str, wall: float) -> Change | None:
        return self.apply(self.health.probe(backend, up, reason, wall))

    def telemetry(self, msg: TelemetryMessage, rtt_ms: float | None, mono: float,
                  wall: float) -> tuple[bool, Change | None]:
        """A heartbeat of ``msg.node`` (already authenticated as that node) and,
        in a dynamic pool, a sample. Returns (sample accepted, health change)."""
        change = self.apply(self.health.heartbeat(msg.node, msg.interval_s, mono, wall))
        pool = self.config.pool_of(msg.node)
        tracker = self.trackers.get(pool) if pool else None
        if tracker is None:
            return False, change
        return tracker.observe(to_node_sample(msg, rtt_ms), now=wall), change

    def expire(self, mono: float, wall: float,
               heard_since: float | None = -math.inf) -> list[Change]:
        """Missed heartbeats, counted only over time the appliance could hear
        (see BackendHealth.expire)."""
        return [c for c in map(self.apply, self.health.expire(mono, wall, heard_since)) if c]

    # --- outputs -------------------------------------------------------------

    def weight(self, pool_name: str, pool: PoolConfig, b: BackendConfig, now: float) -> float:
        if not self.health.is_up(b.name):
            return 0.0
        tracker = self.trackers.get(pool_name)
        if tracker is not None:
            return b.weight * tracker.weight(b.name, now)
        return b.weight * static_ramp(self.health.up_since(b.name), now,
                                      pool.policy.slow_start_s)

    def members(self, pool_name: str, now: float) -> tuple[Member, ...]:
        pool = self.config.pools[pool_name]
        return tuple(Member(b.name, self.weight(pool_name, pool, b, now),
                            not self.health.is_up(b.name)) for b in pool.backends)

    def report(self, now: float) -> dict[str, object]:
        health = self.health.snapshot()
        for pool in self.config.pools.values():
            for b in pool.backends:  # never probed nor heard: up as far as we know
                health.setdefault(b.name, {"up": True, "probe_up": True, "beats_missed": False,
                                          "beats_unknown": False})
        return {
            "health": dict(sorted(health.items())),
            "weights": {p: {m.name: m.weight for m in self.members(p, now)}
                        for p in self.config.pools},
            "samples_accepted": {p: t.accepted for p, t in self.trackers.items()},
            "samples_rejected": {p: t.rejection_counts() for p, t in self.trackers.items()},
        }
