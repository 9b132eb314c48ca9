"""Every bad input is refused before planning, with the offending index, its value and the fix."""

from __future__ import annotations

import re

import numpy as np
import pytest

from strategies import Budget, LengthsError, available_strategies, plan
from strategies.validate import as_length_array, prepare_lengths


@pytest.mark.parametrize(
    ("lengths", "pattern"),
    [
        ([], r"lengths is empty: a plan needs at least one sample"),
        (np.zeros(0, dtype=np.int64), r"lengths is empty"),
        ([4, 5.5, 6], r"lengths\[1\] = 5\.5 is not a whole number; sample lengths are token counts"),
        (np.array([3.0, 7.25]), r"lengths\[1\] = .*7\.25.* is not a whole number"),
        ([4, float("nan")], r"lengths\[1\] = nan is not a finite number"),
        (np.array([1.0, 2.0, np.inf]), r"lengths\[2\] = .*inf.* is not a finite number"),
        # whole floats beyond int64 used to wrap to a negative length and be planned silently
        ([5.0, 1e20], r"lengths\[1\] = 1e\+20 does not fit in int64"),
        (np.array([3.0, -1e19]), r"lengths\[1\] = -1e\+19 does not fit in int64"),
        ([5, 2**70], r"lengths\[1\] = 1180591620717411303424 does not fit in int64"),
        ([5, 2**63], r"lengths\[1\] = 9223372036854775808 does not fit in int64"),
        ([3, True, 4], r"lengths\[1\] = True is a bool, not a token count; pass integer lengths"),
        (np.array([True, False]), r"lengths\[0\] = .*True.* is a bool"),
        (["12", "7"], r"lengths\[0\] = '12' is a str, not an integer token count; convert the lengths"),
        (np.array(["12", "7"]), r"lengths\[0\] = .*'12'.* is a string"),
        (np.array([5, None], dtype=object), r"lengths\[1\] = None is a NoneType, not an integer"),
        ([7, 0, 3], r"lengths\[1\] = 0 is not positive: every sample needs at least one token; remove empty"),
        (np.array([7, 8, -2]), r"lengths\[2\] = .*-2.* is not positive"),
        (np.ones((2, 3), dtype=np.int64), r"one-dimensional .* got shape \(2, 3\)"),
        ("1234", r"got the string '1234'"),
        (np.array([1 + 2j]), r"complex number"),
    ],
)
def test_bad_lengths_name_the_sample_value_and_fix(lengths, pattern):
    with pytest.raises(LengthsError, match=pattern):
        plan(lengths, Budget(100), "sorted")


def test_lengths_error_is_a_value_error():
    assert issubclass(LengthsError, ValueError)


def test_whole_floats_and_unsigned_integers_are_accepted():
    np.testing.assert_array_equal(as_length_array([3.0, 4.0]), [3, 4])
    np.testing.assert_array_equal(as_length_array(np.array([9, 1], dtype=np.uint16)), [9, 1])
    assert as_length_array((5, np.int32(6))).dtype == np.int64


def test_oversize_error_names_index_value_budget_and_the_options():
    lengths = np.array([10, 20, 300, 40, 999])
    with pytest.raises(LengthsError) as info:
        plan(lengths, Budget(256), "bucketed")
    message = str(info.value)
    assert "lengths[2] = 300 exceeds Budget.max_tokens=256" in message
    assert "2 sample(s) too long, the longest 999" in message
    assert "raise max_tokens to at least 999" in message and "oversize='truncate'" in message


def test_drop_of_every_sample_is_refused():
    with pytest.raises(LengthsError, match=r"oversize='drop' left no sample.*lengths\[0\] = 50"):
        prepare_lengths([50, 60], Budget(10), oversize="drop")


