"""real_slots_first keeps each rank's micro-batch ids in order (id 0 is real) however many slots a rank has."""

from __future__ import annotations

import numpy as np

from strategies.slots import real_slots_first


def expected(table: np.ndarray, world_size: int, grad_accum: int) -> list:
    rows = []
    for row in table.tolist():
        out = []
        for rank in range(world_size):
            block = row[rank * grad_accum:(rank + 1) * grad_accum]
            real = [x for x in block if x >= 0]
            out += real + [-1] * (grad_accum - len(real))
        rows.append(out)
    return rows


def test_id_zero_is_a_real_slot():
    table = np.array([[-1, 0, 3, -1, -1, 0]], dtype=np.int64)
    assert real_slots_first(table, 2, 3).tolist() == [[0, 3, -1, 0, -1, -1]]
    assert real_slots_first(np.array([[-1, 0]]), 1, 2).tolist() == [[0, -1]]


def test_many_slots_keep_their_order():
    rng = np.random.default_rng(1)
    for grad_accum in (17, 40, 100, 300):
        table = np.arange(2 * 2 * grad_accum, dtype=np.int64)
        table[rng.random(table.size) < 0.4] = -1
        table = table.reshape(2, 2 * grad_accum)
        assert real_slots_first(table, 2, grad_accum).tolist() == expected(table, 2, grad_accum)


def test_descending_ids_stay_descending():
    grad_accum = 64
    row = np.arange(grad_accum, 0, -1, dtype=np.int64) - 1
    row[::3] = -1
    result = real_slots_first(row.reshape(1, grad_accum), 1, grad_accum)
    assert result.tolist() == expected(row.reshape(1, grad_accum), 1, grad_accum)
