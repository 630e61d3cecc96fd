#!/usr/bin/env python3
"""Ring disruption at many backends: Maglev at the ring sizes the data planes accept,
against alternative table constructions (issue 15, "beyond the anchors").

Question: when one of 1,000 backends leaves (or one weight steps), how many ring slots
change owner, as a multiple of the minimum, and how long does the build take? A fleet
behind ECMP breaks the flows of every slot that changed owner, beyond the departed
backend's own, when the router rehashes them to another appliance.

Constructions measured (every one a pure function of the backend set: names hashed with
a keyed blake2b, no input order, no history):

* ``maglev``: :func:`hpclb.balancing.maglev.build_table` (the C fill), at 65,537 slots
  (the default) and larger primes up to 1,048,573 (``RING_SIZE_MAX``, the largest ring
  both data planes accept: the XDP ring map holds 64 VIPs x ring_size u32, 256 MiB at
  the maximum; the DPDK plane allocates ring_size u32 per VIP).
* ``hrw``: weighted rendezvous (HRW) per slot, the top-scored backend owns the slot.
  Removal moves exactly the departed backend's slots by construction (argmax over a
  subset), but the shares are binomial, not the exact quotas.
* ``hrw-exact``: two-stage, HRW candidates (the top ``k`` backends of every slot) and a
  greedy assignment in descending score order under the exact largest-remainder quotas
  of :func:`hpclb.balancing.maglev.quotas` (the stable matching for common scores);
  slots whose ``k`` candidates are all full are placed the same way over every backend.
* ``hrw-flex``: as ``hrw-exact`` but the rounding is left to the assignment: first every
  backend up to floor(ideal), then the leftover slots to backends whose ideal share has
  a fraction (at most one each), so the shares are still within one slot of the ideal
  but which backends round up follows where the slots fall, not a fixed order.
* ``walk-exact``: ``hrw-exact`` with Maglev's own permutations as the preferences (a
  backend ranks the slots in the order of its walk, ``offset + j * skip``): the same
  stable matching, but pure integer walks (no float logarithm: keys are correctly
  rounded divisions ``(j + 0.5) / quota``, ties by canonical position), and about
  2 * size pairs instead of size * N scores. Placed in a Python loop here.
* ``ring``: consistent hashing on a circle (Karger), 64 points per unit of weight; a
  slot goes to the owner of the next point clockwise. Minimal on removal, cheap (numpy),
  shares far from exact.
* ``ring-exact``: ``ring``'s next 16 points as candidates, nearest first, placed greedily
  under the exact quotas as ``hrw-exact`` does.

Rows beyond ``RING_SIZE_MAX`` (marked ``beyond_data_plane_limit``) build a Maglev ring no
data plane would accept, to show how large it would have to be; rows at other primes
(10,007 to 300,007 slots with 100 or 316 backends) show that disruption follows
``size / N**2`` (the share of the remaining backends whose quota can rise when one
leaves: with exact quotas the departed backend's size/N slots can only go to about
size/N backends, so when size/N << N most of them first land on a full backend and
displace another slot).

The HRW prototypes score with float64 logarithms (weighted rendezvous: -w / ln u) and
place slots in a Python loop: good enough to measure their disruption, not their
fleet-consistency (a libm ``log`` is not correctly rounded everywhere) nor their best
build time (reported as measured, and the candidate stage alone, which numpy vectorises,
as a lower bound).

Metrics: ``changed`` slots whose owner differs; ``minimum`` the fewest any ring with the
new shares must change, the sum over backends of max(0, new count - old count) (for a
removal, the departed backend's slots); ``ratio`` = changed / minimum. Build time: the
median of several builds (or the one build, where ``build_repeats`` is 1), wall clock,
on this host (2 CPUs shared with other jobs: expect noise). Output: JSON (default
results/maglev_disruption.json); ``--only CONSTRUCTION`` runs part of the table and
replaces those rows in an existing output, so that every run stays under two minutes:

    .venv/bin/python perf/maglev_disruption.py --only maglev                  # ~40 s
    .venv/bin/python perf/maglev_disruption.py --only hrw --only ring --only ring-exact
    .venv/bin/python perf/maglev_disruption.py --only hrw-exact --only hrw-flex  # ~95 s
    .venv/bin/python perf/maglev_disruption.py --only walk-exact              # ~90 s

(without ``--only`` the whole table runs at once: about five minutes on that host).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hpclb.balancing import maglev
from hpclb.contract.tables import RING_SIZE_DEFAULT, RING_SIZE_MAX

Member = tuple[int, str, float]
Builder = Callable[[Sequence[Member], int], np.ndarray]

GRID = 256  # the live weight policy's grid (control_maglev.weight_of)


# ---- members -------------------------------------------------------------------


def members_equal(n: int) -> list[Member]:
    return [(i, f"node-{i}", 1.0) for i in range(n)]


def members_unequal(n: int, rng: np.random.Generator) -> list[Member]:
    """The live policy's weights: 0.625 - 0.4 * cpu_load on the 1/256 grid."""
    cpu = rng.uniform(0.0, 1.0, n)
    return [(i, f"node-{i}", round((0.625 - 0.4 * float(c)) * GRID) / GRID)
            for i, c in enumerate(cpu)]


