"""LengthGroupedStrategy.megabatch_size: a sample over half the budget makes batches of 1; the budget is floor-divided by the median."""

from __future__ import annotations

import numpy as np

from strategies import Budget
from strategies.builtin import LengthGroupedStrategy


def test_median_over_half_the_budget_gives_one_sample():
    assert LengthGroupedStrategy().megabatch_size(np.array([10, 10, 10]), Budget(15)) == 1
    assert LengthGroupedStrategy().megabatch_size(np.array([9, 10, 40]), Budget(19)) == 1


def test_budget_is_floor_divided_by_the_median():
    # 11 / 1.1 is 10.0 in float arithmetic, but 11 // 1.1 floors to 9.0 (1.1 is stored slightly above 1.1)
    assert 11 // 1.1 == 9.0 and 11 / 1.1 == 10.0
    assert LengthGroupedStrategy().megabatch_size(np.array([1.1, 1.1, 1.1]), Budget(11)) == 9
    assert LengthGroupedStrategy().megabatch_size(np.array([2.7, 1.0, 3.0]), Budget(27)) == 9
    assert LengthGroupedStrategy().megabatch_size(np.array([7, 10, 12]), Budget(25)) == 2
