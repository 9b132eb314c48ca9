"""balance_slots placements pinned exactly (in-step LPT, ties, empty slots, window regrouping and its keep rule) and RankBalance's cost_model mapping."""

from __future__ import annotations

import numpy as np
import pytest

from strategies import CostModel, RankBalance
from strategies.balance import balance_slots


def balanced(table, costs, world_size, grad_accum, window_steps=1, seed=0, num_full_steps=None):
    table = np.array(table, dtype=np.int64)
    full = table.shape[0] if num_full_steps is None else num_full_steps
    rng = np.random.default_rng(seed)
    out = balance_slots(table, np.array(costs, dtype=float), world_size, grad_accum,
                        RankBalance(window_steps=window_steps), rng, full)
    assert out.dtype == np.int64 and out.shape == table.shape
    # the same ids in every step, only placed otherwise (window regrouping moves them between steps)
    assert sorted(out.ravel().tolist()) == sorted(table.ravel().tolist())
    return out.tolist()


def test_lpt_gives_each_next_costliest_micro_batch_to_the_least_loaded_rank_with_a_free_slot():
    # costs 1, 2, 3, 4 on 2 ranks x 2 slots: 4 -> rank 0, 3 -> rank 1, 2 -> rank 1 (3 < 4), 1 -> rank 0 (rank 1 full)
    assert balanced([[0, 1, 2, 3]], [1, 2, 3, 4], world_size=2, grad_accum=2) == [[3, 0, 2, 1]]
    # ranks of 3 slots: 5 -> r0, 4 -> r1, 3 -> r1, 2 -> r0, 1 -> r0 (7 = 7: the first rank), the empty slot -> r1
    assert balanced([[0, 1, 2, 3, 4, -1]], [1, 2, 3, 4, 5], world_size=2, grad_accum=3) == [[4, 1, 0, 3, 2, -1]]


def test_one_rank_holds_its_micro_batches_costliest_first_and_the_empty_slot_last():
    assert balanced([[1, 0, -1]], [1.5, 2.9], world_size=1, grad_accum=3) == [[1, 0, -1]]
    assert balanced([[0, -1, 1]], [1.5, 2.9], world_size=1, grad_accum=3) == [[1, 0, -1]]


def test_equal_costs_keep_their_order():
    assert balanced([[0, 1, 2, 3]], [1, 1, 3, 2], world_size=1, grad_accum=4) == [[2, 3, 0, 1]]
    assert balanced([[0, 1, 2, 3]], [2, 2, 2, 2], world_size=2, grad_accum=2) == [[0, 2, 1, 3]]
    ties = list(range(24))
    assert balanced([ties], [1.0] * 24, world_size=1, grad_accum=24) == [ties]
    assert balanced([[-1, -1, -1, 0], [-1, -1, 2, 1]], [2, 2, 2], world_size=2, grad_accum=2,
                    window_steps=2, num_full_steps=0) == [[0, -1, -1, -1], [2, -1, 1, -1]]


def test_an_empty_slot_costs_nothing():
    # a lone micro-batch stays on rank 0: the empty slot of rank 1 is cheaper
    assert balanced([[0, -1]], [0.5], world_size=2, grad_accum=1) == [[0, -1]]
    assert balanced([[-1, 0]], [0.5], world_size=2, grad_accum=1) == [[0, -1]]
    assert balanced([[0, -1, -1, 1]], [0.5, 0.25], world_size=2, grad_accum=2) == [[0, -1, 1, -1]]


def test_lpts_placement_is_taken_when_it_is_no_worse_than_the_given_one():
    # every placement of 1, 1, 1, 1 on 2 x 2 is as good: LPT's is taken
    assert balanced([[3, 1, 2, 0]], [1, 1, 1, 1], world_size=2, grad_accum=2) == [[3, 2, 1, 0]]


def test_a_given_placement_better_than_lpts_is_kept():
    # ranks of (9, 5, 5) and (6, 7, 6) cost 19 each; LPT would reach 20 (9 + 6 + 5)
    assert balanced([[2, 0, 5, 1, 3, 4]], [5, 6, 9, 7, 6, 5], world_size=2, grad_accum=3) == [[2, 0, 5, 1, 3, 4]]


@pytest.mark.parametrize(("window_steps", "num_full_steps"), [(1, 2), (4, 1), (2, 0), (3, 1)])
def test_balancing_without_a_window_of_two_full_steps_draws_nothing_from_the_generator(window_steps, num_full_steps):
    rng = np.random.default_rng(5)
    table = np.array([[0, 1], [2, 3]], dtype=np.int64)
    balance_slots(table, np.array([1.0, 3.0, 1.0, 2.0]), 2, 1, RankBalance(window_steps=window_steps), rng,
                  num_full_steps)
    assert rng.random() == np.random.default_rng(5).random()


