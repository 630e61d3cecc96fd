"""Weighted Maglev tables (stopgap: classic Maglev fill with exact quotas)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

NO_BACKEND = 0xFFFFFFFF


def _h(name: str, salt: bytes) -> int:
    digest = hashlib.blake2b(name.encode(), digest_size=8, key=salt).digest()
    return int.from_bytes(digest, "little")


def _quotas(weights: Sequence[float], size: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    ideal = w / w.sum() * size
    q = np.floor(ideal).astype(np.int64)
    frac = ideal - q
    order = np.lexsort((np.arange(len(w)), -frac))
    q[order[: size - int(q.sum())]] += 1
    return q


def build_table(members: Sequence[tuple[int, str, float]], size: int = 65537) -> np.ndarray:
    live = sorted((m for m in members if m[2] > 0), key=lambda m: m[1])
    table = np.full(size, NO_BACKEND, dtype=np.uint32)
    if not live:
        return table
    ids = np.array([m[0] for m in live], dtype=np.uint32)
    quota = _quotas([m[2] for m in live], size)
    offset = np.array([_h(m[1], b"offset") % size for m in live], dtype=np.int64)
    skip = np.array([_h(m[1], b"skip") % (size - 1) + 1 for m in live], dtype=np.int64)
    nxt = np.zeros(len(live), dtype=np.int64)
    count = np.zeros(len(live), dtype=np.int64)
    filled = 0
    while filled < size:
        active = np.flatnonzero(count < quota)
        if len(active) == 1:
            table[table == NO_BACKEND] = ids[active[0]]
            break
        pending = active
        while len(pending):
            cand = (offset[pending] + nxt[pending] * skip[pending]) % size
            taken = table[cand] != NO_BACKEND
            while taken.any():
                nxt[pending[taken]] += 1
                p = pending[taken]
                cand[taken] = (offset[p] + nxt[p] * skip[p]) % size
                taken = table[cand] != NO_BACKEND
            _, first = np.unique(cand, return_index=True)
            win = np.zeros(len(pending), dtype=bool)
            win[first] = True
            w = pending[win]
            table[cand[win]] = ids[w]
            nxt[w] += 1
            count[w] += 1
            filled += len(w)
            pending = pending[~win]
    return table


def diff_tables(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    slots = np.flatnonzero(old != new).astype(np.uint32)
    return slots, new[slots]
