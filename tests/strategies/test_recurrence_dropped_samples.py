"""Recurrence counts only samples present in both epochs; with none in both it is NaN over 0 pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies import Budget, Plan
from strategies.metrics import composition_recurrence, step_recurrence


def hand_plan(sizes, lengths, sample_indices, dropped=()) -> Plan:
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Plan("hand", "padded", np.array(lengths, dtype=np.int64), np.array(sample_indices, dtype=np.int64),
                offsets, Budget(10_000), 0, 0, 1, 1, dropped=np.array(dropped, dtype=np.int64))


LENGTHS = [5, 6, 7, 8, 9]


@pytest.mark.parametrize("recurrence", [composition_recurrence, step_recurrence])
def test_a_sample_missing_from_either_epoch_is_left_out(recurrence):
    # epoch 0 drops sample 4; epoch 1 drops sample 0. Pairs over {1, 2, 3}: epoch 0 groups {1, 2} | {3};
    # epoch 1 groups {1, 2} again, so 1 pair of 1 recurs
    first = hand_plan([3, 1], LENGTHS, [0, 1, 2, 3], dropped=[4])
    second = hand_plan([1, 2, 1], LENGTHS, [3, 1, 2, 4], dropped=[0])
    assert recurrence(first, second) == (1.0, 1)
    # the other way round: epoch 0 = the second plan, groups {3} | {1, 2} | {4}; sample 4 is not in epoch 1
    assert recurrence(second, first) == (1.0, 1)


@pytest.mark.parametrize("recurrence", [composition_recurrence, step_recurrence])
def test_no_sample_in_both_epochs_is_nan_over_zero_pairs(recurrence):
    first = hand_plan([2], LENGTHS, [0, 1], dropped=[2, 3, 4])
    second = hand_plan([3], LENGTHS, [2, 3, 4], dropped=[0, 1])
    value, pairs = recurrence(first, second)
    assert math.isnan(value) and pairs == 0
    empty = hand_plan([], LENGTHS, [], dropped=[0, 1, 2, 3, 4])
    value, pairs = recurrence(empty, empty)
    assert math.isnan(value) and pairs == 0
