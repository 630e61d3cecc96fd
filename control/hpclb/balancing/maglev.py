"""Weighted Maglev rings: pure functions from (backends, weights) to a table of backend ids.

Every VIP has a ring of ``size`` slots (a prime, 65537 by default); a new flow
lands on slot ``flow_hash % size`` and goes to the backend id stored there
(``flowhash.py``, ``lb_hash.h``). This module decides what is stored.

What the ring must give, and how this builder gives it:

* **The same ring everywhere.** Several appliances of a fleet (and a restarted
  controller) must build identical rings from the same configuration, with no
  shared history, so the builder is a pure function of the backend set:
  backends are ordered by a keyed hash of their *name* (never by input order,
  never by id), and every choice is derived from that hash. The caller's ids
  only label the result. ``tests/unit/test_maglev.py`` pins a golden ring, so
  an accidental change of algorithm (which would make two releases of a fleet
  disagree) fails a test.
* **Proportional shares.** Each backend with weight ``w`` gets a quota from a
  largest-remainder apportionment of ``size`` by weight, computed in exact
  rational arithmetic (no float rounding can move a slot between machines), and
  the fill below gives it exactly that many slots: less than one slot from its
  ideal share ``size * w / sum(w)``. Weight 0 gets no slot; when every weight
  is 0 the whole ring is ``NO_BACKEND`` (the data planes drop).
* **Little disruption.** Classic Maglev (Eisenbud et al., NSDI 2016): each
  backend walks its own permutation of the slots, ``(offset + j * skip) %
  size``, and claims the first free slot of its walk whenever it has a turn.
  The backends take turns in rounds, in name-hash order, and a backend stops
  at its quota; with equal weights this is Maglev's round robin, and with
  unequal weights the heavier backends' extra claims come last, after the
  others have stopped. So from *equal* weights a weight *increase* changes
  only the end of the fill: exactly the minimum number of slots, the quota
  change (one of 10 equal backends 1.0 -> 1.5: 2,808 slots, minimum 2,808;
  one of 100: 323 / 323). From unequal weights that no longer holds: the
  heavier backend's larger quota shrinks every other quota, so the others
  stop earlier, in the middle rounds, and the claims after them shift as a
  decrease's do; an increase then costs about as much as a decrease (below).
  Because a backend's preferences do not depend on who else is present,
  removing a backend mostly hands its own slots to others.

  Maglev is not minimal, though: a removal (or a weight decrease) shifts later
  claims, and those shifts cascade to the end of the fill; the more backends,
  the longer the cascades. Measured with equal weights, slots changed when one
  of N backends is removed, as a multiple of the minimum size/N: at size 65537,
  N = 3..10: 1.00-1.04x; N = 50: 1.25x; N = 100: 1.6x; N = 150: 2.0x;
  N = 200: 2.5x; N = 500: 5.7x; N = 1000: 6.8x. So "fewer than 2/N" holds up
  to about 140 backends. A larger ring helps less than the usual
  "size >= 100 * N" advice suggests: N = 1000 at size 650011 is still 4.4x.
  What sets the multiple is size / N**2, not N (perf/maglev_disruption.py,
  results/maglev_disruption.json): with exact quotas the departed backend's
  size/N slots can only go to the about size/N backends whose quota rises, so
  where size/N << N most of them first land on a full backend and push one of
  its slots on. At size = N**2: 2.7x (N = 100, 10007 slots; N = 316, 100003);
  N = 1000 at RING_SIZE_MAX (1048573, about N**2): 3.0x, built in 0.2-0.4 s;
  at 3 * N**2: 1.87x (N = 100), 1.97x (N = 316), 2.03x (N = 1000, 3000017
  slots, beyond what the data planes accept). Other pure constructions
  measured there do no better within the constraints: rendezvous (HRW) per
  slot moves exactly the minimum but its shares are binomial (40 slots, 62%,
  off the ideal at N = 1000); placing HRW's (or this builder's own walks')
  preferences greedily under the exact quotas (a stable matching) cuts the
  cascade only partly: 4.4-5.0x at N = 1000 on 65537 slots (3.3x when the
  rounding follows the placement). The closest, the walks' stable matching at
  RING_SIZE_MAX, moves 1.93-1.98x for equal weights but 2.4-2.9x for unequal
  ones and 4.7x for a 10% weight step (where this builder moves exactly the
  minimum for an increase from equal weights), and its Python prototype builds
  in seconds against this one's 0.2-0.4 s in C at that size. So this builder
  stays.
  A weight decrease by 10% moves 1.1x (N = 10) to 7x (N = 1000) the minimum.
  From unequal weights (the live policy's: weight 0.625 - 0.4 * cpu_load on the
  1/256 grid), single-backend steps of cpu_load >= 0.1, up or down, moved
  (``hpclb bench control``'s ``slots`` part, 50 steps per size, p50 of slots
  changed / minimum): 1.48x at N = 10, 2.13x at N = 100, 7.79x at N = 1000,
  12.33x at N = 10,000; increases alone 1.48x, 2.08x, 8.09x, 12.17x, decreases
  alone 1.48x, 2.18x, 7.66x, 12.75x. ``tests/unit/test_maglev.py`` pins the
  equal-weight numbers down (an increase from equal weights: exactly the
  minimum).

How a ring travels to the data plane once built (only the slots whose owner
changed) is the contract's business: :mod:`hpclb.contract.ringdiff`.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

from hpclb.contract.tables import NO_BACKEND, RING_SIZE_DEFAULT, RING_SIZE_MAX, is_prime
from hpclb.host import install

# The fill in C (dataplane/common/maglev_fill.c, built by make -C dataplane
# into libhpclb_maglev.so, found through install.py; HPCLB_MAGLEV_LIB
# overrides): the same table as the Python loop below, 20 to 50 times faster
# (the whole ring build, hashing included, 4 to 30 times: see
# python_fill_estimate_s). Without it every ring is filled in Python; the
# controller warns of that at start, or refuses to start
# (controller.check_maglev_fill).


def _load_fill() -> tuple[Callable[..., int] | None, str | None]:
    """The C fill, or None and why it is missing."""
    try:
        lib = ctypes.CDLL(str(install.find("libhpclb_maglev.so")))
        fn = lib.hpclb_maglev_fill
    except (OSError, AttributeError) as err:  # missing, unloadable, not our library
        return None, str(err)
    i64p = ctypes.POINTER(ctypes.c_int64)
    fn.argtypes = [ctypes.c_uint32, ctypes.c_uint32, i64p, i64p, i64p, ctypes.c_uint64,
                   i64p, i64p]
    fn.restype = ctypes.c_int
    return fn, None


_c_fill, _c_fill_missing = _load_fill()


def c_fill_missing() -> str | None:
    """Why rings are filled in Python (the C fill did not load), or None."""
    return _c_fill_missing


def python_fill_estimate_s(backends: int, size: int) -> float:
    """Roughly how long :func:`build_table` takes for ``backends`` members on
    ``size`` slots when the fill runs in Python (the C fill: 4 to 30 times less).

    A fit of measurements on the 2-core lab host, within a factor of 2 from 3
    to 4,096 backends and 65,537 to 1,048,573 slots: 0.2 us per slot, times
    the 4th root of the backend count (longer probe walks), times
    (size / 65537) ** 0.4 (a larger table leaves the caches). Measured there: 3
    backends on 65,537 slots, 18 ms (C: 2.5 ms); 1,000 on 65,537, 80 ms (C:
    15 ms); 1,000 on 1,048,573, 4.8 s (C: 0.15 s).
    """
    if backends < 2:  # no fill at all
        return 0.0
    us_per_slot = 0.2 * backends ** 0.25 * (size / RING_SIZE_DEFAULT) ** 0.4
    return us_per_slot * size / 1e6

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, NDArray

__all__ = [
    "LB_NO_BACKEND",
    "NO_BACKEND",
    "RING_SIZE_DEFAULT",
    "RING_SIZE_MAX",
    "RingMember",
    "RingMemberSpec",
    "RingMemberTuple",
    "build_table",
    "check_ring_size",
    "quotas",
    "slot_counts",
]

#: The value of a slot that belongs to nobody (lb_tables.h's LB_NO_BACKEND).
LB_NO_BACKEND = NO_BACKEND

# blake2b personalisation of the name hash. Versioned: a deliberate change of the
# algorithm changes it (and the golden ring in the tests), never by accident.
_PERSON = b"hpclb-maglev-v1"


@dataclass(frozen=True)
class RingMember:
    """One ring member.

    ``id`` is what the ring stores (the data plane's backend table index);
    ``name`` is the stable identity the slot preferences are derived from (a
    node name, not an index that may be reused), so that a backend keeps its
    slots when ids are renumbered and two backends never swap places because
    their ids did.
    """

    id: int
    name: str
    weight: float


#: ``(id, name, weight)``, the form the controller passes.
RingMemberTuple = tuple[int, str, float]

#: What :func:`build_table` accepts for a member: a :class:`RingMember`,
#: ``(id, name, weight)``, or ``(id, weight)`` (the name is then ``str(id)``).
RingMemberSpec = Union[RingMember, RingMemberTuple, tuple[int, float]]  # noqa: UP007


def check_ring_size(size: int) -> int:
    """Validate a ring size: a prime in 2..RING_SIZE_MAX, as the data planes accept.

    Prime, because a backend's walk ``offset + j * skip`` must visit every slot
    for any ``skip`` in 1..size-1 (and the data planes' probe sequence relies on
    the same property).
    """
    if isinstance(size, bool) or not isinstance(size, int | np.integer):
        raise TypeError(f"ring size must be an int, not {type(size).__name__}")
    size = int(size)
    if not 2 <= size <= RING_SIZE_MAX:
        raise ValueError(f"ring size must be in 2..{RING_SIZE_MAX}, got {size}")
    if not is_prime(size):
        raise ValueError(f"ring size must be prime, got {size}")
    return size


def _normalise(members: Iterable[RingMemberSpec]) -> list[RingMember]:
    out: list[RingMember] = []
    for m in members:
        if isinstance(m, RingMember):
            b = m
        elif isinstance(m, tuple) and len(m) == 3:
            b = RingMember(m[0], m[1], m[2])
        elif isinstance(m, tuple) and len(m) == 2:
            b = RingMember(m[0], str(m[0]), m[1])
        else:
            raise TypeError(f"a member is RingMember, (id, name, weight) or (id, weight): {m!r}")
        if isinstance(b.id, bool) or not isinstance(b.id, int | np.integer):
            raise TypeError(f"backend id must be an int: {b.id!r}")
        if not 0 <= int(b.id) < NO_BACKEND:
            raise ValueError(f"backend id must be in 0..{NO_BACKEND - 1}: {b.id!r}")
        if not isinstance(b.name, str) or not b.name:
            raise TypeError(f"backend name must be a non-empty str: {b.name!r}")
        if isinstance(b.weight, bool) or not isinstance(b.weight, int | float | np.number):
            raise TypeError(f"backend weight must be a number: {b.weight!r}")
        try:
            weight = float(b.weight)
        except OverflowError:
            weight = math.inf
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"backend weight must be finite and >= 0: {b.name}={b.weight!r}")
        # One float per weight from here on: quotas and turn times use the same value.
        out.append(RingMember(int(b.id), b.name, weight))
    ids = [b.id for b in out]
    names = [b.name for b in out]
    if len(set(ids)) != len(ids):
        raise ValueError("backend ids must be unique")
    if len(set(names)) != len(names):
        raise ValueError("backend names must be unique")
    return out


@dataclass(frozen=True)
class _Prepared:
    """Members of positive weight in canonical (name-hash) order, with their walks."""

    members: list[RingMember]
    quota: list[int]
    offset: list[int]
    skip: list[int]


def _digest(name: str, seed: bytes) -> bytes:
    return hashlib.blake2b(
        name.encode("utf-8"), digest_size=24, key=seed, person=_PERSON
    ).digest()


def _prepare(members: Iterable[RingMemberSpec], size: int, seed: bytes) -> _Prepared:
    size = check_ring_size(size)
    if not isinstance(seed, bytes) or len(seed) > 64:
        raise ValueError("seed must be bytes of at most 64 bytes (a blake2b key)")
    live = [b for b in _normalise(members) if b.weight > 0]
    digests = {b.name: _digest(b.name, seed) for b in live}
    # Canonical order: by a keyed hash of the name (then the name, for the
    # astronomically unlikely tie). Input order and ids never matter.
    live.sort(key=lambda b: (digests[b.name][16:], b.name))
    if not live:
        return _Prepared([], [], [], [])
    # Exact largest-remainder apportionment (Hamilton): each float weight is
    # an exact dyadic fraction p/2^k, so scaled to one power-of-two
    # denominator the weights are integers, and so are the quotas and the
    # remainders (over the common denominator `total`): every machine
    # computes the same quotas, in integer arithmetic.
    ratios = [float(b.weight).as_integer_ratio() for b in live]
    denominator = max(q for _, q in ratios)
    w = [p * (denominator // q) for p, q in ratios]
    total = sum(w)
    quota = [size * x // total for x in w]
    remainder = [size * x % total for x in w]
    left = size - sum(quota)
    # Largest remainder first; ties by canonical position (already hash-ordered).
    by_remainder = sorted(range(len(live)), key=lambda i: (-remainder[i], i))
    for i in by_remainder[:left]:
        quota[i] += 1
    offset = [int.from_bytes(digests[b.name][:8], "little") % size for b in live]
    skip = [int.from_bytes(digests[b.name][8:16], "little") % (size - 1) + 1 for b in live]
    return _Prepared(live, quota, offset, skip)


def quotas(
    members: Iterable[RingMemberSpec], size: int = RING_SIZE_DEFAULT, *, seed: bytes = b""
) -> dict[int, int]:
    """Slots each backend id gets in :func:`build_table` (0 for weight 0).

    Exposed so that callers (metrics, a weight planner, tests) can know a
    ring's shares, and the minimum a change must move, without building it.
    ``seed`` matters only for ties between equal remainders, which the name
    hash breaks.
    """
    members = list(members)
    prepared = _prepare(members, size, seed)
    out = {b.id: 0 for b in _normalise(members)}
    for b, q in zip(prepared.members, prepared.quota, strict=True):
        out[b.id] = q
    return out


def _turn_order(prepared: _Prepared) -> NDArray[np.int64]:
    """Indices of the members in the order of their claims.

    Rounds: in round k every member whose quota exceeds k claims once, in
    canonical (name-hash) order. With unequal weights the heavier members'
    extra claims come last, when the others have stopped; so a weight change,
    which only moves the last claims of the members whose quota changed, leaves
    every earlier round, and hence most of the ring, as it was.
    """
    q = np.asarray(prepared.quota, dtype=np.int64)
    who = np.repeat(np.arange(len(q), dtype=np.int64), q)
    first = np.cumsum(q) - q  # index of each member's first claim in `who`
    k = np.arange(who.size, dtype=np.int64) - np.repeat(first, q)
    order = np.lexsort((who, k))
    result: NDArray[np.int64] = who[order]
    return result


def build_table(
    members: Sequence[RingMemberSpec],
    size: int = RING_SIZE_DEFAULT,
    *,
    seed: bytes = b"",
    use_c: bool = True,
) -> NDArray[np.uint32]:
    """The weighted Maglev ring of ``members``: ``size`` backend ids (uint32).

    ``members`` are :class:`RingMember` values or ``(id, name, weight)`` /
    ``(id, weight)`` tuples, in any order. ``seed`` (optional, up to 64 bytes)
    keys the name hash: rings with different seeds are shuffled independently.
    Deterministic: the same members and weights give the same ring on every
    machine, whatever their order. Every weight 0 (or no member): all slots are
    ``NO_BACKEND``. The fill runs in C when ``libhpclb_maglev.so`` is built
    (``use_c=False`` forces the Python loop, which gives the same table): 1,000
    backends on 65537 slots take about 15 ms, against 80 ms in Python.
    """
    prepared = _prepare(members, size, seed)
    size = int(size)
    if not prepared.members:
        return np.full(size, NO_BACKEND, dtype=np.uint32)
    ids = np.asarray([b.id for b in prepared.members], dtype=np.uint32)
    if len(prepared.members) == 1:
        return np.full(size, ids[0], dtype=np.uint32)
    turns = _turn_order(prepared)
    fill = _fill_c if _c_fill is not None and use_c else _fill_python
    out: NDArray[np.uint32] = ids[fill(size, prepared, turns)]
    return out


def _fill_python(size: int, prepared: _Prepared, turns: NDArray[np.int64]) -> NDArray[np.int64]:
    # The fill is inherently sequential (each claim depends on every earlier
    # one); plain lists keep the inner loop at a few dozen nanoseconds a probe.
    table = [-1] * size
    cursor = list(prepared.offset)  # the next slot each member will look at
    skip = prepared.skip
    for i in turns.tolist():
        c = cursor[i]
        s = skip[i]
        while table[c] >= 0:  # ends: size is prime, so the walk visits every slot
            c += s
            if c >= size:
                c -= size
        table[c] = i
        c += s
        if c >= size:
            c -= size
        cursor[i] = c
    return np.asarray(table, dtype=np.int64)


def _fill_c(size: int, prepared: _Prepared, turns: NDArray[np.int64]) -> NDArray[np.int64]:
    assert _c_fill is not None
    n = len(prepared.members)
    offset = np.ascontiguousarray(prepared.offset, dtype=np.int64)
    skip = np.ascontiguousarray(prepared.skip, dtype=np.int64)
    turns = np.ascontiguousarray(turns, dtype=np.int64)
    cursor = np.empty(n, dtype=np.int64)
    table = np.empty(size, dtype=np.int64)

    def ptr(a: NDArray[np.int64]) -> object:
        return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))

    rc = _c_fill(size, n, ptr(offset), ptr(skip), ptr(turns), turns.size, ptr(cursor),
                 ptr(table))
    if rc != 0:
        raise ValueError("maglev fill refused its input")  # a bug in _prepare, not user input
    return table


def slot_counts(table: ArrayLike) -> dict[int, int]:
    """Slots per backend id in a ring (``NO_BACKEND`` slots are not counted)."""
    t = np.asarray(table)
    values, counts = np.unique(t[t != NO_BACKEND], return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts, strict=True)}
