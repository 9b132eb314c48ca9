"""drafter_blocks takes lengths as int64 whatever their type; micro_batch_blocks returns float64 block counts."""

from __future__ import annotations

import numpy as np

from strategies.cost import CostModel, drafter_blocks


def test_unsigned_lengths_below_the_block_size_give_zero_blocks():
    result = drafter_blocks(np.array([3, 15, 16, 20], dtype=np.uint8), 16, 512)
    assert result.dtype == np.int64
    assert result.tolist() == [0, 0, 1, 5]
    assert drafter_blocks(np.array([3, 600], dtype=np.uint16), 16, 512).tolist() == [0, 512]


def test_float_lengths_give_int64_blocks():
    result = drafter_blocks([3.0, 20.0, 600.0], 16, 512)
    assert result.dtype == np.int64
    assert result.tolist() == [0, 5, 512]


def test_list_lengths():
    result = drafter_blocks([1, 4, 9], 4, 3)
    assert result.dtype == np.int64 and result.tolist() == [0, 1, 3]


def test_micro_batch_blocks_are_float64():
    blocks = CostModel().micro_batch_blocks(
        np.array([3, 20, 40], dtype=np.int64), np.array([0, 1, 2], dtype=np.int64), np.array([0, 2, 2, 3], dtype=np.int64)
    )
    assert blocks.dtype == np.float64
    assert blocks.tolist() == [5.0, 0.0, 25.0]
