"""expected_padded_slots: every sample padded to its bucket's upper edge, and the edges-too-short error naming the last edge."""

from __future__ import annotations

import numpy as np
import pytest

from strategies import expected_padded_slots


def test_each_sample_is_padded_to_the_first_edge_at_or_above_it():
    # 3 -> 4, 4 -> 4 (an edge is an inclusive upper bound), 5 -> 8, 8 -> 8
    assert expected_padded_slots([3, 4, 5, 8], [4, 8]) == 24
    assert expected_padded_slots(np.array([3, 4, 5, 8], dtype=np.int32), np.array([4, 8], dtype=np.uint16)) == 24
    assert expected_padded_slots([], [4]) == 0


def test_whole_float_lengths_and_edges_count_as_integers():
    slots = expected_padded_slots(np.array([3.0, 8.0]), np.array([4.0, 8.0]))
    assert slots == 12 and type(slots) is int


@pytest.mark.parametrize(
    ("lengths", "edges"),
    [
        ([3, 9], [2, 4, 6]),
        (np.array([3.0, 9.0]), [2, 4, 6]),
        ([3, 9], np.array([2.0, 4.0, 6.0])),
        (np.array([9, 3], dtype=np.int16), (2, 4, 6)),
    ],
)
def test_edges_ending_below_the_longest_sample_are_refused_naming_the_last_edge(lengths, edges):
    with pytest.raises(ValueError, match=r"^edges end at 6 but the longest sample is 9$"):
        expected_padded_slots(lengths, edges)
