"""Edge cases of the bucket-streak helpers: quantile_bins with fewer than two bins, step_buckets of an empty plan, longest_run with label 0 and leading -1 runs."""

from __future__ import annotations

import numpy as np

from strategies import Budget, Plan
from strategies.metrics import longest_bucket_streak, longest_run, quantile_bins, step_buckets


def test_quantile_bins_below_two_bins_puts_every_length_in_bin_0():
    lengths = np.array([7, 3, 5], dtype=np.int64)
    for bins in (1, 0, -1, -2, -5, 1.0):
        bucket, count = quantile_bins(lengths, bins)
        assert bucket.tolist() == [0, 0, 0] and bucket.dtype == np.intp
        assert count == 1
    bucket, count = quantile_bins(np.zeros(0, dtype=np.int64), 1)
    assert bucket.size == 0 and count == 1


def test_quantile_bins_two_bins_split_at_the_median():
    bucket, count = quantile_bins(np.array([7, 3, 5, 1], dtype=np.int64), 2)
    assert bucket.tolist() == [1, 0, 1, 0] and count == 2


def empty_plan(info=None) -> Plan:
    """Three steps of two ranks holding no sample (all three samples dropped)."""
    return Plan("shuffle", "padded", np.array([4, 6, 8], dtype=np.int64), np.zeros(0, dtype=np.int64),
                np.zeros(7, dtype=np.int64), Budget(100), 0, 0, 2, 1,
                dropped=np.array([0, 1, 2], dtype=np.int64), info=info or {})


def test_step_buckets_of_a_plan_without_samples():
    buckets, count = step_buckets(empty_plan())
    assert buckets.tolist() == [-1, -1, -1] and buckets.dtype == np.int64
    assert count == 0
    assert step_buckets(empty_plan(), streak_bins=3)[1] == 0
    assert longest_bucket_streak(empty_plan()) == (0, -1)
    # with bucket edges the count is the number of edges even without samples
    buckets, count = step_buckets(empty_plan({"edges": [5, 10]}))
    assert buckets.tolist() == [-1, -1, -1] and count == 2


def test_step_buckets_with_edges_puts_a_length_equal_to_an_edge_in_that_edges_bucket():
    plan = Plan("bucketed", "padded", np.array([4, 5, 6, 10], dtype=np.int64), np.arange(4, dtype=np.int64),
                np.arange(5, dtype=np.int64), Budget(100), 0, 0, 1, 1, info={"edges": [5, 10]})
    buckets, count = step_buckets(plan)
    assert buckets.tolist() == [0, 0, 1, 1] and count == 2


def test_longest_run_counts_label_0():
    assert longest_run(np.array([0, 0, -1])) == (2, 0)
    assert longest_run(np.array([-1, 0, -1])) == (1, 0)
    assert longest_run(np.array([0])) == (1, 0)


def test_longest_run_ignores_a_leading_run_of_minus_1():
    assert longest_run(np.array([-1, 0])) == (1, 0)
    assert longest_run(np.array([-1, -1, 2, -1, 3])) == (1, 2)
    assert longest_run(np.array([-1, -1, -1])) == (0, -1)
