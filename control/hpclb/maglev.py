"""Weighted Maglev lookup tables: pure functions, deterministic.

A table has ``size`` slots (a prime, 65537 by default); slot ``i`` names the
backend that new flows hashing to ``i`` go to. Built as in the Maglev paper
(Eisenbud et al., NSDI 2016): every backend has a permutation of the slots
(an offset and a skip derived from its name) and the backends take turns, in
name order, claiming the next free slot of their permutation. Weights enter as
quotas: each backend's slot count is its weight share of ``size``, rounded by
largest remainder, and a backend that has its quota sits out the remaining
turns. So the shares are exact (to one slot), a weight of 0 gets no slot,
and the table depends only on the set of (name, weight) pairs, not their order.

Removing one of N equal backends moves its own 1/N of the slots plus a few
more that the changed turn order shifts (measured in tests/unit/test_maglev.py).
``diff_tables`` gives the slots two tables disagree on, so a weight change is
pushed to the data plane as a patch of those slots only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

NO_BACKEND = 0xFFFFFFFF

# (backend id, name, weight): the id is what the data plane stores, the name
# seeds the permutation (so a backend keeps its preferences whatever id it gets).
Member = tuple[int, str, float]


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, int(n**0.5) + 1))


def _hash64(name: str, salt: bytes) -> int:
    digest = hashlib.blake2b(name.encode(), digest_size=8, key=salt).digest()
    return int.from_bytes(digest, "little")


def quotas(weights: Sequence[float], size: int) -> list[int]:
    """Slots per backend: weight shares of ``size``, largest remainder rounding.

    Ties in the remainder go to the earlier backend (callers pass name order).
    """
    w = np.asarray(weights, dtype=np.float64)
    ideal = w / w.sum() * size
    q = np.floor(ideal).astype(np.int64)
    short = size - int(q.sum())
    order = np.lexsort((np.arange(len(w)), -(ideal - q)))  # largest remainder first
    q[order[:short]] += 1
    return [int(x) for x in q]


def build_table(members: Sequence[Member], size: int = 65537) -> np.ndarray:
    """The weighted Maglev table of ``members`` as a uint32 array of ``size`` ids."""
    if not is_prime(size):
        raise ValueError(f"table size must be a prime, {size} is not")
    names = [m[1] for m in members]
    if len(set(names)) != len(names):
        raise ValueError("backend names must be unique")
    if any(not np.isfinite(m[2]) or m[2] < 0 for m in members):
        raise ValueError("weights must be finite and >= 0")
    live = sorted((m for m in members if m[2] > 0), key=lambda m: m[1])
    table = np.full(size, NO_BACKEND, dtype=np.uint32)
    if not live:
        return table

    quota = quotas([m[2] for m in live], size)
    offset = [_hash64(m[1], b"offset") % size for m in live]
    skip = [_hash64(m[1], b"skip") % (size - 1) + 1 for m in live]
    turn = [0] * len(live)  # how far each backend has walked its permutation
    owner = [-1] * size
    filled = 0
    count = [0] * len(live)
    active = list(range(len(live)))
    while filled < size:
        for i in active:
            slot = (offset[i] + turn[i] * skip[i]) % size
            while owner[slot] >= 0:  # ends: the permutation visits every slot
                turn[i] += 1
                slot = (offset[i] + turn[i] * skip[i]) % size
            owner[slot] = i
            turn[i] += 1
            count[i] += 1
            filled += 1
        active = [i for i in active if count[i] < quota[i]]
    ids = np.array([m[0] for m in live], dtype=np.uint32)
    return ids[np.array(owner, dtype=np.int64)]


def diff_tables(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(slots, new values) where the two tables differ."""
    if old.shape != new.shape:
        raise ValueError("tables of different sizes cannot be diffed")
    slots = np.flatnonzero(old != new).astype(np.uint32)
    return slots, new[slots].astype(np.uint32)


def apply_patch(table: np.ndarray, slots: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A copy of ``table`` with ``slots`` set to ``values``."""
    patched = table.copy()
    patched[slots] = values
    return patched