# ---- HRW prototypes ----------------------------------------------------------


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _name_key(name: str) -> int:
    d = hashlib.blake2b(name.encode(), digest_size=8, person=b"hpclb-hrw-proto").digest()
    return int.from_bytes(d, "little")


def hrw_candidates(members: Sequence[Member], size: int, k: int,
                   chunk: int = 4096) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per slot the ``k`` best backends (indices into the positive-weight members, best
    first) and their scores; also the slot keys (for full rows later)."""
    live = [m for m in members if m[2] > 0]
    keys = np.array([_name_key(m[1]) for m in live], dtype=np.uint64)
    weights = np.array([m[2] for m in live], dtype=np.float64)
    slot_keys = _splitmix(np.arange(size, dtype=np.uint64) * np.uint64(0x2545F4914F6CDD1D))
    k = min(k, len(live))
    idx = np.empty((size, k), dtype=np.int64)
    sc = np.empty((size, k), dtype=np.float64)
    for start in range(0, size, chunk):
        s = scores(slot_keys[start:start + chunk], keys, weights)
        part = np.argpartition(-s, k - 1, axis=1)[:, :k]
        ps = np.take_along_axis(s, part, axis=1)
        order = np.argsort(-ps, axis=1)
        idx[start:start + chunk] = np.take_along_axis(part, order, axis=1)
        sc[start:start + chunk] = np.take_along_axis(ps, order, axis=1)
    return idx, sc, slot_keys


def scores(slot_keys: np.ndarray, keys: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted rendezvous scores -w / ln(u), u uniform in (0, 1) from the pair hash."""
    h = _splitmix(slot_keys[:, None] ^ keys[None, :])
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    result: np.ndarray = -weights[None, :] / np.log(u)
    return result


def _greedy(order_slots: np.ndarray, order_backends: np.ndarray, cap: np.ndarray,
            owner: np.ndarray) -> None:
    """Place (slot, backend) pairs in the given order: a slot not yet placed goes to a
    backend with capacity left. Updates ``owner`` and ``cap`` in place."""
    own = owner.tolist()
    c = cap.tolist()
    todo = own.count(-1)
    for s, b in zip(order_slots.tolist(), order_backends.tolist(), strict=True):
        if own[s] < 0 and c[b] > 0:
            own[s] = b
            c[b] -= 1
            todo -= 1
            if not todo:
                break
    owner[:] = own
    cap[:] = c


