"""plan_metrics' whole report on one hand-built two-rank plan: every key in order, with its value and type."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies import Budget, Plan
from strategies.metrics import length_mix_divergence, plan_metrics

A, B = 1.0, 8e-6  # CostModel() defaults; no sample reaches a 16-token drafter block


def two_rank_plan() -> Plan:
    """Step 0: rank 0 [3, 5], rank 1 [2, 2]; step 1: rank 0 [7], rank 1 empty; sample 5 dropped."""
    return Plan("hand", "padded", np.array([3, 5, 2, 2, 7, 1], dtype=np.int64), np.arange(5, dtype=np.int64),
                np.array([0, 2, 4, 5, 5], dtype=np.int64), Budget(100, 4), 0, 3, 2, 1,
                dropped=np.array([5], dtype=np.int64), truncated=np.array([4], dtype=np.int64))


def expected_report(plan: Plan) -> dict:
    step0 = [2 * 5 * A + 2 * 25 * B, 2 * 2 * A + 2 * 4 * B]  # rows * max_len slots, rows * max_len^2
    step1 = [7 * A + 49 * B, 0.0]
    imbalances = [max(step0) / (sum(step0) / 2), 2.0]
    step_cost = max(step0) + max(step1)
    ideal_cost = 19 * A + (9 + 25 + 4 + 4 + 49) * B
    kl, kl_random = length_mix_divergence(plan)
    return {
        "strategy": "hand",
        "layout": "padded",
        "epoch": 3,
        "world_size": 2,
        "grad_accum": 1,
        "max_tokens": 100,
        "samples": 6,
        "samples_planned": 5,
        "dropped": 1,
        "truncated": 1,
        "real_tokens": 19,
        "computed_slots": 21,
        "padding_efficiency": 19 / 21,
        "padding_ratio": 1 - 19 / 21,
        "micro_batches": 3,
        "empty_micro_batches": 1,
        "steps": 2,
        "max_micro_batch_slots": 10,
        "budget_violations": 0,
        "lag1_acf": -0.5,  # step means 3, 7
        "acf": [-0.5] + [math.nan] * 7,
        "recurrence": math.nan,
        "recurrence_pairs": 0,
        "step_recurrence": math.nan,
        "step_recurrence_pairs": 0,
        "length_mix_kl": kl,
        "length_mix_kl_random": kl_random,
        "length_mix_excess": kl - kl_random,
        "rank_imbalance": sum(imbalances) / 2,
        "rank_imbalance_max": 2.0,
        "target_imbalance": sum(imbalances) / 2,
        "drafter_imbalance": math.nan,
        "drafter_blocks": 0.0,
        "step_cost": step_cost,
        "ideal_cost": ideal_cost,
        "relative_step_cost": 2 * step_cost / ideal_cost,
        "samples_seen_once": True,
        "missing_samples": 0,
        "repeated_samples": 0,
        "step_tokens_target": None,
        "step_tokens_min": 12,
        "step_tokens_max": 12,
        "step_tokens_mean": 12.0,
        "step_tokens_cv": 0.0,
        "step_tokens_last": 7,
        "micro_batches_per_step_min": 2,
        "micro_batches_per_step_mean": 2.0,
        "micro_batches_per_step_max": 2,
        # 8 equal-count bins of 2, 2, 3, 5, 7: edges 2, 2.5, 3, 4, 5, 6, so 7 bins; step 1 ([7]) is in bin 6
        "longest_bucket_streak": 1,
        "longest_bucket_streak_bucket": 6,
        "single_bucket_steps": 1,
        "streak_buckets": 7,
    }


def assert_same_report(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        got = actual[key]
        assert type(got) is type(value), key
        if isinstance(value, float):
            assert (math.isnan(got) and math.isnan(value)) or got == pytest.approx(value, rel=1e-12), key
        elif isinstance(value, list):
            assert len(got) == len(value) and all(type(item) is float for item in got), key
            assert all((math.isnan(g) and math.isnan(v)) or g == v for g, v in zip(got, value)), key
        else:
            assert got == value, key


def test_plan_metrics_report_of_a_two_rank_plan():
    plan = two_rank_plan()
    assert_same_report(plan_metrics(plan), expected_report(plan))


def test_plan_metrics_report_with_the_next_epoch_plan():
    plan = two_rank_plan()
    expected = expected_report(plan)
    # the same plan again: micro-batches {0, 1}, {2, 3} give 2 pairs, step 0 {0, 1, 2, 3} gives 6
    expected.update(recurrence=1.0, recurrence_pairs=2, step_recurrence=1.0, step_recurrence_pairs=6)
    assert_same_report(plan_metrics(plan, next_epoch_plan=plan), expected)
