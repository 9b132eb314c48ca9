"""bucket_edges refuses a bucket count below one and a sample over the budget, each message ending with its fix."""

from __future__ import annotations

import pytest

from strategies import BucketedStrategy, Budget
from strategies.edges import bucket_edges


@pytest.mark.parametrize("count", [0, 1.5])
def test_a_bucket_count_below_one_or_not_an_integer_names_the_fix(count):
    with pytest.raises(ValueError) as info:
        bucket_edges([3, 5, 9], num_buckets=count)
    assert str(info.value).startswith("num_buckets=") and str(info.value).endswith("; use at least one bucket")


def test_a_sample_over_the_budget_says_to_apply_the_oversize_policy_first():
    with pytest.raises(ValueError) as info:
        bucket_edges([3, 50, 9], num_buckets=2, budget=Budget(max_tokens=16))
    message = str(info.value)
    assert message.startswith("lengths[1] = 50 exceeds Budget.max_tokens=16; ")
    assert message.endswith("apply the oversize policy (truncate or drop) before computing edges")


def test_the_bucketed_strategy_refuses_each_bad_option_with_its_fix():
    with pytest.raises(ValueError) as info:
        BucketedStrategy(num_buckets=0)
    assert str(info.value) == "bucketed num_buckets=0 must be >= 1; use at least one bucket"
    for bad in (True, "0.5", 0, 1.5, 2):  # a bool, not a number, outside (0, 1]
        with pytest.raises(ValueError, match=r"must be a number in \(0, 1\] or None"):
            BucketedStrategy(max_recurrence=bad)
    assert BucketedStrategy(max_recurrence=1).max_recurrence == 1  # 1 is inside
    with pytest.raises(ValueError) as info:
        BucketedStrategy(edges="nope")
    assert str(info.value).endswith("or a list of increasing integer upper edges")
    with pytest.raises(ValueError) as info:
        BucketedStrategy(edges=5)
    assert str(info.value) == "bucketed edges=5 must be a method name or a list of integers"
    edges = BucketedStrategy(edges=[1, 8]).edges  # the values as a tuple, 1 a valid edge
    assert edges == (1, 8) and isinstance(edges, tuple)