def test_a_window_of_two_full_steps_regroups_similar_costs_into_one_step():
    # steps (1, 3) and (1, 2) cost 3 + 2; regrouped (3, 2) and (1, 1) cost 3 + 1
    assert balanced([[0, 1], [2, 3]], [1, 3, 1, 2], world_size=2, grad_accum=1, window_steps=2, seed=171) == [
        [1, 3], [0, 2]
    ]
    assert balanced([[0, 1], [2, 3]], [5, 1, 1, 4], world_size=2, grad_accum=1, window_steps=2, seed=36) == [
        [0, 3], [1, 2]
    ]
    assert balanced([[0, 1], [2, 3]], [1, 2, 1, 2], world_size=2, grad_accum=1, window_steps=2, seed=23) == [
        [0, 2], [1, 3]
    ]
    # a window of steps 3 allows 2 full steps (the last window is shorter)
    assert balanced([[0, 1], [2, 3]], [2, 6.9, 8.4, 6], world_size=2, grad_accum=1, window_steps=3, seed=298) == [
        [2, 1], [3, 0]
    ]


def test_a_window_with_equal_costs_is_dealt_in_their_order():
    assert balanced([[0, 1, 2], [3, 4, 5]], [2, 3, 2, 2, 2, 3], world_size=3, grad_accum=1, window_steps=3,
                    seed=980) == [[2, 3, 4], [1, 5, 0]]


@pytest.mark.parametrize(("costs", "seed"), [([4, 1], 17), ([2, 4], 30), ([2, 1], 342)])
def test_a_window_whose_regrouping_lowers_nothing_is_kept_as_given(costs, seed):
    assert balanced([[0], [1]], costs, world_size=1, grad_accum=1, window_steps=3, seed=seed) == [[0], [1]]


@pytest.mark.parametrize(("costs", "seed"), [([3, 3, 1, 4], 26), ([4, 3, 1, 2], 17), ([4, 2, 3, 5], 43)])
def test_each_window_is_judged_on_its_own_steps(costs, seed):
    # one rank: a step costs its one micro-batch whatever the grouping, so no window gains and none changes
    assert balanced([[0], [1], [2], [3]], costs, world_size=1, grad_accum=1, window_steps=2, seed=seed) == [
        [0], [1], [2], [3]
    ]


def test_windows_of_steps_with_several_slots_per_rank():
    table = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert balanced(table, [5, 4, 2, 5, 3, 4, 3, 3, 3, 4, 1, 4], world_size=2, grad_accum=3, window_steps=2,
                    seed=44) == [[0, 1, 4, 3, 5, 2], [6, 7, 8, 9, 10, 11]]
    table = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, -1, -1, -1, -1]]
    assert balanced(table, [4, 2, 2, 4, 3, 5, 2, 2, 3, 5, 1, 1, 5, 1], world_size=2, grad_accum=3, window_steps=3,
                    seed=27, num_full_steps=2) == [[5, 4, 1, 0, 3, 2], [6, 7, 8, 9, 10, 11], [12, -1, -1, 13, -1, -1]]
    table = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert balanced(table, [5, 1, 5, 5, 4, 1, 2, 4], world_size=2, grad_accum=2, window_steps=2, seed=28) == [
        [0, 3, 2, 4], [7, 5, 6, 1]
    ]
    assert balanced(table, [5, 3, 3, 4, 3, 4, 1, 3], world_size=2, grad_accum=2, window_steps=2, seed=47) == [
        [0, 2, 3, 1], [5, 6, 4, 7]
    ]
    assert balanced(table, [3.5, 4.8, 8.0, 1.8, 5.8, 7.7, 2.2, 7.1], world_size=2, grad_accum=2, window_steps=4,
                    seed=860) == [[2, 4, 5, 7], [1, 3, 0, 6]]


def test_a_cost_model_mapping_becomes_a_cost_model():
    assert RankBalance(cost_model={"a": 1.0, "b": 1e-3}).cost_model == CostModel(a=1.0, b=1e-3)
    assert RankBalance(cost_model={}).cost_model == CostModel()


def test_a_cost_model_mapping_with_unknown_fields_is_refused_naming_them_and_the_fields():
    with pytest.raises(
        ValueError,
        match=r"^cost_model has unknown field\(s\) \['bogus', 'd'\]; CostModel takes a, b, c, block_size, num_anchors$",
    ):
        RankBalance(cost_model={"a": 1.0, "d": 2.0, "bogus": 3})
    with pytest.raises(ValueError, match=r"^cost_model has unknown field\(s\) \['window_steps'\]"):
        RankBalance.coerce({"cost_model": {"window_steps": 2}})
