"""Weighted Maglev rings: shares, determinism, disruption, patches.

Property tests (hypothesis) on small prime rings check what must hold for every
input: exact shares, weight 0, order and id independence, patch round trips.
Fixed-input tests at the default size 65537 pin down the disruption numbers
that the module docstring of hpclb.balancing.maglev quotes, and one golden ring pins the
algorithm itself (appliances of one fleet running different releases must
build the same ring).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpclb.balancing import maglev
from hpclb.balancing.maglev import (
    NO_BACKEND,
    RingMember,
    build_table,
    check_ring_size,
    quotas,
    slot_counts,
)
from hpclb.contract.ringdiff import apply_patch, diff_tables
from hpclb.contract.tables import RING_SIZE_DEFAULT, RING_SIZE_MAX, is_prime

SMALL_PRIMES = (2, 3, 251, 1009, 4099)
SIZE = RING_SIZE_DEFAULT

weight_st = st.one_of(
    st.just(0.0),
    st.integers(1, 10).map(float),
    st.floats(min_value=0.001, max_value=1000.0, allow_nan=False, allow_infinity=False),
)


@st.composite
def members_st(draw: st.DrawFn, max_size: int = 12) -> list[tuple[int, str, float]]:
    """Unique ids (any u32 a data plane could use) and unique names, random weights."""
    n = draw(st.integers(0, max_size))
    ids = draw(st.lists(st.integers(0, 4095), min_size=n, max_size=n, unique=True))
    names = draw(
        st.lists(st.text("abcdefgh-0123456789", min_size=1, max_size=6),
                 min_size=n, max_size=n, unique=True)
    )
    weights = draw(st.lists(weight_st, min_size=n, max_size=n))
    return list(zip(ids, names, weights, strict=True))


def equal(n: int) -> list[tuple[int, str, float]]:
    return [(i, f"node-{i}", 1.0) for i in range(n)]


def ideal_shares(members: list[tuple[int, str, float]], size: int) -> dict[int, Fraction]:
    total = sum(Fraction(w) for _, _, w in members)
    return {i: size * Fraction(w) / total for i, _, w in members}


# ---- properties ---------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(members=members_st(), size=st.sampled_from(SMALL_PRIMES))
def test_shares_are_the_quotas_within_one_slot(
    members: list[tuple[int, str, float]], size: int
) -> None:
    table = build_table(members, size)
    assert table.dtype == np.uint32 and table.shape == (size,)
    live = [m for m in members if m[2] > 0]
    if not live:
        assert (table == NO_BACKEND).all()
        return
    assert (table != NO_BACKEND).all(), "every slot has an owner"
    counts = slot_counts(table)
    assert set(counts) <= {i for i, _, _ in live}, "only positive weights own slots"
    assert {i: counts.get(i, 0) for i, _, _ in members} == quotas(members, size)
    for i, ideal in ideal_shares(members, size).items():
        got = counts.get(i, 0)
        assert abs(got - ideal) < 1, (i, got, float(ideal))
        assert abs(got - ideal) <= max(ideal / 100, Fraction(2))  # the stated requirement


@settings(max_examples=60, deadline=None)
@given(data=st.data(), size=st.sampled_from(SMALL_PRIMES))
def test_deterministic_and_independent_of_input_order(data: st.DataObject, size: int) -> None:
    members = data.draw(members_st())
    shuffled = data.draw(st.permutations(members))
    first = build_table(members, size)
    np.testing.assert_array_equal(first, build_table(members, size))
    np.testing.assert_array_equal(first, build_table(shuffled, size))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), size=st.sampled_from(SMALL_PRIMES))
def test_ids_only_label_the_ring(data: st.DataObject, size: int) -> None:
    """Renumbering ids relabels the ring and moves nothing: preferences come from names."""
    members = data.draw(members_st())
    new_ids = data.draw(
        st.lists(st.integers(0, 2**32 - 2), min_size=len(members), max_size=len(members),
                 unique=True)
    )
    relabel = {old: new for (old, _, _), new in zip(members, new_ids, strict=True)}
    relabel[NO_BACKEND] = NO_BACKEND
    renumbered = [(relabel[i], name, w) for i, name, w in members]
    before = build_table(members, size)
    expected = np.array([relabel[int(x)] for x in before], dtype=np.uint32)
    np.testing.assert_array_equal(build_table(renumbered, size), expected)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), size=st.sampled_from(SMALL_PRIMES))
def test_diff_then_patch_gives_the_new_ring(data: st.DataObject, size: int) -> None:
    old_members = data.draw(members_st())
    # The new ring: some members' weights changed, some removed, some added.
    kept = [m for m in old_members if data.draw(st.booleans())]
    changed = [(i, n, data.draw(weight_st)) if data.draw(st.booleans()) else (i, n, w)
               for i, n, w in kept]
    added = [m for m in data.draw(members_st(max_size=4))
             if m[0] not in {i for i, _, _ in changed} and m[1] not in {n for _, n, _ in changed}]
    old, new = build_table(old_members, size), build_table(changed + added, size)
    old_copy = old.copy()
    slots, values = diff_tables(old, new)
    assert slots.dtype == np.uint32 and values.dtype == np.uint32
    assert (np.diff(slots.astype(np.int64)) > 0).all(), "ascending, each slot once"
    assert (old[slots] != new[slots]).all(), "only changed slots"
    assert len(slots) == np.count_nonzero(old != new)
    np.testing.assert_array_equal(apply_patch(old, slots, values), new)
    np.testing.assert_array_equal(old, old_copy)  # pure: the input is not modified


@settings(max_examples=30, deadline=None)
@given(members=members_st(), seed=st.binary(min_size=1, max_size=64))
def test_seed_shuffles_but_keeps_shares(members: list[tuple[int, str, float]],
                                        seed: bytes) -> None:
    plain, seeded = build_table(members, 1009), build_table(members, 1009, seed=seed)
    assert slot_counts(seeded) == {k: v for k, v in quotas(members, 1009, seed=seed).items() if v}
    assert sorted(slot_counts(plain).values()) == sorted(slot_counts(seeded).values())


# ---- fixed cases ----------------------------------------------------------------


def test_golden_ring() -> None:
    """The algorithm is part of the fleet contract: two releases must agree.

    A deliberate change of algorithm bumps the hash personalisation in
    hpclb.balancing.maglev and this digest together, and is announced as a fleet-wide
    change (every ring moves).
    """
    members = [(i, f"node-{i}", w) for i, w in enumerate([1.0, 2.0, 0.5, 3.0, 0.0, 1.0])]
    table = build_table(members)
    assert slot_counts(table) == {0: 8738, 1: 17477, 2: 4369, 3: 26215, 5: 8738}
    assert hashlib.sha256(table.tobytes()).hexdigest() == (
        "65f9068598f0cfa5905e4e14e0d7600ee6ccc9e8c71107d4f0f85221ba11c735"
    )
    seeded = build_table(members, 251, seed=b"vip-7")
    assert seeded[:12].tolist() == [1, 1, 3, 3, 0, 3, 2, 1, 1, 3, 5, 0]


def test_member_forms_agree() -> None:
    triples = [(7, "7", 1.0), (3, "3", 2.5), (9, "9", 0.0)]
    expected = build_table(triples, 1009)
    np.testing.assert_array_equal(build_table([(i, w) for i, _, w in triples], 1009), expected)
    np.testing.assert_array_equal(build_table([RingMember(*m) for m in triples], 1009), expected)
    ints = build_table([(7, "7", 1), (3, "3", np.float32(2.5)), (9, "9", 0)], 1009)  # type: ignore[list-item]
    np.testing.assert_array_equal(ints, expected)


def test_all_zero_and_empty() -> None:
    assert (build_table([], 251) == NO_BACKEND).all()
    assert (build_table([(1, "a", 0.0), (2, "b", 0)], 251) == NO_BACKEND).all()
    assert quotas([(1, "a", 0.0)], 251) == {1: 0}
    assert (build_table([(5, "a", 0.0), (6, "b", 3.0)], 251) == 6).all()


def test_default_size_skewed_weights() -> None:
    members = [(i, f"node-{i}", w) for i, w in enumerate([1.0, 2.0, 3.0, 0.5, 10.0, 1e-6])]
    table = build_table(members)
    assert table.shape == (SIZE,)
    counts = slot_counts(table)
    for i, ideal in ideal_shares(members, SIZE).items():
        assert abs(counts.get(i, 0) - ideal) < 1


@pytest.mark.parametrize("n", [3, 5, 10, 50, 100])
def test_removing_one_of_n_moves_fewer_than_2_over_n(n: int) -> None:
    full = build_table(equal(n))
    for gone in sorted({0, n // 4, n // 2, 3 * n // 4, n - 1}):
        after = build_table([m for m in equal(n) if m[0] != gone])
        changed = np.count_nonzero(full != after)
        own = np.count_nonzero(full == gone)
        assert changed >= own, "the departed backend's slots all moved"
        assert changed < 2 * SIZE / n, (gone, changed, changed / (SIZE / n))


@pytest.mark.xfail(
    strict=True,
    reason="Maglev: removing one of 1000 backends moves 6.5-7.0x the minimum at 65537 "
    "slots (about 440 slots, limit 131) and still 3.0x at RING_SIZE_MAX; even 3 * N**2 "
    "slots give 2.03x (3,000,017, beyond what the data planes accept). No "
    "alternative construction measured meets 2x with exact shares and a fast build "
    "(perf/maglev_disruption.py); see hpclb.balancing.maglev's docstring",
)
@pytest.mark.parametrize("size", [SIZE, RING_SIZE_MAX])
def test_removing_one_of_1000_moves_fewer_than_2_over_n(size: int) -> None:
    n = 1000
    full = build_table(equal(n), size)
    for gone in (0, n // 2, n - 1):
        after = build_table([m for m in equal(n) if m[0] != gone], size)
        changed = np.count_nonzero(full != after)
        assert changed < 2 * size / n


@pytest.mark.parametrize(
    ("n", "size", "low", "high"),
    [(100, 10007, 2.0, 3.0), (100, 30011, 1.0, 2.0), (1000, RING_SIZE_MAX, 2.0, 3.5)],
)
def test_disruption_follows_size_over_n_squared(n: int, size: int, low: float,
                                                high: float) -> None:
    """With exact shares the departed backend's size/N slots can only go to the about
    size/N backends whose quota rises; where size/N << N most first land on a full
    backend and push another slot on. So the multiple of the minimum is set by
    size / N**2, not by N alone (measured, perf/maglev_disruption.py: 2.7x at N**2
    slots for N = 100 and 316, and 3.0x for N = 1000 at RING_SIZE_MAX, about N**2;
    1.87x, 1.97x and 2.03x at 3 * N**2 for N = 100, 316 and 1000)."""
    full = build_table(equal(n), size)
    for gone in (0, n // 2):
        after = build_table([m for m in equal(n) if m[0] != gone], size)
        own = np.count_nonzero(full == gone)
        ratio = np.count_nonzero(full != after) / own
        assert low <= ratio < high, (gone, ratio)


@pytest.mark.parametrize(("n", "bound"), [(200, 3.0), (1000, 7.5)])
def test_disruption_with_many_backends_stays_where_measured(n: int, bound: float) -> None:
    """Guards the measured cascade (N=200: 2.5x the minimum, N=1000: 6.8x)."""
    full = build_table(equal(n))
    for gone in (0, n // 2, n - 1):
        changed = np.count_nonzero(full != build_table([m for m in equal(n) if m[0] != gone]))
        assert changed < bound * SIZE / n, (gone, changed / (SIZE / n))


def test_removing_a_weighted_backend() -> None:
    rng = np.random.default_rng(7)
    members = [(i, f"node-{i}", float(w)) for i, w in enumerate(rng.choice([1, 2, 4], 100))]
    full = build_table(members)
    for gone in (0, 50, 99):
        changed = np.count_nonzero(full != build_table([m for m in members if m[0] != gone]))
        assert changed < 2 * np.count_nonzero(full == gone)


def minimum_moves(before: list[tuple[int, str, float]],
                  after: list[tuple[int, str, float]]) -> int:
    """Fewest slots any ring with these quotas could change: the quota increases."""
    qa, qb = quotas(before), quotas(after)
    return sum(max(0, qb.get(i, 0) - qa.get(i, 0)) for i in qa.keys() | qb.keys())


# Measured multiples of the minimum for a weight decrease (0.9x, 0.5x, and 0 =
# removal): N=10: 1.02-1.08; N=100: 1.6-3.5; N=1000: 6.4-6.9.
DECREASE_BOUND = {10: 1.2, 100: 4.0, 1000: 7.5}


@pytest.mark.parametrize("n", [10, 100, 1000])
@pytest.mark.parametrize("factor", [1.1, 2.0, 0.9, 0.5])
def test_one_weight_step_moves_few_slots(
    n: int, factor: float, record_property: Callable[[str, object], None]
) -> None:
    """A weight increase moves exactly the quota changes, the minimum (the
    heavier backend's extra claims come last in the fill, after everything
    that stays); a decrease cascades like a removal. Either way the patch is
    well under 1% of the ring."""
    before = equal(n)
    after = [(i, name, w * factor if i == n // 2 else w) for i, name, w in before]
    changed = np.count_nonzero(build_table(before) != build_table(after))
    minimum = minimum_moves(before, after)
    record_property("changed_vs_minimum", f"{changed}/{minimum}")
    bound = 1.0 if factor > 1 else DECREASE_BOUND[n]
    assert minimum <= changed <= bound * minimum
    assert changed < 0.01 * SIZE or minimum > 0.005 * SIZE


# ---- validation -----------------------------------------------------------------


def test_ring_sizes() -> None:
    assert is_prime(65537) and is_prime(2) and not is_prime(65535) and not is_prime(1)
    assert check_ring_size(RING_SIZE_MAX) == RING_SIZE_MAX
    for bad in (65536, 1, 0, -7, 1048583):  # 1048583 is prime but above RING_SIZE_MAX
        with pytest.raises(ValueError):
            check_ring_size(bad)
    with pytest.raises(TypeError):
        check_ring_size(True)
    with pytest.raises(ValueError, match="prime"):
        build_table(equal(3), 65536)


@pytest.mark.parametrize(
    ("members", "error"),
    [
        ([(0, "a", 1.0), (1, "a", 1.0)], ValueError),  # names must be unique
        ([(0, "a", 1.0), (0, "b", 1.0)], ValueError),  # ids must be unique
        ([(0, "a", float("nan"))], ValueError),
        ([(0, "a", float("inf"))], ValueError),
        ([(0, "a", -1.0)], ValueError),
        ([(0, "a", 10**400)], ValueError),
        ([(NO_BACKEND, "a", 1.0)], ValueError),  # the id that means "nobody"
        ([(-1, "a", 1.0)], ValueError),
        ([(0, "a", True)], TypeError),
        ([(0, "", 1.0)], TypeError),
        ([(0, "a", "1")], TypeError),
        ([(0,)], TypeError),
    ],
)
def test_bad_members_are_refused(members: list, error: type[Exception]) -> None:
    with pytest.raises(error):
        build_table(members, 251)


def test_bad_patches_are_refused() -> None:
    table = build_table(equal(3), 251)
    with pytest.raises(ValueError, match="range"):
        apply_patch(table, np.array([251]), np.array([1], dtype=np.uint32))
    with pytest.raises(ValueError, match="twice"):
        apply_patch(table, np.array([3, 3]), np.array([1, 2], dtype=np.uint32))
    with pytest.raises(ValueError, match="equal length"):
        apply_patch(table, np.array([3]), np.array([1, 2], dtype=np.uint32))
    with pytest.raises(ValueError, match="size"):
        diff_tables(table, build_table(equal(3), 1009))
    same = apply_patch(table, np.array([], dtype=np.uint32), np.array([], dtype=np.uint32))
    np.testing.assert_array_equal(same, table)


def test_the_c_fill_gives_the_python_fill_table() -> None:
    """libhpclb_maglev.so (maglev_fill.c) and the Python loop build the same
    rings, byte for byte, whatever the members, weights and ring size."""
    import os
    import random

    reason = maglev.c_fill_missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    rng = random.Random(11)
    for size in (7, 251, 65537):
        for n in (2, 3, 10, 97, 1000):
            if n > size:
                continue
            members = [(i, f"node{rng.randrange(10**9)}-{i}", rng.choice([0.0, 0.5, 1.0, 1.25, 3.0,
                                                                          rng.random()]))
                       for i in range(n)]
            c = maglev.build_table(members, size)
            py = maglev.build_table(members, size, use_c=False)
            assert c.dtype == py.dtype and (c == py).all(), (size, n)


def test_the_disruption_benchmark_measures_what_it_says() -> None:
    """perf/maglev_disruption.py (the issue-15 measurement): on a small ring every
    construction fills every slot with a live id; the exact ones keep every share within
    one slot of the ideal (and but for hrw-flex, which rounds as it places, the quotas);
    rendezvous and the circle move exactly the departed backend's slots; Maglev's row
    agrees with build_table."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "perf" / "maglev_disruption.py"
    spec = importlib.util.spec_from_file_location("maglev_disruption", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    members = [(i, f"node-{i}", w) for i, w in enumerate([1.0, 2.0, 0.5, 1.0, 3.0, 0.0, 1.5])]
    size = 1009
    for name, build in bench.BUILDERS.items():
        table = build(members, size)
        assert table.shape == (size,) and set(np.unique(table)) <= {0, 1, 2, 3, 4, 6}, name
        row = bench.case(name, size, members, removals=3, steps=1, repeats=1)
        exact = name not in ("hrw", "ring")
        assert row["shares"]["within_one_slot"] is exact, name
        if not exact:
            assert row["removal"]["ratio"]["max"] == 1.0, name
        elif name != "hrw-flex":  # hrw-flex rounds as it places: within one slot only
            assert slot_counts(table) == {i: q for i, q in quotas(members, size).items() if q}
        for sample in row["removal"]["samples"] + row["weight_step"]["samples"]:
            assert sample["changed"] >= sample["minimum"], (name, sample)
    np.testing.assert_array_equal(bench.BUILDERS["maglev"](members, size),
                                  build_table(members, size))
