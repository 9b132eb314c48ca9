"""explicit_edges accepts 1 as an edge, rejects repeated edges and an empty list with their exact messages."""

from __future__ import annotations

import re

import numpy as np
import pytest

from strategies.edges import explicit_edges


def test_empty_edges_message():
    with pytest.raises(ValueError) as info:
        explicit_edges([], longest=20)
    assert str(info.value) == "edges is an empty list; give increasing integer upper edges, or 'dp'/'quantile'"


def test_edge_one_is_accepted():
    assert explicit_edges([1], longest=5).tolist() == [1, 5]
    assert explicit_edges([1, 3], longest=3).tolist() == [1, 3]
    assert explicit_edges([np.int64(1), 2], longest=1).tolist() == [1, 2]


def test_edge_two_is_accepted():
    assert explicit_edges([2, 4], longest=8).tolist() == [2, 4, 8]


def test_zero_edge_is_rejected():
    with pytest.raises(ValueError, match=re.escape("edges[0] = 0 must be a positive integer (an upper length bound)")):
        explicit_edges([0, 4], longest=8)


def test_repeated_edge_is_rejected():
    with pytest.raises(ValueError) as info:
        explicit_edges([3, 3], longest=10)
    assert str(info.value) == (
        "edges[1] = 3 is not greater than edges[0] = 3; edges must be strictly increasing"
    )
    with pytest.raises(ValueError, match=re.escape("edges[2] = 5 is not greater than edges[1] = 5")):
        explicit_edges([1, 5, 5, 9], longest=10)


def test_edges_are_int64_whatever_the_integer_type():
    narrow = explicit_edges([np.int32(4), np.int32(32)], longest=20)
    assert narrow.dtype == np.int64 and narrow.tolist() == [4, 32]
    unsigned = explicit_edges([np.uint8(2), np.uint16(300)], longest=300)
    assert unsigned.dtype == np.int64 and unsigned.tolist() == [2, 300]
    assert explicit_edges([3, 7], longest=7).dtype == np.int64


def test_edge_beyond_int64_overflows():
    with pytest.raises(OverflowError):
        explicit_edges([4, 2**63], longest=20)
