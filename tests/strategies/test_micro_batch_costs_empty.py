"""CostModel.micro_batch_costs: empty slots cost exactly 0 (packed or padded), long lengths are squared in float64, c weighs drafter blocks."""

from __future__ import annotations

import numpy as np

from strategies.cost import CostModel


LENGTHS = np.array([3, 5, 2, 4], dtype=np.int64)
INDICES = np.array([0, 1, 2, 3], dtype=np.int64)
OFFSETS = np.array([0, 2, 2, 4, 4], dtype=np.int64)  # slots 1 and 3 are empty


def test_packed_empty_slots_cost_nothing():
    cost = CostModel(a=1.0, b=0.5, c=0.0).micro_batch_costs(LENGTHS, INDICES, OFFSETS, "packed", 10)
    assert cost.dtype == np.float64
    assert cost.tolist() == [10 + 0.5 * (9 + 25), 0.0, 10 + 0.5 * (4 + 16), 0.0]


def test_packed_slots_term_alone():
    cost = CostModel(a=2.0, b=0.0, c=0.0).micro_batch_costs(LENGTHS, INDICES, OFFSETS, "packed", 7)
    assert cost.tolist() == [14.0, 0.0, 14.0, 0.0]


def test_padded_empty_slots_cost_nothing():
    cost = CostModel(a=1.0, b=1.0, c=0.0).micro_batch_costs(LENGTHS, INDICES, OFFSETS, "padded", 10)
    assert cost.tolist() == [2 * 5 + 2 * 25, 0.0, 2 * 4 + 2 * 16, 0.0]


def test_padded_square_of_a_long_length_does_not_overflow():
    lengths = np.array([2**32, 7], dtype=np.int64)
    cost = CostModel(a=0.0, b=1.0, c=0.0).micro_batch_costs(
        lengths, np.array([0, 1], dtype=np.int64), np.array([0, 1, 2], dtype=np.int64), "padded", 10
    )
    assert cost.tolist() == [float(2**64), 49.0]
    cost = CostModel(a=1.0, b=2.0, c=0.0).micro_batch_costs(
        np.array([3, 2**33], dtype=np.int64), np.array([0, 1], dtype=np.int64), np.array([0, 2], dtype=np.int64),
        "padded", 10,
    )
    assert cost.tolist() == [2.0 * 2**33 + 2.0 * 2 * float(2**66)]


def test_drafter_term_adds_c_times_blocks():
    model = CostModel(a=1.0, b=0.0, c=2.0, block_size=2, num_anchors=3)  # blocks 2, 3, 1, 3
    assert model.micro_batch_costs(LENGTHS, INDICES, OFFSETS, "packed", 10).tolist() == [20.0, 0.0, 18.0, 0.0]
    assert model.micro_batch_costs(LENGTHS, INDICES, OFFSETS, "padded", 10).tolist() == [20.0, 0.0, 16.0, 0.0]
    assert model.target_only().micro_batch_costs(LENGTHS, INDICES, OFFSETS, "padded", 10).tolist() == [10.0, 0.0, 8.0, 0.0]
