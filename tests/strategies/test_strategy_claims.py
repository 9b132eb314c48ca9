"""Tests generated from each registered strategy's own claim (``Strategy.epoch_composition``), so a new strategy is
covered without writing a test: across epochs its micro-batches' composition changes, stays fixed, or recurs within
its ``max_recurrence``, as it says; their order changes in every strategy; an epoch's plan repeats exactly."""

from __future__ import annotations

import numpy as np
import pytest

from strategies import available_strategies, plan, strategy_class
from strategies.metrics import composition_recurrence

CLAIMS = ("fixed", "reshuffled", "bounded")
EPOCHS = 5
#: "reshuffled": at most this share of an epoch's micro-batches is one of the epoch before's (measured: shuffle
#: 0.0, packed 0.0, length_grouped 0.02 on the data below)
RESHUFFLED_REPEATS = 0.25
#: "bounded": the recurrence bound is on its expectation; the mean over 4 epoch pairs may pass it by this factor
#: (measured 0.90-1.00 of the bound at max_recurrence 0.05, 0.1 and 0.3)
BOUND_SLACK = 1.05
#: the share of positions that hold the same micro-batch in two epochs (a changed order: about 1 / micro-batches)
SAME_ORDER_AT_MOST = 0.2
#: (samples, cap, world size, accumulation): one rank without accumulation, and 2 ranks x 2 micro-steps
SHAPES = [(600, 2048, 1, 1), (3000, 8192, 2, 2)]


def _lengths(samples: int, cap: int) -> np.ndarray:
    rng = np.random.default_rng(samples)
    return np.clip(rng.lognormal(np.log(300), 1.0, samples).astype(np.int64), 8, cap)


def _micro_batches(p) -> list[frozenset]:
    offsets = p.micro_batch_offsets
    return [frozenset(p.sample_indices[offsets[m]:offsets[m + 1]].tolist()) for m in range(p.num_micro_batches)]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[2]}ranks")
def shape(request):
    return request.param


def _plans(name: str, shape, **options):
    samples, cap, world_size, grad_accum = shape
    lengths = _lengths(samples, cap)
    return [plan(lengths, 2 * cap, strategy=name, seed=3, epoch=epoch, world_size=world_size, grad_accum=grad_accum,
                 **options) for epoch in range(EPOCHS)]


@pytest.mark.parametrize("name", available_strategies())
def test_every_strategy_declares_how_its_batches_change_between_epochs(name):
    assert strategy_class(name).epoch_composition in CLAIMS, (
        f"strategy {name!r} must declare epoch_composition, one of {CLAIMS} (strategies/base.py)")


@pytest.mark.parametrize("name", available_strategies())
def test_composition_across_epochs_is_what_the_strategy_claims(name, shape):
    claim = strategy_class(name).epoch_composition
    plans = _plans(name, shape)
    for before, after in zip(plans, plans[1:]):
        old, new = _micro_batches(before), _micro_batches(after)
        repeated = sum(batch in set(old) for batch in new) / len(new)
        if claim == "fixed":
            assert sorted(map(sorted, new)) == sorted(map(sorted, old)), f"{name}: epoch {after.epoch} regrouped"
        else:
            assert repeated <= (RESHUFFLED_REPEATS if claim == "reshuffled" else 0.5), (name, after.epoch, repeated)
    if claim == "bounded":
        bound = plans[0].info["options"]["max_recurrence"]
        recurrence = np.mean([composition_recurrence(a, b)[0] for a, b in zip(plans, plans[1:])])
        assert recurrence <= BOUND_SLACK * bound, (name, recurrence, bound)


@pytest.mark.parametrize("name", available_strategies())
def test_order_changes_every_epoch_and_an_epoch_repeats_exactly(name, shape):
    plans = _plans(name, shape)
    for before, after in zip(plans, plans[1:]):
        old, new = _micro_batches(before), _micro_batches(after)
        same = sum(a == b for a, b in zip(old, new)) / max(len(old), len(new))
        assert same <= SAME_ORDER_AT_MOST, f"{name}: epoch {after.epoch} keeps {same:.0%} of positions"
    again = _plans(name, shape)
    for first, second in zip(plans, again):
        np.testing.assert_array_equal(first.sample_indices, second.sample_indices)
        np.testing.assert_array_equal(first.micro_batch_offsets, second.micro_batch_offsets)
