"""Bucket edges: the DP is exact, never worse than quantile/equal-tokens, fast, cached; inputs checked."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import Budget, LengthsError, bucket_edges, expected_padded_slots, plan
from strategies._kernels import dp_bucket_edges
from strategies.edges import _cached_edges, explicit_edges, length_histogram


def brute_force_min_slots(values: np.ndarray, counts: np.ndarray, num_buckets: int) -> int:
    """Textbook O(K * V^2) DP over the histogram, written independently as the oracle."""
    num_values = len(values)
    buckets = min(num_buckets, num_values)
    prefix = np.concatenate([[0], np.cumsum(counts)])
    infinity = float("inf")
    best = [[infinity] * (num_values + 1) for _ in range(buckets + 1)]
    best[0][0] = 0
    for k in range(1, buckets + 1):
        for j in range(1, num_values + 1):
            for i in range(j):
                if best[k - 1][i] < infinity:
                    cost = best[k - 1][i] + int(values[j - 1]) * int(prefix[j] - prefix[i])
                    best[k][j] = min(best[k][j], cost)
    return int(best[buckets][num_values])


lengths_lists = st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=120)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_lists, num_buckets=st.integers(min_value=1, max_value=9))
def test_dp_is_exact_and_never_worse_than_quantile_or_equal_tokens(lengths, num_buckets):
    lengths = np.asarray(lengths)
    dp = bucket_edges(lengths, num_buckets, "dp")
    values, counts = length_histogram(lengths)
    assert expected_padded_slots(lengths, dp) == brute_force_min_slots(values, counts, num_buckets)
    for other in ("quantile", "equal_tokens"):
        edges = bucket_edges(lengths, num_buckets, other)
        assert edges.size <= num_buckets
        assert expected_padded_slots(lengths, dp) <= expected_padded_slots(lengths, edges)
    assert dp.size == min(num_buckets, values.size)
    assert np.all(np.diff(dp) > 0) and dp[-1] == lengths.max()
    assert np.isin(dp, values).all()


def test_kernel_reports_its_optimal_cost():
    values = np.array([10, 20, 30, 100], dtype=np.int64)
    counts = np.array([5, 5, 5, 1], dtype=np.int64)
    positions, cost = dp_bucket_edges(values, counts, 2)
    # best split: {10, 20, 30} padded to 30 (15 * 30) + {100} = 550
    assert values[positions].tolist() == [30, 100] and cost == 550


def test_enough_buckets_means_no_padding():
    lengths = np.array([5, 5, 9, 12, 12, 12, 40])
    edges = bucket_edges(lengths, 10, "dp")
    assert edges.tolist() == [5, 9, 12, 40]
    assert expected_padded_slots(lengths, edges) == lengths.sum()


def test_quantile_edges_hold_equal_counts_and_equal_tokens_equal_totals():
    lengths = np.random.default_rng(0).permutation(np.arange(1, 1001))
    quantile = bucket_edges(lengths, 4, "quantile")
    assert quantile.tolist() == [250, 500, 750, 1000]
    tokens = bucket_edges(lengths, 4, "equal_tokens")
    buckets = np.searchsorted(tokens, lengths, side="left")
    totals = np.bincount(buckets, weights=lengths)
    np.testing.assert_allclose(totals, lengths.sum() / 4, rtol=0.01)


def test_dp_beats_quantile_in_real_padding_on_a_chat_profile():
    rng = np.random.default_rng(1)
    lengths = np.clip(np.round(rng.lognormal(np.log(600), 1.0, 100_000)), 16, 8192).astype(np.int64)
    for num_buckets in (8, 16):
        efficiency = {}
        for method in ("dp", "quantile"):
            p = plan(lengths, Budget(16384), "bucketed", num_buckets=num_buckets, edges=method, seed=2)
            efficiency[method] = p.micro_batch_tokens().sum() / p.micro_batch_slots().sum()
        assert efficiency["dp"] > efficiency["quantile"] + 0.02, (num_buckets, efficiency)


def test_dp_is_fast_for_8192_lengths_and_64_buckets():
    rng = np.random.default_rng(2)
    values = np.arange(1, 8193, dtype=np.int64)
    counts = rng.integers(1, 500, values.size).astype(np.int64)
    dp_bucket_edges(values[:8], counts[:8], 2)  # load the compiled kernel
    start = time.perf_counter()
    positions, _ = dp_bucket_edges(values, counts, 64)
    elapsed = time.perf_counter() - start
    assert positions.size == 64 and positions[-1] == values.size - 1
    assert elapsed < 1.0  # measured ~0.02 s; an O(K*V^2) loop would take minutes


def test_edges_are_cached_per_histogram():
    lengths = np.random.default_rng(3).integers(1, 3000, 50_000)
    first = bucket_edges(lengths, 12, "dp")
    hits = _cached_edges.cache_info().hits
    second = bucket_edges(np.random.default_rng(4).permutation(lengths), 12, "dp")  # same histogram
    assert _cached_edges.cache_info().hits == hits + 1
    np.testing.assert_array_equal(first, second)


def test_edge_inputs_are_checked():
    with pytest.raises(ValueError, match=r"num_buckets=0 must be >= 1"):
        bucket_edges([1, 2, 3], 0)
    with pytest.raises(ValueError, match=r"edges method 'geometric' is unknown"):
        bucket_edges([1, 2, 3], 2, "geometric")
    with pytest.raises(LengthsError, match=r"lengths\[1\] = 900 exceeds Budget.max_tokens=512"):
        bucket_edges([10, 900], 2, "dp", budget=Budget(512))
    with pytest.raises(LengthsError, match=r"lengths\[0\] = 0 is not positive"):
        bucket_edges([0, 5], 2)
    with pytest.raises(ValueError, match=r"edges\[0\] = -4 must be a positive integer"):
        explicit_edges([-4, 10], longest=20)
    with pytest.raises(ValueError, match=r"edges is an empty list"):
        explicit_edges([], longest=20)
    with pytest.raises(ValueError, match=r"edges\[1\] = 'x' must be a positive integer"):
        explicit_edges([4, "x"], longest=20)
    assert explicit_edges([4, 10], longest=20).tolist() == [4, 10, 20]
    assert explicit_edges([4, 32], longest=20).tolist() == [4, 32]
