"""cut_token_steps counts tokens as int64 (fractions dropped); expected_budget_slots takes lengths and edges as int64, skips empty buckets, names a too-short last edge."""

from __future__ import annotations

import numpy as np
import pytest

from strategies import Budget
from strategies.base import cut_token_steps
from strategies.edges import expected_budget_slots


def test_fractional_tokens_are_truncated():
    # as [1, 1, 1]: the first step holds 2 tokens, the rest is the last step
    assert cut_token_steps(np.array([1.9, 1.9, 1.9]), 2).tolist() == [0, 2, 3]
    assert cut_token_steps(np.array([1, 1, 1]), 2).tolist() == [0, 2, 3]
    assert cut_token_steps(np.array([2.5, 2.5, 2.5, 2.5]), 4).tolist() == [0, 2, 4]


def test_float_lengths_give_the_integer_objective():
    lengths = [5, 6, 6, 9, 12, 12, 20, 3]
    reference = expected_budget_slots(np.array(lengths, dtype=np.int64), [8, 16, 32], Budget(32))
    assert expected_budget_slots(np.array(lengths, dtype=np.float64), [8, 16, 32], Budget(32)) == reference
    assert expected_budget_slots([float(x) for x in lengths], np.array([8.0, 16.0, 32.0]), Budget(32)) == reference
    assert abs(reference - 78.84168275970929) < 1e-9


def test_edges_short_of_the_longest_sample_message():
    lengths = np.array([3, 20, 9], dtype=np.int64)
    with pytest.raises(ValueError) as info:
        expected_budget_slots(lengths, [4, 8, 16], Budget(32))
    assert str(info.value) == "edges end at 16 but the longest sample is 20"
    with pytest.raises(ValueError) as info:
        expected_budget_slots(lengths, np.array([4.0, 8.0, 16.5]), Budget(32))
    assert str(info.value) == "edges end at 16 but the longest sample is 20"


def test_edge_beyond_int64_overflows():
    with pytest.raises(OverflowError):
        expected_budget_slots(np.array([3, 20]), [8, 2**63], Budget(32))


def test_empty_buckets_are_skipped():
    lengths = np.array([5, 6, 6, 9, 12, 12, 20, 3], dtype=np.int64)
    reference = expected_budget_slots(lengths, [8, 16, 32], Budget(32))
    assert expected_budget_slots(lengths, [2, 8, 16, 32], Budget(32)) == reference
    assert expected_budget_slots(lengths, [1, 2, 8, 8, 16, 17, 18, 32], Budget(32)) == reference
