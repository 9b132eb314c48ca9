"""Per-step length metrics on plans with empty and one-sample steps: step_mean_lengths skips empty steps, length_mix_divergence counts one-sample steps."""

from __future__ import annotations

import math

import numpy as np

from strategies import Budget, Plan
from strategies.metrics import length_mix_divergence, step_mean_lengths


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