def _place(idx: np.ndarray, sc: np.ndarray, cap: np.ndarray, owner: np.ndarray,
           slot_keys: np.ndarray, keys: np.ndarray, weights: np.ndarray,
           rows: np.ndarray | None = None) -> None:
    """Greedy in descending score over the candidate pairs of the unplaced slots, then
    over full rows for slots whose candidates were all full."""
    todo = np.flatnonzero(owner < 0) if rows is None else rows
    if todo.size:
        s = np.repeat(todo, idx.shape[1])
        b = idx[todo].ravel()
        o = np.argsort(-sc[todo].ravel(), kind="stable")
        _greedy(s[o], b[o], cap, owner)
    left = np.flatnonzero(owner < 0)
    if left.size and cap.sum() > 0:
        full = scores(slot_keys[left], keys, weights)
        s = np.repeat(left, full.shape[1])
        b = np.tile(np.arange(full.shape[1]), left.size)
        o = np.argsort(-full.ravel(), kind="stable")
        _greedy(s[o], b[o], cap, owner)


def _live_arrays(members: Sequence[Member]) -> tuple[list[Member], np.ndarray, np.ndarray]:
    live = [m for m in members if m[2] > 0]
    return (live, np.array([_name_key(m[1]) for m in live], dtype=np.uint64),
            np.array([m[2] for m in live], dtype=np.float64))


def build_hrw(members: Sequence[Member], size: int) -> np.ndarray:
    live, _, _ = _live_arrays(members)
    idx, _, _ = hrw_candidates(live, size, 1)
    ids = np.array([m[0] for m in live], dtype=np.uint32)
    out: np.ndarray = ids[idx[:, 0]]
    return out


def build_hrw_exact(members: Sequence[Member], size: int, k: int = 8) -> np.ndarray:
    live, keys, weights = _live_arrays(members)
    idx, sc, slot_keys = hrw_candidates(live, size, k)
    q = maglev.quotas(live, size)
    cap = np.array([q[m[0]] for m in live], dtype=np.int64)
    owner = np.full(size, -1, dtype=np.int64)
    _place(idx, sc, cap, owner, slot_keys, keys, weights)
    assert (owner >= 0).all()
    ids = np.array([m[0] for m in live], dtype=np.uint32)
    out: np.ndarray = ids[owner]
    return out


