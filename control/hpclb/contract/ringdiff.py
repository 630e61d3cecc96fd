"""Rings change through patches.

:func:`diff_tables` gives only the slots whose owner changed (a weight change
must not rewrite 65537 slots on the data plane: the table protocol's patch-ring
operation, ``struct lb_ring_patch``). :func:`apply_patch` is what a data plane
does with such a patch (``patch_ring``, with its refusals): the reference the
tests hold ``diff_tables`` to.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hpclb.contract.tables import NO_BACKEND


def _as_ring(name: str, table: ArrayLike) -> NDArray[np.uint32]:
    t = np.asarray(table)
    if t.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional")
    if t.dtype != np.uint32:
        if t.dtype.kind not in "iu" or (t.size and (t.min() < 0 or t.max() > NO_BACKEND)):
            raise TypeError(f"{name} must hold uint32 backend ids")
        t = t.astype(np.uint32)
    return t


def diff_tables(
    old: ArrayLike, new: ArrayLike
) -> tuple[NDArray[np.uint32], NDArray[np.uint32]]:
    """The patch from ``old`` to ``new``: (changed slot indices ascending, their new ids).

    This is what a weight change pushes to a data plane (the table protocol's
    patch-ring operation, ``struct lb_ring_patch``): only the slots whose owner
    changed. ``apply_patch(old, *diff_tables(old, new))`` equals ``new``.
    """
    o = _as_ring("old", old)
    n = _as_ring("new", new)
    if o.shape != n.shape:
        raise ValueError(f"rings differ in size: {o.size} and {n.size}")
    slots = np.flatnonzero(o != n).astype(np.uint32)
    return slots, n[slots]


def apply_patch(
    table: ArrayLike, slots: ArrayLike, values: ArrayLike
) -> NDArray[np.uint32]:
    """A copy of ``table`` with ``table[slots] = values``; the input is not modified.

    Refuses what a data plane should refuse (a slot out of range, a slot twice,
    lengths that differ), so that the controller's model of a ring cannot
    silently diverge from the data plane's through a malformed patch.
    """
    t = _as_ring("table", table).copy()
    s = np.asarray(slots)
    v = _as_ring("values", values)
    if s.ndim != 1 or s.shape != v.shape:
        raise ValueError("slots and values must be one-dimensional and of equal length")
    if s.size:
        if s.dtype.kind not in "iu":
            raise TypeError("slots must be integers")
        if s.min() < 0 or s.max() >= t.size:
            raise ValueError(f"slot out of range 0..{t.size - 1}")
        if np.unique(s).size != s.size:
            raise ValueError("a slot appears twice in the patch")
        t[s.astype(np.int64)] = v
    return t
