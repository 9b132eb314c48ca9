"""modelled_bucket_recurrence with float or narrow-integer lengths, edges that leave a bucket empty, and edges beyond int64."""

from __future__ import annotations

import numpy as np
import pytest

from strategies import Budget
from strategies.edges import modelled_bucket_recurrence

LENGTHS = [5, 6, 6, 9, 12, 12, 20, 3]
EDGES = [8, 16, 32]


def expected() -> list[float]:
    return modelled_bucket_recurrence(np.array(LENGTHS, dtype=np.int64), np.array(EDGES, dtype=np.int64), Budget(32)).tolist()


def test_reference_values():
    result = modelled_bucket_recurrence(np.array(LENGTHS), EDGES, Budget(32))
    assert result.dtype == np.float64
    assert result[0] == 1.0 and result[2] == 0.0
    assert abs(result[1] - 0.52727273) < 1e-8


def test_float_lengths_are_taken_as_integers():
    assert modelled_bucket_recurrence(np.array(LENGTHS, dtype=np.float64), EDGES, Budget(32)).tolist() == expected()
    assert modelled_bucket_recurrence([float(x) for x in LENGTHS], EDGES, Budget(32)).tolist() == expected()


def test_narrow_integer_lengths():
    assert modelled_bucket_recurrence(np.array(LENGTHS, dtype=np.int32), EDGES, Budget(32)).tolist() == expected()
    assert modelled_bucket_recurrence(np.array(LENGTHS, dtype=np.uint16), EDGES, Budget(32)).tolist() == expected()


def test_float_and_unsigned_edges():
    assert modelled_bucket_recurrence(np.array(LENGTHS), np.array(EDGES, dtype=np.float64), Budget(32)).tolist() == expected()
    assert modelled_bucket_recurrence(np.array(LENGTHS), np.array(EDGES, dtype=np.uint64), Budget(32)).tolist() == expected()


def test_edges_with_no_lengths_are_skipped():
    lengths = np.array(LENGTHS)
    assert modelled_bucket_recurrence(lengths, [2] + EDGES, Budget(32)).tolist() == expected()
    assert modelled_bucket_recurrence(lengths, [1, 2, 8, 16, 17, 18, 32, 40], Budget(32)).tolist() == expected()
    assert modelled_bucket_recurrence(lengths, [8, 8, 16, 32], Budget(32)).tolist() == expected()
    assert modelled_bucket_recurrence(lengths, [2], Budget(32)).tolist() == []


def test_edge_beyond_int64_overflows():
    with pytest.raises(OverflowError):
        modelled_bucket_recurrence(np.array(LENGTHS), [8, 2**63], Budget(32))