def _ideal_floor_frac(live: Sequence[Member], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact floor(size * w / sum w) and whether there is a fraction (integer arithmetic)."""
    ratios = [float(m[2]).as_integer_ratio() for m in live]
    den = max(q for _, q in ratios)
    w = [p * (den // q) for p, q in ratios]
    total = sum(w)
    return (np.array([size * x // total for x in w], dtype=np.int64),
            np.array([size * x % total != 0 for x in w], dtype=bool))


def build_hrw_flex(members: Sequence[Member], size: int, k: int = 8) -> np.ndarray:
    live, keys, weights = _live_arrays(members)
    idx, sc, slot_keys = hrw_candidates(live, size, k)
    floor, frac = _ideal_floor_frac(live, size)
    owner = np.full(size, -1, dtype=np.int64)
    cap = floor.copy()
    # Phase 1: everyone up to floor, over the candidates only (the rest wait).
    s = np.repeat(np.arange(size), idx.shape[1])
    o = np.argsort(-sc.ravel(), kind="stable")
    _greedy(s[o], idx.ravel()[o], cap, owner)
    # Phase 2a: backends still under floor (their candidates ran short), full rows.
    _place(idx, sc, cap, owner, slot_keys, keys, weights, rows=np.array([], dtype=np.int64))
    # Phase 2b: the leftovers, at most one more each to backends with a fraction.
    cap = frac.astype(np.int64)
    _place(idx, sc, cap, owner, slot_keys, keys, weights)
    assert (owner >= 0).all()
    ids = np.array([m[0] for m in live], dtype=np.uint32)
    out: np.ndarray = ids[owner]
    return out


def circle_candidates(live: Sequence[Member], size: int, k: int,
                      vnodes: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Consistent hashing on a circle (Karger): every backend has about ``vnodes *
    w / mean(w)`` points; a slot's candidates are the owners of the next ``k`` points
    clockwise (repeats kept), its score minus the distance (nearer first)."""
    # Points per unit of weight, not per mean weight: a backend's points must not
    # depend on who else is present, or a removal would move more than its slots.
    w = np.array([m[2] for m in live], dtype=np.float64)
    per = np.maximum(1, np.rint(vnodes * w)).astype(np.int64)
    owner = np.repeat(np.arange(len(live)), per)
    rank = np.arange(owner.size) - np.repeat(np.cumsum(per) - per, per)
    keys = np.array([_name_key(m[1]) for m in live], dtype=np.uint64)
    pos = _splitmix(keys[owner] ^ _splitmix(rank.astype(np.uint64)))
    order = np.argsort(pos, kind="stable")
    pos, owner = pos[order], owner[order]
    slot_pos = _splitmix(np.arange(size, dtype=np.uint64) * np.uint64(0x2545F4914F6CDD1D))
    first = np.searchsorted(pos, slot_pos)
    at = (first[:, None] + np.arange(k)[None, :]) % pos.size
    with np.errstate(over="ignore"):
        dist = (pos[at] - slot_pos[:, None]).astype(np.float64)  # wraps mod 2**64
    return owner[at], -dist


def build_ring(members: Sequence[Member], size: int, k: int = 1) -> np.ndarray:
    live, _, _ = _live_arrays(members)
    idx, _ = circle_candidates(live, size, 1)
    ids = np.array([m[0] for m in live], dtype=np.uint32)
    out: np.ndarray = ids[idx[:, 0]]
    return out


def build_ring_exact(members: Sequence[Member], size: int, k: int = 16) -> np.ndarray:
    live, keys, weights = _live_arrays(members)
    idx, sc = circle_candidates(live, size, k)
    q = maglev.quotas(live, size)
    cap = np.array([q[m[0]] for m in live], dtype=np.int64)
    owner = np.full(size, -1, dtype=np.int64)
    s = np.repeat(np.arange(size), k)
    o = np.argsort(-sc.ravel(), kind="stable")
    _greedy(s[o], idx.ravel()[o], cap, owner)
    # Slots whose k points all belong to full backends: HRW over the rest.
    slot_keys = _splitmix(np.arange(size, dtype=np.uint64) * np.uint64(0x2545F4914F6CDD1D))
    _place(idx, sc, cap, owner, slot_keys, keys, weights, rows=np.array([], dtype=np.int64))
    assert (owner >= 0).all()
    ids = np.array([m[0] for m in live], dtype=np.uint32)
    out: np.ndarray = ids[owner]
    return out


def build_walk_exact(members: Sequence[Member], size: int, depth: int = 2) -> np.ndarray:
    """Maglev's permutations as preferences, placed as ``hrw-exact`` places: backend b
    ranks slot ``(offset + j * skip) % size`` at depth j (Maglev's walk, same name hash);
    pairs go in ascending ``(j + 0.5) / quota`` (a correctly rounded division, ties by
    canonical position), a slot to the first backend with quota left that reaches it.
    The stable matching of slots and backends under those common scores; the pairs are
    enumerated ``depth`` quotas deep at a time, so only about 2 * size pairs are made."""
    prepared = maglev._prepare(members, size, b"")  # Maglev's quotas, offsets, skips
    q = np.asarray(prepared.quota, dtype=np.int64)
    off = np.asarray(prepared.offset, dtype=np.int64)
    skip = np.asarray(prepared.skip, dtype=np.int64)
    cap = q.copy()
    owner = np.full(size, -1, dtype=np.int64)
    band = 0
    while (owner < 0).any():
        active = np.flatnonzero(cap > 0)
        free = np.flatnonzero(owner < 0)
        if band and free.size * active.size <= 8_000_000:
            # The tail: every remaining pair at once, each slot's depth in each walk
            # computed directly (j = (slot - offset) / skip mod size, size prime). Every
            # pair of a free slot and a backend with quota left lies deeper than the
            # bands already placed (else the slot would have been taken), so this is
            # the same greedy, only cheaper than walking on.
            inv = np.array([pow(int(x), size - 2, size) for x in skip[active]], dtype=np.int64)
            j = ((free[:, None] - off[active][None, :]) % size * inv[None, :]) % size
            b = np.broadcast_to(active[None, :], j.shape).ravel()
            slot = np.broadcast_to(free[:, None], j.shape).ravel()
            key = (j.ravel() + 0.5) / q[b]
            o = np.lexsort((b, key))
            _greedy(slot[o], b[o], cap, owner)
            break
        lo, hi = band * depth * q[active], (band + 1) * depth * q[active]
        count = hi - lo
        b = np.repeat(active, count)
        j = np.repeat(lo - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
        slot = (off[b] + j % size * skip[b]) % size
        key = (j + 0.5) / q[b]
        o = np.lexsort((b, key))
        _greedy(slot[o], b[o], cap, owner)
        band += 1
    assert (owner >= 0).all()
    ids = np.array([m.id for m in prepared.members], dtype=np.uint32)
    out: np.ndarray = ids[owner]
    return out


def build_maglev(members: Sequence[Member], size: int) -> np.ndarray:
    return maglev.build_table(members, size)


BUILDERS: dict[str, Builder] = {
    "maglev": build_maglev,
    "hrw": build_hrw,
    "hrw-exact": build_hrw_exact,
    "hrw-flex": build_hrw_flex,
    "walk-exact": build_walk_exact,
    "ring": build_ring,
    "ring-exact": build_ring_exact,
}


# ---- measurements ------------------------------------------------------------


def counts(table: np.ndarray, n_ids: int) -> np.ndarray:
    return np.bincount(table.astype(np.int64), minlength=n_ids)


def minimum(old: np.ndarray, new: np.ndarray, n_ids: int) -> int:
    return int(np.maximum(counts(new, n_ids) - counts(old, n_ids), 0).sum())


def share_error(table: np.ndarray, members: Sequence[Member], size: int) -> dict[str, Any]:
    """Largest |slots - ideal| over backends, in slots and relative to the ideal."""
    n = max(m[0] for m in members) + 1
    c = counts(table, n)
    total = sum(m[2] for m in members)
    ideal = np.array([size * m[2] / total for m in members])
    got = np.array([c[m[0]] for m in members], dtype=np.float64)
    err = np.abs(got - ideal)
    rel = err / np.where(ideal > 0, ideal, 1)
    return {"max_slots": round(float(err.max()), 3),
            "max_relative": round(float(rel.max()), 4),
            "within_one_slot": bool((err < 1).all())}


def compare(builder: Builder, old_members: Sequence[Member], new_members: Sequence[Member],
            size: int, old: np.ndarray) -> dict[str, Any]:
    new = builder(new_members, size)
    n_ids = max(m[0] for m in old_members) + 1
    changed = int(np.count_nonzero(old != new))
    least = minimum(old, new, n_ids)
    return {"changed": changed, "minimum": least,
            "ratio": round(changed / least, 3) if least else None}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    r = [x["ratio"] for x in rows if x["ratio"] is not None]
    if not r:
        return {"n": 0}
    return {"n": len(r), "median": round(statistics.median(r), 3),
            "min": round(min(r), 3), "max": round(max(r), 3)}


def case(name: str, size: int, members: list[Member], removals: int, steps: int,
         repeats: int) -> dict[str, Any]:
    builder = BUILDERS[name]
    n = len(members)
    t0 = time.perf_counter()
    base = builder(members, size)
    times = [time.perf_counter() - t0] if not repeats else []
    for _ in range(repeats):
        t0 = time.perf_counter()
        builder(members, size)
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"construction": name, "ring_size": size, "backends": n,
                           "build_ms_median": round(statistics.median(times) * 1e3, 2),
                           "build_repeats": max(repeats, 1),
                           "beyond_data_plane_limit": size > RING_SIZE_MAX,
                           "size_over_n_squared": round(size / n**2, 3),
                           "shares": share_error(base, members, size)}
    if name.startswith("hrw"):
        t0 = time.perf_counter()
        hrw_candidates(members, size, 1 if name == "hrw" else 8)
        out["candidate_stage_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    gone = sorted({int(x) for x in np.linspace(0, n - 1, removals)})
    rem = [dict(compare(builder, members, [m for m in members if m[0] != g], size, base),
                backend=g) for g in gone]
    out["removal"] = {"samples": rem, "ratio": summary(rem)}
    # One weight step at a time: ``steps`` backends spread over the ids, each x0.9 and
    # x1.1 on the policy's 1/256 grid (a step that rounds to no change is skipped).
    stepped = []
    for j, at in enumerate(sorted({int(x) for x in np.linspace(0, n - 1, steps)})
                           if steps else []):
        for factor in (0.9, 1.1):
            w = members[at][2]
            neww = round(w * factor * GRID) / GRID
            if neww == w:
                continue
            new_members = [(i, nm, neww if i == at else x) for i, nm, x in members]
            stepped.append(dict(compare(builder, members, new_members, size, base),
                                backend=at, factor=factor, step=j))
    out["weight_step"] = {
        "samples": stepped,
        "ratio_down": summary([s for s in stepped if s["factor"] < 1]),
        "ratio_up": summary([s for s in stepped if s["factor"] > 1]),
    }
    return out


# construction, ring size, backends, removals sampled, weight-step backends, build
# repeats (0: the time of the first build), weight sets ("both" or "equal").
PlanRow = tuple[str, int, int, int, int, int, str]
PLAN: list[PlanRow] = [
    # The current builder at the sizes the data planes accept (primes up to RING_SIZE_MAX).
    ("maglev", RING_SIZE_DEFAULT, 100, 5, 3, 9, "both"),
    ("maglev", RING_SIZE_DEFAULT, 1000, 5, 3, 9, "both"),
    ("maglev", RING_SIZE_DEFAULT, 10000, 3, 2, 5, "both"),
    ("maglev", 131071, 1000, 5, 3, 7, "both"),
    ("maglev", 262139, 1000, 5, 3, 5, "both"),
    ("maglev", 524287, 1000, 3, 2, 5, "both"),
    ("maglev", RING_SIZE_MAX, 100, 3, 2, 3, "both"),
    ("maglev", RING_SIZE_MAX, 1000, 3, 2, 3, "both"),
    ("maglev", RING_SIZE_MAX, 10000, 2, 1, 3, "both"),
    # Beyond what the data planes accept (size/N^2 = 3 at N = 1000): how large it would
    # have to be.
    ("maglev", 3000017, 1000, 2, 0, 0, "equal"),
    # Scaling: disruption follows size / N^2 (the share of backends whose quota can rise
    # when one leaves), whatever N.
    ("maglev", 10007, 100, 3, 0, 3, "equal"),
    ("maglev", 30011, 100, 3, 0, 3, "equal"),
    ("maglev", 100003, 316, 3, 0, 3, "equal"),
    ("maglev", 300007, 316, 3, 0, 3, "equal"),
    # Alternatives (prototypes).
    ("hrw", RING_SIZE_DEFAULT, 100, 3, 2, 0, "both"),
    ("hrw", RING_SIZE_DEFAULT, 1000, 1, 0, 0, "equal"),
    ("walk-exact", RING_SIZE_DEFAULT, 100, 3, 2, 0, "both"),
    ("walk-exact", RING_SIZE_DEFAULT, 1000, 2, 1, 0, "equal"),
    ("walk-exact", RING_SIZE_MAX, 1000, 2, 1, 0, "equal"),
    ("walk-exact", RING_SIZE_MAX, 1000, 2, 0, 0, "unequal"),
    ("ring", RING_SIZE_DEFAULT, 1000, 2, 0, 3, "equal"),
    ("ring-exact", RING_SIZE_DEFAULT, 100, 3, 0, 0, "equal"),
    ("ring-exact", RING_SIZE_DEFAULT, 1000, 2, 0, 0, "equal"),
    ("hrw-exact", RING_SIZE_DEFAULT, 100, 3, 2, 0, "both"),
    ("hrw-exact", RING_SIZE_DEFAULT, 1000, 2, 1, 0, "both"),
    ("hrw-exact", 10007, 100, 3, 0, 0, "equal"),
    ("hrw-exact", 30011, 100, 3, 0, 0, "equal"),
    ("hrw-exact", 100003, 316, 2, 0, 0, "equal"),
    ("hrw-flex", RING_SIZE_DEFAULT, 100, 3, 0, 0, "equal"),
    ("hrw-flex", RING_SIZE_DEFAULT, 1000, 2, 0, 0, "equal"),
]


@contextlib.contextmanager
def beyond_limit(size: int) -> Iterator[None]:
    """Lets maglev build a ring larger than RING_SIZE_MAX (a measurement only: no data
    plane would accept it)."""
    if size <= RING_SIZE_MAX:
        yield
        return
    saved = maglev.check_ring_size
    maglev.check_ring_size = lambda s: int(s)  # type: ignore[assignment]
    try:
        yield
    finally:
        maglev.check_ring_size = saved  # type: ignore[assignment]


def _key(row: dict[str, Any]) -> tuple[str, int, int, str]:
    return (row["construction"], row["ring_size"], row["backends"], row["weights"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", type=Path, default=Path("results/maglev_disruption.json"))
    ap.add_argument("--only", action="append", default=[],
                    help="run only these constructions (repeatable)")
    ap.add_argument("--max-backends", type=int, default=10000)
    ap.add_argument("--weights", choices=("equal", "unequal", "both"), default="both")
    ap.add_argument("--seed", type=int, default=15)
    args = ap.parse_args(argv)
    doc: dict[str, Any] = {
        "what": "slots changed / minimum for one backend leaving and one weight step; "
                "build time (median ms, wall clock)",
        "host": {"python": platform.python_version(), "machine": platform.machine(),
                 "numpy": np.__version__,
                 "c_fill": maglev.c_fill_missing() or "loaded"},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": [],
    }
    t_all = time.perf_counter()
    for name, size, n, removals, steps, repeats, weights in PLAN:
        if (args.only and name not in args.only) or n > args.max_backends:
            continue
        kinds = [k for k in ("equal", "unequal")
                 if weights in ("both", k) and args.weights in ("both", k)]
        for kind in kinds:
            rng = np.random.default_rng(args.seed)
            members = members_equal(n) if kind == "equal" else members_unequal(n, rng)
            t0 = time.perf_counter()
            with beyond_limit(size):
                row = case(name, size, members, removals, steps, repeats)
            row["weights"] = kind
            row["case_s"] = round(time.perf_counter() - t0, 1)
            doc["rows"].append(row)
            print(f"{name:10s} size {size:>8,} N {n:>6,} {kind:8s} build "
                  f"{row['build_ms_median']:>9.2f} ms  removal x{row['removal']['ratio']} "
                  f" down x{row['weight_step']['ratio_down'].get('median')} "
                  f"up x{row['weight_step']['ratio_up'].get('median')} "
                  f"shares {row['shares']}  ({row['case_s']} s)", flush=True)
    doc["total_s"] = round(time.perf_counter() - t_all, 1)
    if args.only and args.output.exists():
        # A partial run (--only) replaces its own rows and keeps the others, so the
        # whole table can be measured in runs of under two minutes each.
        kept = json.loads(args.output.read_text()).get("rows", [])
        mine = {_key(r) for r in doc["rows"]}
        doc["rows"] = [r for r in kept if _key(r) not in mine] + doc["rows"]
        def place(r: dict[str, Any]) -> tuple[int, str]:
            at = [i for i, p in enumerate(PLAN) if (p[0], p[1], p[2]) == _key(r)[:3]]
            return (at[0] if at else len(PLAN), r["weights"])

        doc["rows"].sort(key=place)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.output} ({doc['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
