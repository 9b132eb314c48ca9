"""autocorrelation's float64 arithmetic, its NaN tail past the series, a small but nonzero variance, and an empty series without warnings."""

from __future__ import annotations

import warnings

import numpy as np

from strategies.metrics import autocorrelation


def test_float32_series_is_computed_in_float64():
    result = autocorrelation(np.array([1, 2, 4], dtype=np.float32), 2)
    expected = autocorrelation(np.array([1.0, 2.0, 4.0]), 2)
    assert result.dtype == np.float64
    assert result.tolist() == expected.tolist()
    # centred -4/3, -1/3, 5/3; denominator 42/9
    assert abs(result[0] - (-1 / 42)) < 1e-15
    assert abs(result[1] - (-10 / 21)) < 1e-15


def test_float16_series_is_computed_in_float64():
    series = np.array([0.1, 0.2, 0.7], dtype=np.float16)
    assert autocorrelation(series, 2).tolist() == autocorrelation(series.astype(np.float64), 2).tolist()


def test_small_variance_is_not_treated_as_constant():
    # centred -0.25, 0.25: denominator 0.125, lag 1 gives -0.0625 / 0.125
    assert autocorrelation(np.array([0.0, 0.5]), 1).tolist() == [-0.5]
    assert autocorrelation(np.array([0.0, 0.1, 0.0]), 1)[0] < 0


def test_lags_past_the_series_are_nan():
    result = autocorrelation(np.array([1.0, 3.0, 2.0]), 5)
    assert result[0] == -0.5
    assert result[1] == 0.0
    assert np.isnan(result[2:]).all() and result.shape == (5,)
    two = autocorrelation(np.array([0.0, 0.5]), 3)
    assert two[0] == -0.5 and np.isnan(two[1:]).all()


def test_constant_series_is_all_nan():
    assert np.isnan(autocorrelation(np.array([2.0, 2.0, 2.0]), 2)).all()


def test_empty_series_gives_nan_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = autocorrelation(np.array([], dtype=np.float64), 3)
    assert result.shape == (3,) and np.isnan(result).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isnan(autocorrelation([], 2)).all()
