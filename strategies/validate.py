"""Input checks of the planners, run before any work, with errors that name the culprit and the fix.

Every error says which sample (index) or argument is wrong, its value, and what to do about it.
Lengths problems raise :class:`LengthsError` (a ``ValueError``); bad arguments raise ``ValueError``.

The oversize policy decides what happens to a sample longer than ``Budget.max_tokens`` (it cannot
fit any micro-batch): ``"error"`` (default) refuses, ``"truncate"`` plans it at ``max_tokens``
tokens, ``"drop"`` leaves it out of the epoch. Truncated and dropped indices are returned so the
plan records them, and a warning is logged: nothing is changed silently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .epoch_plan import Budget

logger = logging.getLogger(__name__)

OVERSIZE_POLICIES = ("error", "truncate", "drop")
#: 2**63 as a float: whole floats at or beyond it do not fit in int64
INT64_LIMIT = float(2**63)


class LengthsError(ValueError):
    """The sample lengths cannot be planned (empty, not integers, not positive, too long)."""


@dataclass(frozen=True)
class PreparedLengths:
    """Lengths after validation and the oversize policy.

    Attributes:
        lengths: int64 length of every sample as planned (truncated ones shortened; dropped ones
            keep their original length), indexed by sample index.
        kept: int64 indices of the samples to plan (all but the dropped ones), ascending.
        dropped: int64 indices left out by ``oversize="drop"``.
        truncated: int64 indices shortened by ``oversize="truncate"``.
    """

    lengths: np.ndarray
    kept: np.ndarray
    dropped: np.ndarray
    truncated: np.ndarray


def _show(value: Any) -> str:
    """A sample's value as the user wrote it (``5.5``, ``'12'``, ``True``), not numpy's repr."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _scan_python_sequence(values: Sequence[Any]) -> None:
    """Reject bools, strings and other non-numbers hidden in a Python sequence.

    ``np.asarray`` silently turns ``True`` into 1 and ``"12"`` into a string array, so a list is
    checked element by element first (a Python loop, run only for list/tuple input).
    """
    for index, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)):
            raise LengthsError(
                f"lengths[{index}] = {value!r} is a bool, not a token count; pass integer lengths"
            )
        if not isinstance(value, (int, float, np.integer, np.floating)):
            raise LengthsError(
                f"lengths[{index}] = {value!r} is a {type(value).__name__}, not an integer token count; "
                "convert the lengths to integers first (e.g. np.asarray(values, dtype=np.int64))"
            )
        if isinstance(value, int) and not -INT64_LIMIT <= value < INT64_LIMIT:
            raise LengthsError(f"lengths[{index}] = {value!r} does not fit in int64; no sample is that long")


def as_length_array(lengths: Any) -> np.ndarray:
    """Validate sample lengths and return them as a fresh int64 array.

    Accepts any 1-D sequence or array of positive integers; floats are accepted only when they
    hold whole numbers. Raises :class:`LengthsError` naming the first offending sample.
    """
    if isinstance(lengths, (str, bytes)):
        raise LengthsError(f"lengths must be a sequence of integers, got the string {lengths!r}")
    if isinstance(lengths, (list, tuple)):
        _scan_python_sequence(lengths)
    try:
        array = np.asarray(lengths)
    except (TypeError, ValueError) as err:
        raise LengthsError(f"lengths cannot be read as a 1-D array of integers: {err}") from err
    if array.ndim != 1:
        raise LengthsError(
            f"lengths must be one-dimensional (one length per sample), got shape {array.shape}"
        )
    if array.size == 0:
        raise LengthsError(
            "lengths is empty: a plan needs at least one sample; check the dataset path and filters"
        )
    kind = array.dtype.kind
    if kind == "b":
        raise LengthsError(
            f"lengths[0] = {_show(array[0])} is a bool (the array has dtype bool), not a token count; "
            "pass integer lengths"
        )
    if kind == "O":
        _scan_python_sequence(array.tolist())
        array = np.asarray(array.tolist())
        kind = array.dtype.kind
    if kind in "USV":
        raise LengthsError(
            f"lengths[0] = {_show(array[0])} is a {'string' if kind in 'US' else 'raw record'}, "
            "not an integer; convert the lengths to integers first (e.g. np.asarray(values, dtype=np.int64))"
        )
    if kind == "c":
        raise LengthsError(f"lengths[0] = {_show(array[0])} is a complex number, not an integer token count")
    if kind == "f":
        finite = np.isfinite(array)
        if not finite.all():
            index = _first(~finite)
            raise LengthsError(
                f"lengths[{index}] = {_show(array[index])} is not a finite number; every sample needs an "
                "integer length (fix or remove the sample)"
            )
        fractional = array != np.floor(array)
        if fractional.any():
            index = _first(fractional)
            raise LengthsError(
                f"lengths[{index}] = {_show(array[index])} is not a whole number; sample lengths are token "
                "counts (check the length column, or round it explicitly)"
            )
        too_large = np.abs(array) >= INT64_LIMIT
        if too_large.any():
            index = _first(too_large)
            raise LengthsError(
                f"lengths[{index}] = {_show(array[index])} does not fit in int64; no sample is that long "
                "(check the length column for corrupt values)"
            )
    elif kind not in "iu":
        raise LengthsError(f"lengths has unsupported dtype {array.dtype}; pass integer lengths")
    non_positive = array <= 0
    if non_positive.any():
        index = _first(non_positive)
        raise LengthsError(
            f"lengths[{index}] = {_show(array[index])} is not positive: every sample needs at least one "
            "token; remove empty samples before planning"
        )
    if kind == "u" and array.dtype.itemsize == 8 and array.max() > np.iinfo(np.int64).max:
        index = int(np.argmax(array))
        raise LengthsError(f"lengths[{index}] = {_show(array[index])} does not fit in int64")
    return array.astype(np.int64, copy=True)


