"""RankBalance's fields and coercion (None, objects, mappings, cost fields) with their exact errors, and rank_costs' per-rank sums."""

from __future__ import annotations

import re

import numpy as np
import pytest

from strategies import CostModel, RankBalance
from strategies.balance import rank_costs


def test_the_default_balance_uses_the_default_cost_model_within_each_step():
    balance = RankBalance()
    assert balance.cost_model == CostModel() and balance.window_steps == 1


def test_a_cost_model_mapping_is_stored_as_a_cost_model():
    balance = RankBalance(cost_model={"a": 2.0, "c": 0.5}, window_steps=3)
    assert isinstance(balance.cost_model, CostModel)
    assert balance.cost_model == CostModel(a=2.0, c=0.5) and balance.window_steps == 3


@pytest.mark.parametrize("cost_model", [None, 3.0, "fast", (1.0, 2.0)])
def test_a_cost_model_that_is_neither_a_cost_model_nor_a_mapping_is_refused(cost_model):
    with pytest.raises(
        ValueError,
        match=rf"^RankBalance\.cost_model={re.escape(repr(cost_model))} must be a CostModel\(a, b, c\) or a mapping of its fields$",
    ):
        RankBalance(cost_model=cost_model)


@pytest.mark.parametrize("window_steps", [0, -2])
def test_window_steps_below_one_are_refused_with_the_fix(window_steps):
    with pytest.raises(
        ValueError, match=rf"^RankBalance\.window_steps={window_steps} must be >= 1; use 1 to balance within each step only$"
    ):
        RankBalance(window_steps=window_steps)


@pytest.mark.parametrize(("window_steps", "shown"), [("2", "'2'"), (1.0, "1.0"), (True, "True"), (None, "None")])
def test_window_steps_that_are_not_integers_are_refused_with_the_fix(window_steps, shown):
    with pytest.raises(
        ValueError,
        match=rf"^RankBalance\.window_steps={shown} must be an integer >= 1; use 1 to balance within each step only$",
    ):
        RankBalance(window_steps=window_steps)


def test_coerce_passes_none_and_balance_objects_through():
    assert RankBalance.coerce(None) is None
    balance = RankBalance(window_steps=2)
    assert RankBalance.coerce(balance) is balance


@pytest.mark.parametrize(
    ("mapping", "expected"),
    [
        ({}, RankBalance()),
        ({"window_steps": 2}, RankBalance(window_steps=2)),
        ({"cost_model": {"b": 1e-3}}, RankBalance(cost_model=CostModel(b=1e-3))),
        ({"cost_model": CostModel(a=3.0), "window_steps": 4}, RankBalance(CostModel(a=3.0), 4)),
        ({"a": 1.0, "b": 1e-3}, RankBalance(CostModel(a=1.0, b=1e-3))),
        ({"c": 4.0, "block_size": 32, "num_anchors": 8, "window_steps": 2},
         RankBalance(CostModel(c=4.0, block_size=32, num_anchors=8), 2)),
    ],
)
def test_coerce_builds_a_balance_from_a_mapping_of_its_fields_or_the_cost_fields(mapping, expected):
    given = dict(mapping)
    balance = RankBalance.coerce(mapping)
    assert isinstance(balance, RankBalance) and balance == expected
    assert mapping == given  # the caller's mapping is left as it was


@pytest.mark.parametrize(
    ("mapping", "unknown"), [({"bogus": 1}, "['bogus']"), ({"window": 2, "a": 1.0, "Cost_model": 3}, "['Cost_model', 'window']")]
)
def test_coerce_refuses_unknown_fields_naming_them_and_the_known_ones(mapping, unknown):
    with pytest.raises(
        ValueError,
        match=rf"^balance has unknown field\(s\) {re.escape(unknown)}; use cost_model \(or a, b, c, block_size, "
        r"num_anchors\) and window_steps$",
    ):
        RankBalance.coerce(mapping)


def test_coerce_refuses_a_cost_model_together_with_its_fields():
    with pytest.raises(ValueError, match=r"^balance: give either cost_model or its fields \(a, b, c, \.\.\.\), not both$"):
        RankBalance.coerce({"cost_model": CostModel(), "b": 1e-3})


@pytest.mark.parametrize(("value", "shown"), [(1, "1"), ("balanced", "'balanced'"), ([("a", 1.0)], r"\[\('a', 1\.0\)\]")])
def test_coerce_refuses_anything_else(value, shown):
    with pytest.raises(ValueError, match=rf"^balance={shown} must be None, a RankBalance or a mapping of its fields$"):
        RankBalance.coerce(value)


def test_rank_costs_sum_each_ranks_accumulation_slots_per_step():
    slot_costs = np.arange(12, dtype=float).reshape(2, 6)
    costs = rank_costs(slot_costs, 2, 3)
    assert costs.shape == (2, 2)
    np.testing.assert_array_equal(costs, [[0 + 1 + 2, 3 + 4 + 5], [6 + 7 + 8, 9 + 10 + 11]])
    np.testing.assert_array_equal(rank_costs(slot_costs, 3, 2), [[1, 5, 9], [13, 17, 21]])
    np.testing.assert_array_equal(rank_costs(np.arange(3.0).reshape(3, 1), 1, 1), [[0], [1], [2]])

