"""Plan metrics (strategies.metrics) on hand-built plans whose answers are known."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.cost import CostModel
from strategies.metrics import (
    autocorrelation,
    composition_recurrence,
    length_mix_divergence,
    longest_bucket_streak,
    plan_metrics,
    step_buckets,
    step_recurrence,
)
from strategies.epoch_plan import Budget, Plan


def make_plan(
    lengths,
    micro_batches,
    world_size=1,
    grad_accum=1,
    layout="padded",
    max_tokens=10_000,
    max_samples=None,
    dropped=(),
    epoch=0,
) -> Plan:
    """A Plan from a list of micro-batches (lists of sample indices), in step-major order."""
    sizes = [len(mb) for mb in micro_batches]
    flat = [i for mb in micro_batches for i in mb]
    return Plan(
        strategy="hand",
        layout=layout,
        lengths=np.asarray(lengths, dtype=np.int64),
        sample_indices=np.asarray(flat, dtype=np.int64),
        micro_batch_offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        budget=Budget(max_tokens, max_samples),
        seed=0,
        epoch=epoch,
        world_size=world_size,
        grad_accum=grad_accum,
        dropped=np.asarray(dropped, dtype=np.int64),
    )


def test_padding_efficiency_of_known_padded_batches():
    # [3, 5] pads to 2 x 5 = 10 slots, [2, 2] to 4: 12 real tokens in 14 slots.
    metrics = plan_metrics(make_plan([3, 5, 2, 2], [[0, 1], [2, 3]]))
    assert metrics["real_tokens"] == 12
    assert metrics["computed_slots"] == 14
    assert metrics["padding_efficiency"] == pytest.approx(12 / 14, abs=1e-12)
    assert metrics["padding_ratio"] == pytest.approx(2 / 14, abs=1e-12)


def test_packed_rows_count_their_capacity():
    metrics = plan_metrics(make_plan([3, 5, 2, 2], [[0, 1], [2, 3]], layout="packed", max_tokens=10))
    assert metrics["computed_slots"] == 20
    assert metrics["padding_efficiency"] == pytest.approx(12 / 20, abs=1e-12)


def test_counts_of_micro_batches_steps_and_empty_slots():
    # world 2, grad_accum 2: 4 slots per step; 5 non-empty micro-batches fill 2 steps, 3 empty.
    plan = make_plan([1] * 5, [[0], [1], [2], [3], [4], [], [], []], world_size=2, grad_accum=2)
    metrics = plan_metrics(plan)
    assert (metrics["micro_batches"], metrics["empty_micro_batches"], metrics["steps"]) == (5, 3, 2)


def test_budget_violations_count_rows_and_slots():
    plan = make_plan([4, 4, 4, 9], [[0, 1, 2], [3]], max_tokens=8, max_samples=2)
    metrics = plan_metrics(plan)
    # [4, 4, 4]: 12 slots > 8 and 3 rows > 2 (one violation); [9]: 9 slots > 8.
    assert metrics["budget_violations"] == 2
    assert metrics["max_micro_batch_slots"] == 12
    # a packed row breaks the budget when its real tokens exceed the capacity
    packed = make_plan([4, 4, 4, 9], [[0, 1], [2, 3]], layout="packed", max_tokens=8)
    assert plan_metrics(packed)["budget_violations"] == 1


def test_alternating_step_lengths_have_negative_lag1_acf():
    steps = 20
    lengths = [10 if t % 2 == 0 else 100 for t in range(steps)]
    metrics = plan_metrics(make_plan(lengths, [[t] for t in range(steps)]), acf_lags=2)
    # For a +-1 alternating series of length T the estimator gives -(T-1)/T at lag 1, (T-2)/T at 2.
    assert metrics["lag1_acf"] == pytest.approx(-(steps - 1) / steps, abs=1e-12)
    assert metrics["acf"][1] == pytest.approx((steps - 2) / steps, abs=1e-12)


def test_acf_is_measured_per_optimizer_step_not_per_micro_batch():
    # Micro-batches alternate short/long, but each step (2 ranks) holds one of each: constant
    # step means, so the step-level ACF is undefined (NaN), not -1.
    lengths = [10, 100] * 6
    plan = make_plan(lengths, [[i] for i in range(12)], world_size=2)
    assert math.isnan(plan_metrics(plan)["lag1_acf"])
    # Grouping the same micro-batches one per step makes the series alternate again.
    assert plan_metrics(make_plan(lengths, [[i] for i in range(12)]))["lag1_acf"] < -0.5


def naive_acf(series, lag):
    x = np.asarray(series, dtype=float)
    mean = sum(x) / len(x)
    num = sum((x[t] - mean) * (x[t + lag] - mean) for t in range(len(x) - lag))
    den = sum((v - mean) ** 2 for v in x)
    return num / den


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=3, max_size=40), st.integers(1, 5))
def test_autocorrelation_matches_textbook_formula(series, lags):
    result = autocorrelation(np.array(series), lags)
    for lag in range(1, lags + 1):
        if len(set(series)) == 1 or lag >= len(series):
            assert math.isnan(result[lag - 1])
        else:
            assert result[lag - 1] == pytest.approx(naive_acf(series, lag), abs=1e-9)


def test_recurrence_identical_is_one_disjoint_is_zero_partial_is_fraction():
    lengths = [1] * 4
    first = make_plan(lengths, [[0, 1], [2, 3]])
    assert plan_metrics(first, next_epoch_plan=make_plan(lengths, [[3, 2], [1, 0]], epoch=1))["recurrence"] == 1.0
    assert plan_metrics(first, next_epoch_plan=make_plan(lengths, [[0, 2], [1, 3]], epoch=1))["recurrence"] == 0.0
    three = make_plan([1] * 3, [[0, 1, 2]])
    value, pairs = composition_recurrence(three, make_plan([1] * 3, [[0, 1], [2]]))
    assert pairs == 3
    assert value == pytest.approx(1 / 3, abs=1e-12)


def test_recurrence_without_next_plan_is_nan_and_size_mismatch_is_an_error():
    plan = make_plan([1, 1], [[0, 1]])
    assert math.isnan(plan_metrics(plan)["recurrence"])
    with pytest.raises(ValueError, match="has 2 samples.*has 3"):
        composition_recurrence(plan, make_plan([1, 1, 1], [[0, 1, 2]]))


def random_partition(draw, size):
    order = draw(st.permutations(range(size)))
    cuts = sorted(draw(st.sets(st.integers(1, max(size - 1, 1)), max_size=size)))
    bounds = [0] + [c for c in cuts if c < size] + [size]
    return [list(order[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_recurrence_matches_brute_force_pair_enumeration(data):
    size = data.draw(st.integers(2, 14))
    first_mbs = random_partition(data.draw, size)
    second_mbs = random_partition(data.draw, size)
    lengths = [1] * size
    owner_a = {i: m for m, mb in enumerate(first_mbs) for i in mb}
    owner_b = {i: m for m, mb in enumerate(second_mbs) for i in mb}
    together = [(i, j) for i, j in itertools.combinations(range(size), 2) if owner_a[i] == owner_a[j]]
    value, pairs = composition_recurrence(make_plan(lengths, first_mbs), make_plan(lengths, second_mbs))
    assert pairs == len(together)
    if together:
        again = sum(owner_b[i] == owner_b[j] for i, j in together)
        assert value == pytest.approx(again / len(together), abs=1e-12)
    else:
        assert math.isnan(value)


def test_step_recurrence_counts_pairs_sharing_a_step_not_a_micro_batch():
    lengths = [1] * 8
    # world 2: step 0 = micro-batches [0,1] and [2,3]; step 1 = [4,5] and [6,7]
    first = make_plan(lengths, [[0, 1], [2, 3], [4, 5], [6, 7]], world_size=2)
    # next epoch: same steps, partners swapped between the step's micro-batches
    second = make_plan(lengths, [[0, 2], [1, 3], [4, 6], [5, 7]], world_size=2, epoch=1)
    metrics = plan_metrics(first, next_epoch_plan=second)
    assert metrics["recurrence"] == 0.0
    assert metrics["step_recurrence"] == 1.0 and metrics["step_recurrence_pairs"] == 12
    # micro-batches kept but moved to other steps: every micro-batch pair recurs, 1/3 of step pairs
    moved = make_plan(lengths, [[0, 1], [4, 5], [2, 3], [6, 7]], world_size=2, epoch=1)
    assert composition_recurrence(first, moved)[0] == 1.0
    assert step_recurrence(first, moved) == (pytest.approx(4 / 12, abs=1e-12), 12)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_step_recurrence_matches_brute_force_pair_enumeration(data):
    size = data.draw(st.integers(2, 14))
    world_size = data.draw(st.integers(1, 3))
    plans, owners = [], []
    for epoch in range(2):
        mbs = random_partition(data.draw, size)
        mbs += [[]] * (-len(mbs) % world_size)
        plans.append(make_plan([1] * size, mbs, world_size=world_size, epoch=epoch))
        owners.append({i: m // world_size for m, mb in enumerate(mbs) for i in mb})
    together = [(i, j) for i, j in itertools.combinations(range(size), 2) if owners[0][i] == owners[0][j]]
    value, pairs = step_recurrence(*plans)
    assert pairs == len(together)
    if together:
        assert value == pytest.approx(sum(owners[1][i] == owners[1][j] for i, j in together) / len(together))
    else:
        assert math.isnan(value)


def test_length_mix_excess_separates_length_homogeneous_steps_from_random_ones():
    """Raw KL mostly measures samples per step; the excess over the random baseline does not."""
    from strategies import Budget as PlanBudget
    from strategies import plan as make_strategy_plan

    rng = np.random.default_rng(3)
    lengths = np.clip(np.round(rng.lognormal(np.log(600), 1.0, 20000)), 16, 8192).astype(np.int64)
    excess = {}
    for name in ("shuffle", "packed", "bucketed", "sorted"):
        metrics = plan_metrics(make_strategy_plan(lengths, PlanBudget(16384), name, world_size=8))
        assert metrics["length_mix_excess"] == pytest.approx(
            metrics["length_mix_kl"] - metrics["length_mix_kl_random"], abs=1e-12
        )
        excess[name] = metrics["length_mix_excess"]
    assert abs(excess["shuffle"]) < 0.02 and abs(excess["packed"]) < 0.02
    assert excess["bucketed"] > 0.5 and excess["sorted"] > 0.5


def test_length_mix_divergence_zero_for_representative_steps_log2_for_sorted_halves():
    lengths = list(range(1, 9))  # two quantile bins: 1..4 and 5..8
    mixed = make_plan(lengths, [[0, 4], [1, 5], [2, 6], [3, 7]])
    halves = make_plan(lengths, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert length_mix_divergence(mixed, mix_bins=2)[0] == pytest.approx(0.0, abs=1e-12)
    assert length_mix_divergence(halves, mix_bins=2)[0] == pytest.approx(math.log(2), abs=1e-12)
    assert plan_metrics(halves, mix_bins=2)["length_mix_kl"] == pytest.approx(math.log(2), abs=1e-12)


def test_rank_imbalance_and_relative_step_cost_with_linear_cost():
    # One step, 2 ranks: costs 4 and 2 (a=1, b=0) -> imbalance 4 / 3; the step waits 4 units for
    # 6 units of ideal work over 2 ranks (3 each) -> relative cost 4/3.
    plan = make_plan([4, 2], [[0], [1]], world_size=2)
    metrics = plan_metrics(plan, cost_model=CostModel(a=1.0, b=0.0))
    assert metrics["rank_imbalance"] == pytest.approx(4 / 3, abs=1e-12)
    assert metrics["rank_imbalance_max"] == pytest.approx(4 / 3, abs=1e-12)
    assert metrics["step_cost"] == pytest.approx(4.0, abs=1e-12)
    assert metrics["relative_step_cost"] == pytest.approx(4 / 3, abs=1e-12)


def test_rank_imbalance_sums_accumulation_micro_batches_and_uses_quadratic_term():
    # world 2, grad_accum 2; rank 0 = [3] + [3], rank 1 = [2, 2] + [] ; a=0, b=1:
    # rank 0: 9 + 9 = 18, rank 1 (padded rows*max^2): 2*4 = 8 -> max/mean = 18 / 13.
    plan = make_plan([3, 3, 2, 2], [[0], [1], [2, 3], []], world_size=2, grad_accum=2)
    metrics = plan_metrics(plan, cost_model=CostModel(a=0.0, b=1.0))
    assert metrics["rank_imbalance"] == pytest.approx(18 / 13, abs=1e-12)
    assert metrics["ideal_cost"] == pytest.approx(9 + 9 + 4 + 4, abs=1e-12)


def test_drafter_blocks_follow_the_anchor_rule():
    from strategies.cost import drafter_blocks

    # an anchor p needs p <= len - block_size: len - block_size + 1 anchors, at most num_anchors
    assert drafter_blocks(np.array([5, 16, 17, 600, 10_000]), 16, 512).tolist() == [0, 1, 2, 512, 512]
    model = CostModel(a=0.0, b=0.0, c=1.0, block_size=4, num_anchors=3)
    plan = make_plan([4, 5, 9, 2], [[0, 1], [2, 3]], world_size=2)
    np.testing.assert_array_equal(
        model.micro_batch_blocks(plan.lengths, plan.sample_indices, plan.micro_batch_offsets), [3.0, 3.0]
    )
    with pytest.raises(ValueError, match="block_size"):
        CostModel(block_size=0)
    with pytest.raises(ValueError, match="not all 0"):
        CostModel(a=0.0, b=0.0, c=0.0)


def test_drafter_imbalance_is_reported_beside_the_target_imbalance():
    # world 2: rank 0 holds one 40-token sample (25 blocks of 16), rank 1 four 10-token samples
    # (0 blocks) in one padded micro-batch of 4 x 10: target slots 40 vs 40, blocks 25 vs 0
    plan = make_plan([40, 10, 10, 10, 10], [[0], [1, 2, 3, 4]], world_size=2)
    metrics = plan_metrics(plan, cost_model=CostModel(a=1.0, b=0.0, c=1.0))
    assert metrics["target_imbalance"] == pytest.approx(1.0, abs=1e-12)
    assert metrics["drafter_imbalance"] == pytest.approx(2.0, abs=1e-12)
    assert metrics["drafter_blocks"] == 25
    assert metrics["rank_imbalance"] == pytest.approx(65 / 52.5, abs=1e-12)  # (40 + 25) / mean(65, 40)
    assert metrics["ideal_cost"] == pytest.approx(80 + 25, abs=1e-12)


def test_packed_plans_balance_target_slots_but_not_drafter_blocks():
    from strategies import Budget as PlanBudget
    from strategies import RankBalance
    from strategies import plan as make_strategy_plan

    rng = np.random.default_rng(4)
    lengths = np.clip(np.round(rng.lognormal(np.log(600), 1.0, 60000)), 16, 8192).astype(np.int64)
    packed = plan_metrics(make_strategy_plan(lengths, PlanBudget(16384), "packed", world_size=8))
    assert packed["target_imbalance"] < 1.03 and packed["drafter_imbalance"] > 1.25
    # balancing on the full cost model (with the blocks term) evens the drafter out far more than
    # balancing on the target's terms alone
    kwargs = dict(world_size=8, grad_accum=2)
    with_blocks = plan_metrics(make_strategy_plan(lengths, PlanBudget(16384), "packed", balance=RankBalance(), **kwargs))
    target_only = plan_metrics(
        make_strategy_plan(lengths, PlanBudget(16384), "packed", balance={"a": 1.0, "b": 8e-6, "c": 0.0}, **kwargs)
    )
    assert with_blocks["drafter_imbalance"] < target_only["drafter_imbalance"] - 0.05
    assert with_blocks["rank_imbalance"] < target_only["rank_imbalance"]


def test_quadratic_cost_of_long_packed_samples_does_not_overflow():
    # two 2**32-token documents in one packed row: b * sum(len^2) = 2 * 2**64 = 2**65, which used
    # to wrap around in int64 (to 0) before reaching the float cost
    plan = make_plan([2**32, 2**32], [[0, 1]], layout="packed", max_tokens=2**33)
    metrics = plan_metrics(plan, cost_model=CostModel(a=0.0, b=1.0))
    assert metrics["step_cost"] == 2.0**65
    assert metrics["relative_step_cost"] == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(("a", "b"), [(float("nan"), 1e-6), (1.0, float("inf")), ("1", 0.0), (True, 0.0)])
def test_cost_model_refuses_non_finite_or_non_numeric_coefficients(a, b):
    with pytest.raises(ValueError, match=r"CostModel\.[ab]=.* must be"):
        CostModel(a=a, b=b)


def test_samples_seen_once_with_duplicates_missing_and_dropped():
    assert plan_metrics(make_plan([1, 1, 1], [[0, 1], [2]]))["samples_seen_once"] is True
    duplicated = plan_metrics(make_plan([1, 1, 1], [[0, 1], [1]]))
    assert (duplicated["samples_seen_once"], duplicated["missing_samples"], duplicated["repeated_samples"]) == (False, 1, 1)
    dropped_ok = plan_metrics(make_plan([1, 1, 9], [[0, 1]], dropped=[2]))
    assert dropped_ok["samples_seen_once"] is True and dropped_ok["dropped"] == 1
    dropped_but_present = plan_metrics(make_plan([1, 1, 9], [[0, 1], [2]], dropped=[2]))
    assert dropped_but_present["samples_seen_once"] is False
    out_of_range = make_plan([1, 1], [[0, 1], [2]])
    assert out_of_range.exactly_once() is False and out_of_range.exactly_once_violations() == (0, 1)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_bounds_hold_on_random_plans(data):
    size = data.draw(st.integers(2, 30))
    lengths = data.draw(st.lists(st.integers(1, 64), min_size=size, max_size=size))
    world_size = data.draw(st.integers(1, 3))
    micro_batches = random_partition(data.draw, size)
    micro_batches += [[]] * (-len(micro_batches) % world_size)
    layout = data.draw(st.sampled_from(["padded", "packed"]))
    metrics = plan_metrics(make_plan(lengths, micro_batches, world_size=world_size, layout=layout, max_tokens=64 * size))
    assert 0.0 < metrics["padding_efficiency"] <= 1.0 + 1e-12
    assert metrics["relative_step_cost"] >= 1.0 - 1e-9
    assert metrics["rank_imbalance"] >= 1.0 - 1e-12
    assert metrics["length_mix_kl"] >= -1e-12
    assert metrics["samples_seen_once"] is True


@pytest.mark.parametrize("option", [{"acf_lags": 0}, {"mix_bins": 0}, {"acf_lags": 1.5}, {"streak_bins": 0}])
def test_bad_metric_options_are_rejected(option):
    with pytest.raises(ValueError, match=next(iter(option))):
        plan_metrics(make_plan([1], [[0]]), **option)


def test_longest_bucket_streak_uses_the_plans_own_bucket_edges():
    # steps (one micro-batch each) from buckets A, A, A, B, A under edges [10, 100]
    plan = dataclasses.replace(make_plan([5, 6, 7, 50, 8], [[0], [1], [2], [3], [4]]), info={"edges": [10, 100]})
    metrics = plan_metrics(plan)
    assert (metrics["longest_bucket_streak"], metrics["longest_bucket_streak_bucket"]) == (3, 0)
    assert (metrics["single_bucket_steps"], metrics["streak_buckets"]) == (5, 2)
    assert longest_bucket_streak(plan) == (3, 0)
    # without edges the lengths fall in equal-count bins: 2 bins split them 5, 6 | 7, 50, 8
    assert longest_bucket_streak(dataclasses.replace(plan, info={}), streak_bins=2) == (3, 1)


def test_longest_bucket_streak_of_equal_count_bins_and_its_conventions():
    lengths = list(range(1, 11))  # 2 equal-count bins: 1..5 and 6..10
    # A, A, A, B, A, mixed, B: the mixed step breaks nothing longer; the first longest run wins
    steps = [[0], [1], [2], [5], [3], [4, 9], [6, 7, 8]]
    assert longest_bucket_streak(make_plan(lengths, steps), streak_bins=2) == (3, 0)
    assert step_buckets(make_plan(lengths, steps), streak_bins=2)[0].tolist() == [0, 0, 0, 1, 0, -1, 1]
    # no single-bucket step: 0; single-bucket steps that never repeat a bucket back to back: 1
    assert longest_bucket_streak(make_plan(lengths, [[0, 5], [1, 6], [2, 7]]), streak_bins=2) == (0, -1)
    assert longest_bucket_streak(make_plan(lengths, [[0], [5], [1], [6]]), streak_bins=2) == (1, 0)
    # an empty step (2 ranks, both slots empty) ends a streak
    two_ranks = make_plan(lengths, [[0], [1], [], [], [2], [3]], world_size=2)
    assert longest_bucket_streak(two_ranks, streak_bins=2) == (1, 0)
    assert plan_metrics(make_plan(lengths, steps), streak_bins=2)["longest_bucket_streak"] == 3


def test_bucket_streaks_of_real_plans():
    from strategies import Budget as PlanBudget
    from strategies import plan as make_strategy_plan

    rng = np.random.default_rng(5)
    lengths = np.clip(np.round(rng.lognormal(np.log(600), 1.0, 20000)), 16, 8192).astype(np.int64)
    bucketed_plan = make_strategy_plan(lengths, PlanBudget(16384), "bucketed", world_size=8, num_buckets=8)
    bucketed = plan_metrics(bucketed_plan)
    shuffled = plan_metrics(make_strategy_plan(lengths, PlanBudget(16384), "shuffle", world_size=8))
    # whole steps of one bucket (same_bucket_steps) come back to back by chance
    assert bucketed["single_bucket_steps"] > 0.5 * bucketed["steps"] and bucketed["longest_bucket_streak"] >= 2
    assert bucketed["streak_buckets"] == len(bucketed_plan.info["edges"]) and shuffled["streak_buckets"] == 8
    assert shuffled["longest_bucket_streak"] == 0 and shuffled["single_bucket_steps"] == 0


def test_step_token_spread_leaves_out_the_last_step():
    # 2 ranks; steps of 10, 12 and 8 real tokens, then a last step of 3
    plan = make_plan([4, 6, 12, 5, 3, 3], [[0], [1], [2], [], [3, 4], [], [5], []], world_size=2)
    metrics = plan_metrics(plan)
    assert (metrics["step_tokens_min"], metrics["step_tokens_max"], metrics["step_tokens_last"]) == (8, 12, 3)
    assert metrics["step_tokens_mean"] == pytest.approx(10.0)
    assert metrics["step_tokens_cv"] == pytest.approx(math.sqrt(8 / 3) / 10)
    assert (metrics["micro_batches_per_step_min"], metrics["micro_batches_per_step_max"]) == (1, 2)
    assert metrics["micro_batches_per_step_mean"] == pytest.approx(4 / 3)
    assert metrics["step_tokens_target"] is None
    one_step = plan_metrics(make_plan([4, 6], [[0, 1]]))
    assert one_step["step_tokens_min"] == one_step["step_tokens_last"] == 10 and one_step["step_tokens_cv"] == 0.0


def test_equal_token_plans_report_their_target_and_a_narrow_spread():
    from strategies import Budget as PlanBudget
    from strategies import plan as make_strategy_plan

    rng = np.random.default_rng(6)
    lengths = np.clip(np.round(rng.lognormal(np.log(600), 1.0, 20000)), 16, 8192).astype(np.int64)
    fixed = plan_metrics(make_strategy_plan(lengths, PlanBudget(16384), "shuffle", world_size=8))
    equal = plan_metrics(make_strategy_plan(lengths, PlanBudget(16384), "shuffle", world_size=8, step_tokens=131072))
    assert equal["step_tokens_target"] == 131072
    assert abs(equal["step_tokens_mean"] - 131072) <= 16384 / 2
    assert equal["step_tokens_cv"] < fixed["step_tokens_cv"]
    assert equal["micro_batches_per_step_max"] > equal["micro_batches_per_step_min"] > 8
    assert fixed["micro_batches_per_step_min"] == fixed["micro_batches_per_step_max"] == 8
