"""The rest of an epoch (``plan_remainder``): what an epoch has consumed is never repeated, the rest once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from strategies import Budget, CostModel, RankBalance, available_strategies, build_strategy, plan, plan_remainder

ALL = available_strategies()
BUDGET = Budget(2048)


def lengths(n: int = 400, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(200), 1.0, n)), 8, 2048).astype(np.int64)


def consumed_by_steps(p, steps: int) -> np.ndarray:
    """The samples of a plan's first ``steps`` steps (what a run stopped there has consumed)."""
    return p.sample_indices[: p.micro_batch_offsets[steps * p.micro_batches_per_step]]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize(("new_world", "new_accum"), [(1, 1), (3, 2), (4, 1)])
def test_rest_of_epoch_visits_every_unconsumed_sample_once_and_no_consumed_one(name, new_world, new_accum):
    data = lengths()
    balance = RankBalance(CostModel(a=1.0, b=1e-3)) if new_world * new_accum > 1 else None
    full = plan(data, BUDGET, strategy=name, seed=5, epoch=2, world_size=2, grad_accum=1)
    stopped_at = full.num_steps // 3
    assert 0 < stopped_at < full.num_steps
    consumed = consumed_by_steps(full, stopped_at)
    rest = plan_remainder(name, data, consumed, BUDGET, seed=5, epoch=2, world_size=new_world,
                          grad_accum=new_accum, balance=balance)
    assert rest.world_size == new_world and rest.grad_accum == new_accum and rest.epoch == 2
    assert rest.layout == build_strategy(name).layout and rest.strategy == name
    # indices are in the original sample space: the plan's lengths are the whole epoch's
    np.testing.assert_array_equal(rest.lengths, data)
    assert rest.sample_indices.min() >= 0 and rest.sample_indices.max() < data.size
    # counted directly, not only through the plan's own check
    visits = np.bincount(rest.sample_indices, minlength=data.size)
    assert visits[consumed].sum() == 0, "a consumed sample is planned again"
    unconsumed = np.setdiff1d(np.arange(data.size), consumed)
    assert (visits[unconsumed] == 1).all(), "an unconsumed sample is missing or repeated"
    whole_epoch = visits + np.bincount(consumed, minlength=data.size)
    assert (whole_epoch == 1).all()
    assert rest.exactly_once() and rest.exactly_once_violations() == (0, 0)
    np.testing.assert_array_equal(rest.consumed, np.sort(consumed))
    np.testing.assert_array_equal(rest.kept_indices(), np.arange(data.size))  # the epoch's, consumed included
    np.testing.assert_array_equal(rest.remaining_indices(), unconsumed)
    assert rest.budget_violations().size == 0
    assert rest.info["remainder"] == {"consumed": consumed.size, "remaining": unconsumed.size}
    # fewer steps than a whole epoch on the same shape
    assert rest.num_steps < plan(data, BUDGET, strategy=name, seed=5, epoch=2, world_size=new_world,
                                 grad_accum=new_accum).num_steps


@pytest.mark.parametrize("name", ALL)
def test_deterministic_and_its_randomness_comes_from_seed_and_epoch(name):
    data = lengths()
    consumed = consumed_by_steps(plan(data, BUDGET, strategy=name, seed=1, epoch=0, world_size=2), 5)
    np.random.seed(123)
    global_state = np.random.get_state()[1].copy()
    first = plan_remainder(name, data, consumed, BUDGET, seed=1, epoch=0, world_size=1)
    assert np.array_equal(np.random.get_state()[1], global_state), "the global numpy RNG was used"
    again = plan_remainder(name, data, consumed, BUDGET, seed=1, epoch=0, world_size=1)
    np.testing.assert_array_equal(first.sample_indices, again.sample_indices)
    np.testing.assert_array_equal(first.micro_batch_offsets, again.micro_batch_offsets)
    # a mask and an index set of the same samples are the same request
    mask = np.zeros(data.size, dtype=bool)
    mask[consumed] = True
    by_mask = plan_remainder(name, data, mask, BUDGET, seed=1, epoch=0, world_size=1)
    np.testing.assert_array_equal(first.sample_indices, by_mask.sample_indices)
    # another seed and another epoch change the order (sorted's composition is fixed, its order is not)
    for other in ({"seed": 2, "epoch": 0}, {"seed": 1, "epoch": 1}):
        moved = plan_remainder(name, data, consumed, BUDGET, world_size=1, **other)
        assert not np.array_equal(first.sample_indices, moved.sample_indices), other