def prepare_lengths(lengths: Any, budget: Budget, oversize: str = "error") -> PreparedLengths:
    """Validate lengths and apply the oversize policy (see the module docstring)."""
    check_oversize_policy(oversize)
    array = as_length_array(lengths)
    too_long = array > budget.max_tokens
    no_index = np.zeros(0, dtype=np.int64)
    if not too_long.any():
        return PreparedLengths(array, np.arange(array.size, dtype=np.int64), no_index, no_index)
    offenders = np.flatnonzero(too_long).astype(np.int64)
    index = int(offenders[0])
    if oversize == "error":
        longest = int(array.max())
        raise LengthsError(
            f"lengths[{index}] = {_show(array[index])} exceeds Budget.max_tokens={budget.max_tokens}: a sample "
            f"must fit one micro-batch ({offenders.size} sample(s) too long, the longest {longest}); "
            f"raise max_tokens to at least {longest}, or pass oversize='truncate' or oversize='drop'"
        )
    if oversize == "truncate":
        logger.warning(
            "oversize='truncate': %d sample(s) longer than max_tokens=%d planned at %d tokens "
            "(first: lengths[%d] = %d)",
            offenders.size, budget.max_tokens, budget.max_tokens, index, array[index],
        )
        array[offenders] = budget.max_tokens
        return PreparedLengths(array, np.arange(array.size, dtype=np.int64), no_index, offenders)
    # drop
    kept = np.flatnonzero(~too_long).astype(np.int64)
    if kept.size == 0:
        raise LengthsError(
            f"oversize='drop' left no sample: all {array.size} lengths exceed "
            f"Budget.max_tokens={budget.max_tokens} (e.g. lengths[{index}] = {_show(array[index])}); raise max_tokens"
        )
    logger.warning(
        "oversize='drop': %d sample(s) longer than max_tokens=%d left out of the epoch "
        "(first: lengths[%d] = %d)",
        offenders.size, budget.max_tokens, index, array[index],
    )
    return PreparedLengths(array, kept, offenders, no_index)


def check_oversize_policy(oversize: Any) -> None:
    """Raise unless ``oversize`` is one of ``OVERSIZE_POLICIES``."""
    if oversize not in OVERSIZE_POLICIES:
        raise ValueError(f"oversize={oversize!r} is not a policy; use one of {list(OVERSIZE_POLICIES)}")


def check_positive_int(name: str, value: Any, fix: str) -> int:
    """Return ``value`` as int if it is an integer >= 1, else raise naming ``name`` and the fix."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an integer >= 1; {fix}")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1; {fix}")
    return int(value)


def check_non_negative_int(name: str, value: Any) -> int:
    """Return ``value`` as int if it is an integer >= 0 (seeds, epochs), else raise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")
    return int(value)


def check_run_shape(world_size: Any, grad_accum: Any, seed: Any, epoch: Any) -> tuple[int, int, int, int]:
    """Validate the distributed shape and the random identity of a plan."""
    world_size = check_positive_int(
        "world_size", world_size, "it is the number of data-parallel ranks (1 for one process)"
    )
    grad_accum = check_positive_int(
        "grad_accum", grad_accum, "it is the number of micro-batches per rank per optimizer step (1 = none)"
    )
    return world_size, grad_accum, check_non_negative_int("seed", seed), check_non_negative_int("epoch", epoch)


def coerce_budget(budget: Any) -> Budget:
    """Accept a :class:`Budget`, a bare ``max_tokens`` integer or a mapping of Budget's fields."""
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, (int, np.integer)) and not isinstance(budget, (bool, np.bool_)):
        return Budget(int(budget))
    if hasattr(budget, "keys"):
        unknown = set(budget.keys()) - {"max_tokens", "max_samples"}
        if unknown or "max_tokens" not in budget:
            raise ValueError(
                f"budget mapping with fields {sorted(budget.keys())} is not a Budget; "
                "give max_tokens (and optionally max_samples)"
            )
        return Budget(**dict(budget))
    raise ValueError(f"budget={budget!r} must be a Budget(max_tokens, max_samples=None) or an integer max_tokens")
