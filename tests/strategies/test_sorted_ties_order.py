"""SortedStrategy.micro_batches sorts by length stably: equal lengths keep the seeded tie permutation's order."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strategies import STATIC_EPOCH, Budget, Purpose, generator
from strategies.builtin import SortedStrategy


@pytest.mark.parametrize("top", [3, 300, 70_000])
def test_equal_lengths_keep_the_tie_permutation(top):
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 4, 200).astype(np.int64) * (top // 3)
    prepared = SimpleNamespace(kept=np.arange(200, dtype=np.int64), lengths=lengths)
    ties = generator(11, STATIC_EPOCH, Purpose.SORTED_TIES).permutation(prepared.kept)
    expected = [int(i) for value in sorted(set(lengths.tolist())) for i in ties if lengths[i] == value]
    micro = SortedStrategy().micro_batches(prepared, Budget(10 * top), 11, 4, 1)
    assert micro.order.tolist() == expected
