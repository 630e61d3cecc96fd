"""Maglev ring cost on the controller: build time by backend count, and the slots one
weight step moves against the theoretical minimum. Pure computation (no root, no lab).

* **build time**: the ring of N backends on ``ring_size`` slots, built the way the
  controller builds it (:func:`hpclb.controller.core.pool_ring`, which fills in C when
  ``libhpclb_maglev.so`` loaded) and with the Python fill (``use_c=False``), the same
  table; wall time of the whole build (name hashing, apportionment, turn order, fill).
* **slots moved**: from a heterogeneous ring, one backend's weight changes at a time,
  drawn as the live path draws it (``control_reaction``'s paced samples: a node's
  cpu_load moves by at least ``min_cpu_step``, its weight is ``0.625 - 0.4 cpu`` on the
  1/256 grid), and the ring is rebuilt; slots whose owner changed against the minimum,
  the sum over owners of max(0, new slots - old slots). Increases and decreases are
  reported apart (:mod:`hpclb.balancing.maglev` puts a heavier backend's extra claims
  last; a lighter one's lost claims shift the later ones): whether the direction of the
  step matters shows there.

The data planes hold at most ``MAX_BACKENDS`` (4,096) backends; larger N is measured as
a controller-side cost only (the ring builder itself has no such limit).
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from hpclb.balancing import maglev
from hpclb.contract.tables import NO_BACKEND

GRID = 256  # the weight policy's default grid: weights are multiples of 1/256


def stats(values: list[float], scale: float = 1e3, digits: int = 3) -> dict[str, Any]:
    """n, p50, p99, max, min, mean of ``values`` x ``scale`` (seconds -> ms by default)."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None, "min": None, "mean": None}
    a = np.asarray(values, dtype=float) * scale
    return {"n": int(a.size),
            "p50": round(float(np.percentile(a, 50)), digits),
            "p99": round(float(np.percentile(a, 99)), digits),
            "max": round(float(a.max()), digits),
            "min": round(float(a.min()), digits),
            "mean": round(float(a.mean()), digits)}


def node_names(n: int) -> list[str]:
    return [f"n{i:04d}" for i in range(n)]


def weight_of(cpu: float) -> float:
    """The dynamic weight of a node at ``cpu`` load with memory fixed at 25 % and no
    probe (the live benchmark's policy): 0.625 - 0.4 cpu, on the 1/256 grid."""
    return round((0.625 - 0.4 * cpu) * GRID) / GRID


def owner_counts(ring: np.ndarray, owners: int) -> np.ndarray:
    r = np.where(ring == NO_BACKEND, owners, ring).astype(np.int64)
    return np.bincount(r, minlength=owners + 1)


def minimum_moves(old: np.ndarray, new: np.ndarray) -> int:
    """Slots that must change owner to go from ``old``'s shares to ``new``'s."""
    top = int(max(np.where(old == NO_BACKEND, 0, old).max(initial=0),
                  np.where(new == NO_BACKEND, 0, new).max(initial=0))) + 1
    return int(np.maximum(owner_counts(new, top) - owner_counts(old, top), 0).sum())


def _new_cpu(rng: random.Random, old: float, min_step: float) -> float:
    while True:
        c = rng.uniform(0.0, 1.0)
        if abs(c - old) >= min_step and weight_of(c) != weight_of(old):
            return c


def build_time(n: int, ring_size: int, repeats: int, rng: random.Random,
               fill: str) -> dict[str, Any]:
    """Wall time of one ring build of ``n`` backends, ``repeats`` times; ``fill`` "c"
    (the controller's path) or "python"."""
    from hpclb.controller.backends import BackendDecision, BackendState
    from hpclb.controller.core import pool_ring

    out: dict[str, Any] = {"backends": n, "ring_size": ring_size, "fill": fill,
                           "repeats": repeats}
    if fill == "c" and maglev.c_fill_missing() is not None:
        out["skipped"] = f"C fill not loaded: {maglev.c_fill_missing()}"
        return out
    names = node_names(n)
    weights = [weight_of(rng.uniform(0.0, 1.0)) for _ in names]
    decisions = tuple(BackendDecision(name, BackendState.UP, w)
                      for name, w in zip(names, weights, strict=True))
    ids = {name: i for i, name in enumerate(names)}
    members = [(i, name, w) for i, (name, w) in enumerate(zip(names, weights, strict=True))]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if fill == "c":
            pool_ring(decisions, ids, ring_size)
        else:
            maglev.build_table(members, ring_size, use_c=False)
        times.append(time.perf_counter() - t0)
    out["build_ms"] = stats(times)
    out["samples_ms"] = [round(t * 1e3, 3) for t in times]
    return out


def weight_step_moves(n: int, ring_size: int, steps: int, rng: random.Random,
                      min_cpu_step: float = 0.1) -> dict[str, Any]:
    """``steps`` single-backend weight changes on a ring of ``n``, each rebuilt from the
    last: slots changed against the minimum, per step and summarised."""
    names = node_names(n)
    cpu = [rng.uniform(0.0, 1.0) for _ in names]

    def ring() -> np.ndarray:
        return maglev.build_table([(i, name, weight_of(c))
                                   for i, (name, c) in enumerate(zip(names, cpu, strict=True))],
                                  ring_size)

    old = ring()
    rows: list[dict[str, Any]] = []
    for _ in range(steps):
        i = rng.randrange(n)
        before = weight_of(cpu[i])
        cpu[i] = _new_cpu(rng, cpu[i], min_cpu_step)
        new = ring()
        changed = int(np.count_nonzero(old != new))
        minimum = minimum_moves(old, new)
        rows.append({"backend": names[i], "weight_from": before, "weight_to": weight_of(cpu[i]),
                     "direction": "up" if weight_of(cpu[i]) > before else "down",
                     "changed_slots": changed, "min_slots": minimum,
                     "ratio": round(changed / minimum, 4) if minimum else None})
        old = new

    def ratios(direction: str | None) -> dict[str, Any]:
        return stats([r["ratio"] for r in rows if r["ratio"] is not None
                      and direction in (None, r["direction"])], scale=1)

    return {"backends": n, "ring_size": ring_size, "steps": steps,
            "min_cpu_step": min_cpu_step,
            "changed_slots": stats([r["changed_slots"] for r in rows], scale=1, digits=1),
            "min_slots": stats([r["min_slots"] for r in rows], scale=1, digits=1),
            "ratio": ratios(None), "ratio_up": ratios("up"), "ratio_down": ratios("down"),
            "per_step": rows}
