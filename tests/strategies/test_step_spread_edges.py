"""step_spread on edge plans: no steps, steps without tokens, a one-token body, and a two-step plan whose body is its first step only."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies import Budget, Plan
from strategies.metrics import step_spread


def one_rank_plan(sizes, lengths) -> Plan:
    """A plan on one rank without accumulation: one micro-batch per step, samples 0, 1, ... in order."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Plan("sorted", "padded", np.array(lengths, dtype=np.int64), np.arange(offsets[-1], dtype=np.int64),
                offsets, Budget(100), 0, 0, 1, 1)


@pytest.mark.filterwarnings("error")
def test_step_spread_of_a_plan_without_steps_is_zeros_and_nans_without_warnings():
    spread = step_spread(one_rank_plan([], [4]))
    nan_keys = ("step_tokens_mean", "step_tokens_cv", "micro_batches_per_step_mean")
    assert {key: value for key, value in spread.items() if key not in nan_keys} == {
        "step_tokens_target": None,
        "step_tokens_min": 0,
        "step_tokens_max": 0,
        "step_tokens_last": 0,
        "micro_batches_per_step_min": 0,
        "micro_batches_per_step_max": 0,
    }
    for key in nan_keys:
        assert type(spread[key]) is float and math.isnan(spread[key])


@pytest.mark.filterwarnings("error")
def test_step_spread_cv_is_nan_without_warnings_when_the_body_has_no_tokens():
    spread = step_spread(one_rank_plan([1, 1, 1], [0, 0, 5]))
    assert (spread["step_tokens_min"], spread["step_tokens_max"], spread["step_tokens_mean"]) == (0, 0, 0.0)
    assert type(spread["step_tokens_cv"]) is float and math.isnan(spread["step_tokens_cv"])
    assert spread["step_tokens_last"] == 5


def test_step_spread_cv_of_a_body_holding_one_token_is_zero():
    spread = step_spread(one_rank_plan([1, 1], [1, 9]))
    assert spread["step_tokens_cv"] == 0.0
    assert (spread["step_tokens_min"], spread["step_tokens_max"], spread["step_tokens_mean"]) == (1, 1, 1.0)
    assert type(spread["step_tokens_mean"]) is float


def test_step_spread_body_of_two_steps_is_the_first_step_only():
    spread = step_spread(one_rank_plan([2, 1], [3, 4, 20]))
    assert (spread["step_tokens_min"], spread["step_tokens_max"], spread["step_tokens_mean"]) == (7, 7, 7.0)
    assert spread["step_tokens_cv"] == 0.0 and spread["step_tokens_last"] == 20
    assert (spread["micro_batches_per_step_min"], spread["micro_batches_per_step_mean"],
            spread["micro_batches_per_step_max"]) == (1, 1.0, 1)
    # a one-step plan uses its one step
    spread = step_spread(one_rank_plan([2], [3, 4]))
    assert (spread["step_tokens_min"], spread["step_tokens_max"], spread["step_tokens_last"]) == (7, 7, 7)
