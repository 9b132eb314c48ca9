"""plan_metrics' argument defaults and checks, and its figures on a plan without samples, with an empty step, with drafter blocks under one per rank, and with a length beyond 2**53."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies import Budget, Plan
from strategies.cost import CostModel
from strategies.metrics import length_mix_divergence, plan_metrics


def hand_plan(sizes, lengths, world_size=1, dropped=()) -> Plan:
    """Samples 0, 1, ... in order, in micro-batches of ``sizes`` (step-major, no accumulation)."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Plan("hand", "padded", np.array(lengths, dtype=np.int64), np.arange(offsets[-1], dtype=np.int64),
                offsets, Budget(10_000), 0, 0, world_size, 1, dropped=np.array(dropped, dtype=np.int64))


def test_plan_metrics_defaults_to_8_acf_lags_and_16_mix_bins():
    # 272 = 16 * 17 distinct lengths, one per step: the length-mix KL is log(bins)
    plan = hand_plan([1] * 272, range(1, 273))
    metrics = plan_metrics(plan)
    assert len(metrics["acf"]) == 8
    assert math.isclose(metrics["length_mix_kl"], math.log(16))
    assert (metrics["length_mix_kl"], metrics["length_mix_kl_random"]) == length_mix_divergence(plan, 16)
    assert len(plan_metrics(plan, acf_lags=9)["acf"]) == 9


def test_plan_metrics_accepts_1_for_every_count():
    metrics = plan_metrics(hand_plan([2, 2], [3, 4, 5, 9]), acf_lags=1, mix_bins=1, streak_bins=1)
    assert len(metrics["acf"]) == 1
    assert (metrics["length_mix_kl"], metrics["length_mix_kl_random"]) == (0.0, 0.0)
    assert (metrics["streak_buckets"], metrics["longest_bucket_streak"], metrics["longest_bucket_streak_bucket"]) == (1, 2, 0)


@pytest.mark.parametrize("name", ["acf_lags", "mix_bins", "streak_bins"])
def test_plan_metrics_names_the_count_below_1(name):
    plan = hand_plan([2], [3, 4])
    with pytest.raises(ValueError, match=rf"^{name}=0 must be an integer >= 1$"):
        plan_metrics(plan, **{name: 0})
    with pytest.raises(ValueError, match=rf"^{name}=True must be an integer >= 1$"):
        plan_metrics(plan, **{name: True})


@pytest.mark.filterwarnings("error")
def test_plan_metrics_of_a_plan_without_samples():
    metrics = plan_metrics(hand_plan([0, 0], [5, 7], dropped=[0, 1]))
    for key in ("rank_imbalance", "rank_imbalance_max", "target_imbalance", "drafter_imbalance", "relative_step_cost"):
        assert type(metrics[key]) is float and math.isnan(metrics[key]), key
    assert (metrics["real_tokens"], metrics["computed_slots"], metrics["steps"]) == (0, 0, 2)
    assert (metrics["micro_batches"], metrics["empty_micro_batches"], metrics["max_micro_batch_slots"]) == (0, 2, 0)
    assert math.isnan(metrics["padding_efficiency"]) and math.isnan(metrics["padding_ratio"])
    assert math.isnan(metrics["rank_imbalance"]) and math.isnan(metrics["drafter_imbalance"])
    assert metrics["samples_seen_once"] is True


@pytest.mark.filterwarnings("error")
def test_rank_imbalance_leaves_out_a_step_without_work():
    metrics = plan_metrics(hand_plan([2, 0], [40, 50]))
    assert metrics["rank_imbalance"] == 1.0 and metrics["rank_imbalance_max"] == 1.0
    assert metrics["target_imbalance"] == 1.0 and metrics["drafter_imbalance"] == 1.0


def test_drafter_imbalance_counts_steps_with_under_one_block_per_rank():
    # block_size 16: a 16-token sample is one block, a 5-token sample none; ranks hold [1, 0] blocks
    metrics = plan_metrics(hand_plan([1, 1], [16, 5], world_size=2))
    assert metrics["drafter_blocks"] == 1.0
    assert metrics["drafter_imbalance"] == 2.0


def test_real_tokens_are_summed_exactly_past_2_to_the_53():
    metrics = plan_metrics(hand_plan([1], [2**53 + 1]))
    assert metrics["real_tokens"] == 2**53 + 1 and type(metrics["real_tokens"]) is int
    assert metrics["computed_slots"] == 2**53 + 1


def test_plan_metrics_without_the_next_epoch_has_nan_recurrence_and_no_pairs():
    metrics = plan_metrics(hand_plan([2, 2], [3, 4, 5, 9]))
    assert math.isnan(metrics["recurrence"]) and metrics["recurrence_pairs"] == 0
    assert math.isnan(metrics["step_recurrence"]) and metrics["step_recurrence_pairs"] == 0


def test_plan_metrics_passes_mix_bins_on():
    plan = hand_plan([2, 2], [3, 4, 5, 9])
    for bins in (2, 4):
        metrics = plan_metrics(plan, mix_bins=bins)
        assert (metrics["length_mix_kl"], metrics["length_mix_kl_random"]) == length_mix_divergence(plan, bins)
    assert math.isclose(plan_metrics(plan, mix_bins=2)["length_mix_kl"], math.log(2))


def test_relative_step_cost_with_an_ideal_cost_below_1():
    # one 1-token sample at half a unit per slot: step cost = ideal cost = 0.5
    metrics = plan_metrics(hand_plan([1], [1]), cost_model=CostModel(a=0.5, b=0.0, c=0.0))
    assert (metrics["step_cost"], metrics["ideal_cost"]) == (0.5, 0.5)
    assert metrics["relative_step_cost"] == 1.0


def test_samples_seen_once_needs_no_missing_and_no_repeated_sample():
    missing_one = plan_metrics(hand_plan([1, 1], [3, 4, 5]))
    assert (missing_one["samples_seen_once"], missing_one["missing_samples"], missing_one["repeated_samples"]) == (False, 1, 0)
    plan = hand_plan([2], [3, 4])
    repeated_one = plan_metrics(Plan("hand", "padded", plan.lengths, np.array([0, 1, 1], dtype=np.int64),
                                     np.array([0, 3], dtype=np.int64), Budget(10_000), 0, 0, 1, 1))
    assert (repeated_one["samples_seen_once"], repeated_one["missing_samples"], repeated_one["repeated_samples"]) == (False, 0, 1)


def test_single_bucket_steps_counts_steps_in_bucket_0():
    metrics = plan_metrics(hand_plan([1, 1, 2], [3, 9, 3, 9]), streak_bins=2)
    assert (metrics["single_bucket_steps"], metrics["longest_bucket_streak"], metrics["streak_buckets"]) == (2, 1, 2)
