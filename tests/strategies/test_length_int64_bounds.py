"""Python-int lengths at the edges of int64: -2**63 fits (and is then refused as not positive), one beyond either end does not."""

from __future__ import annotations

import numpy as np
import pytest

from strategies import LengthsError
from strategies.validate import as_length_array


def test_the_smallest_int64_fits_and_is_refused_as_not_positive():
    with pytest.raises(LengthsError, match=r"^lengths\[1\] = -9223372036854775808 is not positive: every sample"):
        as_length_array([5, -(2**63)])
    with pytest.raises(LengthsError, match=r"^lengths\[0\] = -9223372036854775808 is not positive"):
        as_length_array((-(2**63),))


def test_one_below_the_smallest_int64_does_not_fit():
    with pytest.raises(LengthsError, match=r"^lengths\[1\] = -9223372036854775809 does not fit in int64; no sample is that long$"):
        as_length_array([5, -(2**63) - 1])


def test_the_largest_int64_fits_and_one_more_does_not():
    array = as_length_array([2**63 - 1])
    assert array.dtype == np.int64 and array.tolist() == [2**63 - 1]
    with pytest.raises(LengthsError, match=r"^lengths\[0\] = 9223372036854775808 does not fit in int64; no sample is that long$"):
        as_length_array([2**63])
