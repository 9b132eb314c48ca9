"""token_slot_table with no steps gives an empty table and grad_accum 1; with steps, ids go to rank j % world_size."""

from __future__ import annotations

import numpy as np

from strategies.slots import token_slot_table


def test_no_steps():
    table, grad_accum = token_slot_table(np.array([], dtype=np.int64), np.array([0], dtype=np.int64), 2)
    assert grad_accum == 1
    assert table.shape == (0, 2) and table.dtype == np.int64


def test_no_steps_one_rank():
    table, grad_accum = token_slot_table(np.array([], dtype=np.int64), np.array([0], dtype=np.int64), 1)
    assert grad_accum == 1 and table.shape == (0, 1)


def test_steps_of_varying_size():
    table, grad_accum = token_slot_table(np.array([4, 2, 0, 1, 3], dtype=np.int64), np.array([0, 3, 5], dtype=np.int64), 2)
    assert grad_accum == 2
    assert table.tolist() == [[4, 0, 2, -1], [1, -1, 3, -1]]
