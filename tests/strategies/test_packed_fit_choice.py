"""PackedStrategy packs with first fit for fit="first" and best fit for fit="best"; best fit allows max_tokens up to BEST_FIT_MAX_CAPACITY inclusive."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from strategies import Budget, Purpose, generator
from strategies.builtin import PackedStrategy
from strategies.kernels import best_fit_packed, first_fit_packed


def rows(micro) -> list:
    return sorted(sorted(micro.order[a:b].tolist()) for a, b in zip(micro.offsets[:-1], micro.offsets[1:]))


def reference(fill, prepared, budget, seed, epoch) -> list:
    shuffled = generator(seed, epoch, Purpose.SAMPLE_ORDER).permutation(prepared.kept)
    lengths = prepared.lengths[shuffled]
    grouped, offsets = fill(lengths, budget.max_tokens, shuffled.size + 1, shuffled.size)
    order = shuffled[grouped]
    return sorted(sorted(order[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:]))


def test_fit_picks_the_packing_rule():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 10, 40).astype(np.int64)
    prepared = SimpleNamespace(kept=np.arange(40, dtype=np.int64), lengths=lengths)
    budget = Budget(10)
    first = reference(first_fit_packed, prepared, budget, 0, 0)
    best = reference(best_fit_packed, prepared, budget, 0, 0)
    assert first != best  # the two rules differ on this input
    assert rows(PackedStrategy(fit="first").micro_batches(prepared, budget, 0, 0, 1)) == first
    assert rows(PackedStrategy(fit="best").micro_batches(prepared, budget, 0, 0, 1)) == best
    assert rows(PackedStrategy().micro_batches(prepared, budget, 0, 0, 1)) == first


def test_best_fit_capacity_limit_is_inclusive():
    from strategies.kernels import BEST_FIT_MAX_CAPACITY

    assert PackedStrategy(fit="best").check_budget(Budget(BEST_FIT_MAX_CAPACITY)) is None
    assert PackedStrategy(fit="first").check_budget(Budget(BEST_FIT_MAX_CAPACITY + 1)) is None
    try:
        PackedStrategy(fit="best").check_budget(Budget(BEST_FIT_MAX_CAPACITY + 1))
    except ValueError as error:
        assert str(error) == (
            f"packed fit='best' supports max_tokens up to {BEST_FIT_MAX_CAPACITY}, got {BEST_FIT_MAX_CAPACITY + 1}; "
            "use fit='first' for larger rows"
        )
    else:
        raise AssertionError("no ValueError")
