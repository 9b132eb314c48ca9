"""sample_step and sample_micro_batch give -1 to every sample the plan does not contain; pair_count counts pairs in exact integers."""

from __future__ import annotations

import numpy as np

from strategies import Budget, Plan
from strategies.metrics import sample_micro_batch, sample_step


def hand_plan(sizes, lengths, sample_indices, dropped=()) -> Plan:
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Plan("hand", "padded", np.array(lengths, dtype=np.int64), np.array(sample_indices, dtype=np.int64),
                offsets, Budget(10_000), 0, 0, 1, 1, dropped=np.array(dropped, dtype=np.int64))


def test_dropped_sample_is_minus_one():
    plan = hand_plan([2, 1, 1], [5, 6, 7, 8, 9], [3, 0, 1, 2], dropped=[4])
    assert sample_micro_batch(plan).tolist() == [0, 1, 2, 0, -1]
    assert sample_step(plan).tolist() == [0, 1, 2, 0, -1]


def test_all_samples_present_has_no_minus_one():
    plan = hand_plan([1, 2], [5, 6, 7], [2, 0, 1])
    assert sample_step(plan).tolist() == [1, 1, 0]


def test_pairs_are_counted_in_exact_integers():
    from strategies.metrics import pair_count

    big = 3_000_000_000
    assert pair_count(np.array([big], dtype=np.int64)) == big * (big - 1) // 2
    assert pair_count(np.array([big, 3, 1, 0], dtype=np.int64)) == big * (big - 1) // 2 + 3
    assert pair_count(np.array([4, 5], dtype=np.int32)) == 16
