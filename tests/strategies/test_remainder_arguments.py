"""plan_remainder's arguments: its defaults, balance and step_tokens passed through and checked, the info it records, and consumed's errors."""

from __future__ import annotations

import numpy as np
import pytest

from strategies import CostModel, RankBalance, plan, plan_remainder
from strategies.remainder import consumed_mask

LENGTHS = np.array([50, 60, 70, 80, 90, 100, 110, 120, 30, 40, 200, 10], dtype=np.int64)
BALANCE = RankBalance(CostModel(a=1.0, b=1e-3))


def test_the_defaults_are_seed_0_epoch_0_and_one_rank():
    rest = plan_remainder("shuffle", LENGTHS, [], 256)
    assert (rest.seed, rest.epoch, rest.world_size, rest.grad_accum) == (0, 0, 1, 1)
    whole = plan(LENGTHS, 256, strategy="shuffle")
    np.testing.assert_array_equal(rest.sample_indices, whole.sample_indices)
    np.testing.assert_array_equal(rest.micro_batch_offsets, whole.micro_batch_offsets)
    # the defaults matter: another seed or epoch shuffles otherwise, another world size steps otherwise
    for other in ({"seed": 1}, {"epoch": 1}):
        assert not np.array_equal(plan(LENGTHS, 256, strategy="shuffle", **other).sample_indices, rest.sample_indices)
    assert plan(LENGTHS, 256, strategy="shuffle", world_size=2).num_steps != rest.num_steps


def test_an_emptied_epoch_records_the_defaults_too():
    rest = plan_remainder("shuffle", LENGTHS, np.arange(LENGTHS.size), 256)
    assert (rest.seed, rest.epoch, rest.world_size, rest.grad_accum, rest.num_steps) == (0, 0, 1, 1, 0)


def test_the_plan_records_the_seed_it_was_given():
    rest = plan_remainder("shuffle", LENGTHS, [0, 3], 256, seed=3, epoch=1)
    assert rest.seed == 3 and rest.epoch == 1
    emptied = plan_remainder("shuffle", LENGTHS, np.arange(LENGTHS.size), 256, seed=3, epoch=1)
    assert emptied.seed == 3 and emptied.epoch == 1


@pytest.mark.parametrize("name", ["shuffle", "sorted", "bucketed"])
@pytest.mark.parametrize("balance", [BALANCE, {"a": 1.0, "b": 1e-3}])
def test_balance_reaches_the_plan_of_the_rest(name, balance):
    kwargs = {"seed": 3, "epoch": 1, "world_size": 2, "grad_accum": 2}
    balanced = plan(LENGTHS, 256, strategy=name, balance=BALANCE, **kwargs)
    unbalanced = plan(LENGTHS, 256, strategy=name, **kwargs)
    assert not np.array_equal(balanced.sample_indices, unbalanced.sample_indices)
    rest = plan_remainder(name, LENGTHS, [], 256, balance=balance, **kwargs)
    np.testing.assert_array_equal(rest.sample_indices, balanced.sample_indices)
    np.testing.assert_array_equal(rest.micro_batch_offsets, balanced.micro_batch_offsets)
    assert rest.info["balance"] == balanced.info["balance"]


def test_a_bad_balance_is_refused_even_when_nothing_is_left():
    with pytest.raises(ValueError, match=r"^balance has unknown field\(s\) \['bogus'\]"):
        plan_remainder("sorted", LENGTHS, np.arange(LENGTHS.size), 256, balance={"bogus": 1})


def test_step_tokens_with_balance_windows_is_refused_even_when_nothing_is_left():
    with pytest.raises(ValueError, match=r"^balance window_steps=2 regroups micro-batches between steps"):
        plan_remainder("sorted", LENGTHS, np.arange(LENGTHS.size), 256, step_tokens=500,
                       balance=RankBalance(window_steps=2))
    with pytest.raises(ValueError, match=r"^balance window_steps=2 regroups micro-batches between steps"):
        plan_remainder("sorted", LENGTHS, [0], 256, step_tokens=500, balance={"window_steps": 2})


def test_an_emptied_epoch_gives_int64_offsets_and_the_info_of_a_plan():
    rest = plan_remainder("bucketed", LENGTHS, np.ones(LENGTHS.size, dtype=bool), 256, oversize="truncate")
    assert rest.micro_batch_offsets.dtype == np.int64 and rest.sample_indices.dtype == np.int64
    np.testing.assert_array_equal(rest.micro_batch_offsets, [0])
    assert rest.info == {
        "oversize": "truncate",
        "options": plan(LENGTHS, 256, strategy="bucketed").info["options"],
        "remainder": {"consumed": 12, "remaining": 0},
    }


def test_the_rest_records_the_callers_oversize_policy_not_the_sub_plans():
    rest = plan_remainder("sorted", LENGTHS, [0, 1], 150, oversize="drop")
    whole = plan(LENGTHS, 150, strategy="sorted", oversize="drop")
    assert rest.info["oversize"] == "drop"
    assert rest.info == {**whole.info, "remainder": {"consumed": 2, "remaining": 9}}
    np.testing.assert_array_equal(rest.dropped, [10])


def test_a_boolean_mask_of_the_wrong_shape_is_refused():
    message = (
        r"^consumed is a boolean mask of shape \(3,\), but there are 12 samples; "
        r"give one flag per sample \(or an array of consumed sample indices\)$"
    )
    with pytest.raises(ValueError, match=message):
        plan_remainder("sorted", LENGTHS, np.zeros(3, dtype=bool), 256)
    with pytest.raises(ValueError, match=message.replace("12 samples", "4 samples")):
        consumed_mask(np.zeros(3, dtype=bool), 4)


@pytest.mark.parametrize(("consumed", "shown"), [([0, 12], 12), ([-1], -1), (np.array([5, 40], dtype=np.uint8), 40)])
def test_a_consumed_index_outside_the_samples_is_refused(consumed, shown):
    with pytest.raises(
        ValueError,
        match=rf"^consumed holds sample index {shown}, outside \[0, 12\); consumed indices refer to positions in lengths$",
    ):
        plan_remainder("sorted", LENGTHS, consumed, 256)


@pytest.mark.parametrize(
    ("consumed", "dtype", "shape"), [([0.0, 1.0], "float64", r"\(2,\)"), ([[0, 1]], "int64", r"\(1, 2\)")]
)
def test_consumed_that_is_neither_a_mask_nor_integer_indices_is_refused(consumed, dtype, shape):
    with pytest.raises(
        ValueError,
        match=rf"^consumed must be a boolean mask over the samples or a 1-D array of integer sample indices, "
        rf"got dtype {dtype} and shape {shape}$",
    ):
        consumed_mask(consumed, 12)


def test_consumed_indices_of_any_integer_dtype_give_the_mask():
    for dtype in (np.int8, np.uint16, np.int64, np.uint64):
        mask = consumed_mask(np.array([1, 3], dtype=dtype), 5)
        assert mask.dtype == bool
        np.testing.assert_array_equal(mask, [False, True, False, True, False])
    np.testing.assert_array_equal(consumed_mask([], 3), [False, False, False])
