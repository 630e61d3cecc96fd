"""Weighted Maglev tables: shares, determinism, disruption, diffs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpclb.maglev import NO_BACKEND, apply_patch, build_table, diff_tables, is_prime, quotas

SMALL_PRIMES = [251, 1009, 4099]

weights_st = st.lists(
    st.one_of(st.just(0.0), st.floats(min_value=0.01, max_value=100.0)), min_size=1, max_size=12
)


def members(weights: list[float]) -> list[tuple[int, str, float]]:
    return [(i, f"node-{i}", w) for i, w in enumerate(weights)]


def shares_ok(table: np.ndarray, weights: list[float]) -> None:
    size = len(table)
    total = sum(weights)
    counts = np.bincount(table[table != NO_BACKEND], minlength=len(weights))
    for i, w in enumerate(weights):
        ideal = w / total * size
        assert abs(counts[i] - ideal) <= max(0.01 * ideal, 2), (i, counts[i], ideal)


@settings(max_examples=40, deadline=None)
@given(weights=weights_st, size=st.sampled_from(SMALL_PRIMES))
def test_shares_are_proportional_and_weight_zero_gets_nothing(weights: list[float],
                                                              size: int) -> None:
    table = build_table(members(weights), size)
    if sum(weights) == 0:
        assert (table == NO_BACKEND).all()
        return
    assert (table != NO_BACKEND).all(), "every slot has an owner"
    shares_ok(table, weights)
    for i, w in enumerate(weights):
        if w == 0:
            assert i not in table


@settings(max_examples=30, deadline=None)
@given(weights=weights_st, size=st.sampled_from(SMALL_PRIMES), seed=st.integers(0, 2**32 - 1))
def test_deterministic_and_independent_of_order(weights: list[float], size: int,
                                                 seed: int) -> None:
    m = members(weights)
    shuffled = [m[i] for i in np.random.default_rng(seed).permutation(len(m))]
    assert np.array_equal(build_table(m, size), build_table(shuffled, size))


@settings(max_examples=30, deadline=None)
@given(a=weights_st, b=weights_st, size=st.sampled_from(SMALL_PRIMES))
def test_diff_then_patch_gives_the_new_table(a: list[float], b: list[float], size: int) -> None:
    n = min(len(a), len(b))
    old, new = build_table(members(a[:n]), size), build_table(members(b[:n]), size)
    slots, values = diff_tables(old, new)
    assert np.array_equal(apply_patch(old, slots, values), new)
    assert len(slots) == np.count_nonzero(old != new)


def test_default_size_shares_with_skewed_weights() -> None:
    weights = [1.0, 2.0, 3.0, 0.5, 10.0]
    shares_ok(build_table(members(weights)), weights)


@pytest.mark.parametrize("n", [3, 5, 10, 50, 100])
def test_removing_one_backend_moves_fewer_than_2_over_n(n: int) -> None:
    size = 65537
    full = build_table(members([1.0] * n), size)
    for gone in (0, n // 2, n - 1):
        rest = [m for m in members([1.0] * n) if m[0] != gone]
        changed = np.count_nonzero(full != build_table(rest, size))
        assert changed / size < 2 / n, (gone, changed)
        # and at least the departed backend's own slots moved
        assert changed >= np.count_nonzero(full == gone)


@pytest.mark.parametrize("n,bound", [(300, 4.0), (1000, 7.5)])
def test_disruption_with_few_slots_per_backend(n: int, bound: float) -> None:
    """Maglev's disruption grows as slots per backend fall (65537/1000 = 65):
    measured 3.6/N at N=300 and 6.8/N at N=1000. This guards that figure; the
    2/N target needs >= ~650 slots per backend (see the issue note)."""
    size = 65537
    full = build_table(members([1.0] * n), size)
    rest = [m for m in members([1.0] * n) if m[0] != n // 2]
    changed = np.count_nonzero(full != build_table(rest, size))
    assert changed / size < bound / n


def test_one_weight_step_touches_few_slots() -> None:
    """Raising one of ten weights by 10%: the slots that must move are the
    quota changes; Maglev moves a small multiple of that."""
    size = 65537
    before = [1.0] * 10
    after = [1.1] + [1.0] * 9
    old, new = build_table(members(before), size), build_table(members(after), size)
    minimum = sum(abs(x - y) for x, y in zip(quotas(before, size), quotas(after, size),
                                                 strict=True)) // 2
    changed = np.count_nonzero(old != new)
    assert minimum <= changed < 4 * minimum


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="prime"):
        build_table(members([1.0]), 65536)
    with pytest.raises(ValueError, match="unique"):
        build_table([(0, "a", 1.0), (1, "a", 1.0)], 251)
    with pytest.raises(ValueError, match="finite"):
        build_table([(0, "a", float("nan"))], 251)
    assert is_prime(65537) and not is_prime(65535)
