"""The run's arguments checked with exact errors: world_size, grad_accum, seed, epoch, the oversize policy and the budget's accepted forms."""

from __future__ import annotations

import numpy as np
import pytest

from strategies import Budget
from strategies.validate import (
    check_non_negative_int,
    check_oversize_policy,
    check_positive_int,
    check_run_shape,
    coerce_budget,
)

WORLD_FIX = "it is the number of data-parallel ranks \\(1 for one process\\)"
ACCUM_FIX = "it is the number of micro-batches per rank per optimizer step \\(1 = none\\)"


def test_a_valid_run_shape_comes_back_as_python_ints_in_order():
    shape = check_run_shape(np.int32(4), np.int64(2), np.uint8(7), 3)
    assert shape == (4, 2, 7, 3) and all(type(value) is int for value in shape)
    assert check_run_shape(1, 1, 0, 0) == (1, 1, 0, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1, 0, 0), rf"^world_size=0 must be >= 1; {WORLD_FIX}$"),
        ((-3, 1, 0, 0), rf"^world_size=-3 must be >= 1; {WORLD_FIX}$"),
        ((True, 1, 0, 0), rf"^world_size=True must be an integer >= 1; {WORLD_FIX}$"),
        ((2.0, 1, 0, 0), rf"^world_size=2\.0 must be an integer >= 1; {WORLD_FIX}$"),
        ((2, 0, 0, 0), rf"^grad_accum=0 must be >= 1; {ACCUM_FIX}$"),
        ((2, "2", 0, 0), rf"^grad_accum='2' must be an integer >= 1; {ACCUM_FIX}$"),
        ((2, np.bool_(True), 0, 0), rf"^grad_accum=np\.True_ must be an integer >= 1; {ACCUM_FIX}$"),
        ((1, 1, -1, 0), r"^seed=-1 must be a non-negative integer$"),
        ((1, 1, 0.0, 0), r"^seed=0\.0 must be a non-negative integer$"),
        ((1, 1, 0, -1), r"^epoch=-1 must be a non-negative integer$"),
        ((1, 1, 0, False), r"^epoch=False must be a non-negative integer$"),
    ],
)
def test_a_bad_run_shape_is_refused_naming_the_argument_and_the_fix(args, message):
    with pytest.raises(ValueError, match=message):
        check_run_shape(*args)


def test_check_positive_int_returns_a_python_int_and_names_the_argument():
    assert check_positive_int("n", np.int16(3), "fix") == 3 and type(check_positive_int("n", np.int16(3), "fix")) is int
    assert check_positive_int("n", 1, "fix") == 1
    with pytest.raises(ValueError, match=r"^n=0 must be >= 1; fix it$"):
        check_positive_int("n", 0, "fix it")


def test_check_non_negative_int_accepts_zero_and_returns_a_python_int():
    assert check_non_negative_int("seed", 0) == 0
    value = check_non_negative_int("seed", np.int64(9))
    assert value == 9 and type(value) is int
    with pytest.raises(ValueError, match=r"^seed=np\.True_ must be a non-negative integer$"):
        check_non_negative_int("seed", np.bool_(True))


@pytest.mark.parametrize("policy", ["error", "truncate", "drop"])
def test_the_three_oversize_policies_are_accepted(policy):
    assert check_oversize_policy(policy) is None


@pytest.mark.parametrize(("policy", "shown"), [("Drop", "'Drop'"), ("", "''"), (None, "None")])
def test_another_oversize_policy_is_refused_with_the_policies(policy, shown):
    with pytest.raises(ValueError, match=rf"^oversize={shown} is not a policy; use one of \['error', 'truncate', 'drop'\]$"):
        check_oversize_policy(policy)


def test_a_budget_may_be_given_as_a_budget_an_integer_or_a_mapping():
    budget = Budget(64, 4)
    assert coerce_budget(budget) is budget
    assert coerce_budget(128) == Budget(128)
    assert coerce_budget(np.int32(128)) == Budget(128)
    assert type(coerce_budget(np.int32(128)).max_tokens) is int
    assert coerce_budget({"max_tokens": 64}) == Budget(64)
    assert coerce_budget({"max_tokens": 64, "max_samples": 2}) == Budget(64, 2)


@pytest.mark.parametrize(
    ("budget", "fields"), [({"max_tokens": 5, "x": 1}, r"\['max_tokens', 'x'\]"), ({"max_samples": 3}, r"\['max_samples'\]"), ({}, r"\[\]")]
)
def test_a_budget_mapping_without_max_tokens_or_with_other_fields_is_refused(budget, fields):
    with pytest.raises(
        ValueError,
        match=rf"^budget mapping with fields {fields} is not a Budget; give max_tokens \(and optionally max_samples\)$",
    ):
        coerce_budget(budget)


@pytest.mark.parametrize(("budget", "shown"), [("7", "'7'"), (True, "True"), (2.0, "2\\.0"), (None, "None"), (np.bool_(False), "np\\.False_")])
def test_a_budget_of_another_kind_is_refused(budget, shown):
    with pytest.raises(ValueError, match=rf"^budget={shown} must be a Budget\(max_tokens, max_samples=None\) or an integer max_tokens$"):
        coerce_budget(budget)
