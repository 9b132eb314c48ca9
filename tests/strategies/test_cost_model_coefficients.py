"""CostModel.__post_init__: a negative, non-number or non-finite coefficient, all zero, or a bad block setting each give their exact message."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from strategies.cost import CostModel


@pytest.mark.parametrize(
    "a, b, c",
    [(-1.0, 1.0, 1.0), (1.0, -1.0, 1.0), (1.0, 1.0, -1.0), (1.0, -0.5, 0.0), (0.0, 0.0, -2.0), (1.0, -1.0, -1.0)],
)
def test_one_negative_coefficient_is_rejected(a, b, c):
    message = f"CostModel(a={a}, b={b}, c={c}): coefficients must be >= 0, not all 0"
    with pytest.raises(ValueError, match=re.escape(message)):
        CostModel(a=a, b=b, c=c)


def test_all_zero_is_rejected_and_one_positive_is_enough():
    with pytest.raises(ValueError, match=re.escape("CostModel(a=0.0, b=0.0, c=0.0): coefficients must be >= 0, not all 0")):
        CostModel(a=0.0, b=0.0, c=0.0)
    assert CostModel(a=0.0, b=0.0, c=1.0).c == 1.0
    assert CostModel(a=0.0, b=3.0, c=0.0).b == 3.0
    assert CostModel(a=2.0, b=0.0, c=0.0).a == 2.0


@pytest.mark.parametrize("name", ["a", "b", "c"])
@pytest.mark.parametrize("value", [True, np.bool_(False), "1", None])
def test_non_number_coefficient_message(name, value):
    with pytest.raises(ValueError) as info:
        CostModel(**{name: value})
    assert str(info.value) == f"CostModel.{name}={value!r} must be a number (a finite coefficient >= 0)"


@pytest.mark.parametrize("name", ["a", "b", "c"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_coefficient_message(name, value):
    with pytest.raises(ValueError) as info:
        CostModel(**{name: value})
    assert str(info.value) == f"CostModel.{name}={value!r} must be finite; give a coefficient >= 0"


@pytest.mark.parametrize("name", ["block_size", "num_anchors"])
@pytest.mark.parametrize("value", [0, -3, True, np.bool_(True), 2.0, "4", None])
def test_bad_block_setting_message(name, value):
    with pytest.raises(ValueError) as info:
        CostModel(**{name: value})
    assert str(info.value) == f"CostModel.{name}={value!r} must be a positive integer"


def test_numpy_numbers_and_one_are_accepted():
    model = CostModel(a=np.float32(1.5), b=np.int64(0), c=2, block_size=1, num_anchors=np.int32(1))
    assert (model.a, model.b, model.c, model.block_size, model.num_anchors) == (1.5, 0, 2, 1, 1)
