"""LengthGroupedStrategy's checks of mega_batch_mult and batch_size, with their exact messages."""

from __future__ import annotations

import pytest

from strategies.builtin import LengthGroupedStrategy


@pytest.mark.parametrize("value", [0, -2])
def test_mega_batch_mult_below_one(value):
    with pytest.raises(ValueError) as info:
        LengthGroupedStrategy(mega_batch_mult=value)
    assert str(info.value) == f"length_grouped mega_batch_mult={value} must be >= 1; use at least 1 (50 is Hugging Face's)"


@pytest.mark.parametrize("value", [1.5, True, "3"])
def test_mega_batch_mult_not_an_integer(value):
    with pytest.raises(ValueError) as info:
        LengthGroupedStrategy(mega_batch_mult=value)
    assert str(info.value) == (
        f"length_grouped mega_batch_mult={value!r} must be an integer >= 1; use at least 1 (50 is Hugging Face's)"
    )


@pytest.mark.parametrize("value", [0, -1])
def test_batch_size_below_one(value):
    with pytest.raises(ValueError) as info:
        LengthGroupedStrategy(batch_size=value)
    assert str(info.value) == f"length_grouped batch_size={value} must be >= 1; use None to derive it from the budget"


@pytest.mark.parametrize("value", [2.0, False])
def test_batch_size_not_an_integer(value):
    with pytest.raises(ValueError) as info:
        LengthGroupedStrategy(batch_size=value)
    assert str(info.value) == (
        f"length_grouped batch_size={value!r} must be an integer >= 1; use None to derive it from the budget"
    )


def test_valid_values_are_kept():
    strategy = LengthGroupedStrategy(mega_batch_mult=1, batch_size=1)
    assert (strategy.mega_batch_mult, strategy.batch_size) == (1, 1)
    assert LengthGroupedStrategy(batch_size=None).batch_size is None
