"""Per-step length metrics on plans with empty and one-sample steps: step_mean_lengths skips empty steps, length_mix_divergence counts one-sample steps."""

from __future__ import annotations

import math

import numpy as np

from strategies import Budget, Plan
from strategies.metrics import length_mix_divergence, quantile_bins, step_mean_lengths


def one_rank_plan(sizes, lengths) -> Plan:
    """A plan on one rank without accumulation: one micro-batch per step, samples 0, 1, ... in order."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Plan("sorted", "padded", np.array(lengths, dtype=np.int64), np.arange(offsets[-1], dtype=np.int64),
                offsets, Budget(100), 0, 0, 1, 1)


def test_step_mean_lengths_skips_empty_steps_anywhere_in_the_plan():
    means = step_mean_lengths(one_rank_plan([2, 0, 3, 0], [4, 6, 1, 2, 3]))
    assert means.dtype == np.float64
    np.testing.assert_array_equal(means, [5.0, 2.0])
    np.testing.assert_array_equal(step_mean_lengths(one_rank_plan([1, 0], [7])), [7.0])
    np.testing.assert_array_equal(step_mean_lengths(one_rank_plan([0, 3], [2, 2, 5])), [3.0])


def test_length_mix_divergence_counts_steps_of_one_sample():
    # eight distinct lengths in eight bins, one sample per step: each step's KL is log(8)
    kl, kl_random = length_mix_divergence(one_rank_plan([1] * 8, range(1, 9)), mix_bins=8)
    assert math.isclose(kl, math.log(8)) and math.isclose(kl_random, math.log(8))


def test_length_mix_divergence_ignores_empty_steps():
    lengths = range(1, 9)
    with_empty = length_mix_divergence(one_rank_plan([2, 0, 2, 2, 0, 2], lengths), mix_bins=8)
    without = length_mix_divergence(one_rank_plan([2, 2, 2, 2], lengths), mix_bins=8)
    assert with_empty == without
    assert math.isclose(with_empty[0], math.log(4))


def empty_plan() -> Plan:
    """A plan of two steps holding no sample (both samples dropped)."""
    return Plan("sorted", "padded", np.array([5, 7], dtype=np.int64), np.zeros(0, dtype=np.int64),
                np.zeros(3, dtype=np.int64), Budget(100), 0, 0, 1, 1, dropped=np.array([0, 1], dtype=np.int64))


def test_length_mix_divergence_of_a_plan_without_samples_is_nan_nan():
    kl, kl_random = length_mix_divergence(empty_plan())
    assert type(kl) is float and type(kl_random) is float
    assert math.isnan(kl) and math.isnan(kl_random)


def test_length_mix_divergence_of_a_one_sample_plan_is_zero():
    assert length_mix_divergence(one_rank_plan([1], [9])) == (0.0, 0.0)


def test_length_mix_divergence_defaults_to_16_bins():
    # 272 = 16 * 17 distinct lengths, one per step: each step's KL is log(bins)
    plan = one_rank_plan([1] * 272, range(1, 273))
    kl, kl_random = length_mix_divergence(plan)
    assert math.isclose(kl, math.log(16)) and math.isclose(kl_random, math.log(16))
    assert (kl, kl_random) == length_mix_divergence(plan, mix_bins=16)
    assert math.isclose(length_mix_divergence(plan, mix_bins=17)[0], math.log(17))


def _mean_kl(step_sizes, bins, num_bins):
    """Mean over non-empty steps of KL(step histogram || dataset histogram), steps filled in order."""
    dataset = np.bincount(bins, minlength=num_bins) / bins.size
    kls, start = [], 0
    for size in step_sizes:
        if size:
            hist = np.bincount(bins[start:start + size], minlength=num_bins) / size
            kls.append(sum(p * math.log(p / q) for p, q in zip(hist, dataset) if p > 0))
        start += size
    return float(np.mean(kls))


def test_length_mix_baseline_is_the_mean_over_draws_seeded_0_1_2_dots():
    rng = np.random.default_rng(12345)
    lengths = rng.integers(1, 1000, size=200)
    sizes = [20] * 10
    plan = one_rank_plan(sizes, lengths)
    bins, num_bins = quantile_bins(lengths, 16)
    per_draw = [_mean_kl(sizes, bins[np.random.default_rng(draw).permutation(bins.size)], num_bins) for draw in range(4)]
    kl, kl_random = length_mix_divergence(plan)
    assert math.isclose(kl, _mean_kl(sizes, bins, num_bins), rel_tol=1e-12)
    assert math.isclose(kl_random, float(np.mean(per_draw)), rel_tol=1e-12)
    assert math.isclose(length_mix_divergence(plan, draws=1)[1], per_draw[0], rel_tol=1e-12)
    assert math.isclose(length_mix_divergence(plan, draws=2)[1], float(np.mean(per_draw[:2])), rel_tol=1e-12)
    assert length_mix_divergence(plan) == (kl, kl_random)