def test_oversize_policy_must_be_known():
    with pytest.raises(ValueError, match=r"oversize='clip' is not a policy; use one of \['error', 'truncate', 'drop'\]"):
        plan([1, 2], Budget(10), "sorted", oversize="clip")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"world_size": 0}, r"world_size=0 must be >= 1; it is the number of data-parallel ranks"),
        ({"world_size": 2.0}, r"world_size=2\.0 must be an integer >= 1"),
        ({"world_size": True}, r"world_size=True must be an integer >= 1"),
        ({"grad_accum": 0}, r"grad_accum=0 must be >= 1; it is the number of micro-batches per rank"),
        ({"seed": -1}, r"seed=-1 must be a non-negative integer"),
        ({"epoch": 1.5}, r"epoch=1\.5 must be a non-negative integer"),
    ],
)
def test_bad_run_shape_is_refused(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        plan([1, 2, 3], Budget(10), "shuffle", **kwargs)


@pytest.mark.parametrize(
    ("budget", "pattern"),
    [
        (0, r"max_tokens=0 is smaller than one token"),
        (Budget(8, max_samples=None), None),
        ({"max_tokens": 8, "max_samples": 2}, None),
        ({"max_tokens": 8, "rows": 2}, r"budget mapping with fields \['max_tokens', 'rows'\] is not a Budget"),
        ({"max_samples": 2}, r"budget mapping with fields \['max_samples'\] is not a Budget; give max_tokens"),
        (8.5, r"budget=8\.5 must be a Budget"),
    ],
)
def test_budget_forms(budget, pattern):
    if pattern is None:
        p = plan([1, 2, 3], budget, "sorted")
        assert p.exactly_once() and p.budget.max_tokens == 8
    else:
        with pytest.raises(ValueError, match=pattern):
            plan([1, 2, 3], budget, "sorted")


def test_budget_checks_its_own_fields():
    with pytest.raises(ValueError, match="smaller than one token"):
        Budget(0)
    with pytest.raises(ValueError, match=r"max_samples=0 must be a positive integer \(at most 2\*\*40\) or None"):
        Budget(10, max_samples=0)
    assert Budget(2**40).max_tokens == 2**40


@pytest.mark.parametrize("max_tokens", [2**40 + 1, 2**63, 2**70])
def test_budget_beyond_int64_safe_range_is_a_clear_error_not_an_overflow(max_tokens):
    # 2**70 used to reach the compiled kernels and die with OverflowError (a traceback in the CLI)
    with pytest.raises(ValueError, match=rf"Budget.max_tokens={max_tokens} is larger than 1099511627776"):
        plan([5, 6], max_tokens, "sorted")


def test_validation_runs_before_any_work():
    # the bad value sits at the very end of a large input; the error still names it exactly
    lengths = np.full(200_000, 64)
    lengths[-1] = 0
    with pytest.raises(LengthsError, match=r"lengths\[199999\] = 0 is not positive"):
        plan(lengths, Budget(4096), "packed")


def test_bad_strategy_options_are_refused():
    with pytest.raises(ValueError, match=r"num_buckets=0 must be >= 1"):
        plan([1, 2], Budget(8), "bucketed", num_buckets=0)
    with pytest.raises(ValueError, match=r"edges\[1\] = 3 is not greater than edges\[0\] = 5"):
        plan([1, 2], Budget(8), "bucketed", edges=[5, 3])
    with pytest.raises(ValueError, match=r"same_bucket_steps='yes' must be true or false"):
        plan([1, 2], Budget(8), "bucketed", same_bucket_steps="yes")
    known = re.escape(", ".join(available_strategies()))
    with pytest.raises(ValueError, match=rf"unknown strategy 'random'; known strategies: {known}$"):
        plan([1, 2], Budget(8), "random")


def test_best_fit_refuses_rows_too_large_for_its_index():
    with pytest.raises(ValueError, match=r"fit='best' supports max_tokens up to 4194304, got 5000000; use fit='first'"):
        plan([10, 20], Budget(5_000_000), "packed", fit="best")
    assert plan([10, 20], Budget(5_000_000), "packed", fit="first").exactly_once()