@pytest.mark.parametrize("name", ALL)
def test_nothing_consumed_is_exactly_the_whole_epoch_plan(name):
    data = lengths()
    data[[3, 50]] = 5000  # over the budget: dropped from every epoch
    for world_size, grad_accum in [(1, 1), (2, 2)]:
        full = plan(data, BUDGET, strategy=name, seed=4, epoch=3, world_size=world_size, grad_accum=grad_accum,
                    oversize="drop")
        rest = plan_remainder(name, data, np.zeros(data.size, dtype=bool), BUDGET, seed=4, epoch=3,
                              world_size=world_size, grad_accum=grad_accum, oversize="drop")
        np.testing.assert_array_equal(rest.sample_indices, full.sample_indices)
        np.testing.assert_array_equal(rest.micro_batch_offsets, full.micro_batch_offsets)
        np.testing.assert_array_equal(rest.dropped, [3, 50])
        assert rest.consumed.size == 0 and rest.exactly_once()


@pytest.mark.parametrize("name", ALL)
def test_an_epoch_with_nothing_left_is_a_plan_of_zero_steps(name):
    data = lengths(50)
    rest = plan_remainder(name, data, np.ones(data.size, dtype=bool), BUDGET, seed=0, epoch=0, world_size=2)
    assert rest.num_steps == 0 and rest.sample_indices.size == 0 and list(rest.rank_steps(1)) == []
    assert rest.exactly_once() and rest.remaining_indices().size == 0
    assert rest.info["remainder"] == {"consumed": 50, "remaining": 0}


def test_packed_layout_rows_stay_within_capacity_and_truncation_is_kept():
    data = lengths()
    data[7] = 3000  # truncated to the budget
    full = plan(data, BUDGET, strategy="packed", seed=0, epoch=0, world_size=2, oversize="truncate")
    consumed = consumed_by_steps(full, 4)
    rest = plan_remainder("packed", data, consumed, BUDGET, seed=0, epoch=0, world_size=1, oversize="truncate",
                          fit="best")
    assert rest.layout == "packed" and rest.exactly_once()
    assert (rest.micro_batch_tokens() <= BUDGET.max_tokens).all()
    assert rest.lengths[7] == BUDGET.max_tokens and 7 in rest.truncated
    assert rest.info["options"] == {"fit": "best"}


def test_chained_resumes_keep_the_epoch_exactly_once():
    """2 ranks, then 1, then 3 inside one epoch: the three pieces visit every sample once."""
    data = lengths()
    first = plan(data, BUDGET, strategy="bucketed", seed=0, epoch=0, world_size=2)
    piece1 = consumed_by_steps(first, 3)
    second = plan_remainder("bucketed", data, piece1, BUDGET, seed=0, epoch=0, world_size=1)
    piece2 = consumed_by_steps(second, 4)
    third = plan_remainder("bucketed", data, np.concatenate([piece1, piece2]), BUDGET, seed=0, epoch=0,
                           world_size=3)
    visits = np.bincount(np.concatenate([piece1, piece2, third.sample_indices]), minlength=data.size)
    assert (visits == 1).all() and third.exactly_once()


def test_exactly_once_of_a_rest_of_epoch_plan_counts_a_consumed_sample_visited_again():
    data = lengths()
    consumed = consumed_by_steps(plan(data, BUDGET, strategy="shuffle", seed=0, epoch=0, world_size=2), 2)
    rest = plan_remainder("shuffle", data, consumed, BUDGET, seed=0, epoch=0, world_size=1)
    one_more = np.sort(np.append(consumed, rest.sample_indices[0]))  # claims a sample the plan visits
    assert dataclasses.replace(rest, consumed=one_more).exactly_once_violations() == (0, 1)
    one_less = np.sort(consumed)[1:]  # a consumed sample nobody visits any more
    assert dataclasses.replace(rest, consumed=one_less).exactly_once_violations() == (1, 0)


def test_bad_consumed_sets_are_refused_naming_the_problem():
    data = lengths(20)
    with pytest.raises(ValueError, match="shape"):
        plan_remainder("shuffle", data, np.zeros(19, dtype=bool), BUDGET)
    with pytest.raises(ValueError, match="index 20, outside"):
        plan_remainder("shuffle", data, np.array([1, 20]), BUDGET)
    with pytest.raises(ValueError, match="integer sample indices"):
        plan_remainder("shuffle", data, np.array([1.0, 2.0]), BUDGET)
    data[4] = 9000
    with pytest.raises(ValueError, match="sample 4, which oversize='drop' leaves out"):
        plan_remainder("shuffle", data, np.array([4]), BUDGET, oversize="drop")
    with pytest.raises(ValueError, match="options"):
        plan_remainder(build_strategy("packed"), data, [], BUDGET, fit="best")
