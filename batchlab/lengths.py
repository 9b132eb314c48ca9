"""The token length of every sample of a dataset, from a sequence, a ``datasets`` column or a callable, checked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm.auto import tqdm

#: samples of a dataset whose lengths are compared with their tokens before any batch (seeded, spread over it)
SPOT_CHECKS = 32
#: the column a length is read from by default (Hugging Face's ``length_column_name``) and the tokens' column
LENGTH_COLUMN = "length"
TOKENS_COLUMN = "input_ids"


class DatasetLengthsError(ValueError):
    """The lengths given do not describe the dataset they are planned for."""


def resolve_lengths(lengths: Any = None, dataset: Any = None, tokens_column: str = TOKENS_COLUMN) -> np.ndarray:
    """The length of every sample of ``dataset``, as a 1-D array (the strategies check its values).

    ``lengths`` is one of:

    - None: the dataset's ``length`` column when it has one, else the length of each sample's
      ``tokens_column`` (read from Arrow without decoding the rows for a ``datasets.Dataset``);
    - a column name of a ``datasets.Dataset`` (or a key of every sample);
    - a callable ``f(index) -> int``, called once per sample (with a progress bar);
    - a sequence or array of integers, one per sample.

    With a dataset, the count must match and a few samples spread over it must hold as many tokens as
    their length says (:func:`check_against_dataset`).
    """
    if lengths is None or isinstance(lengths, str):
        if dataset is None:
            raise DatasetLengthsError(
                f"lengths={lengths!r} reads them from the dataset, but no dataset was given; pass dataset=, or the "
                "lengths themselves as a sequence"
            )
        values = _from_dataset(dataset, lengths, tokens_column)
    elif callable(lengths):
        if dataset is None:
            raise DatasetLengthsError("lengths is a callable of the sample index; pass dataset= so its size is known")
        values = _from_callable(lengths, len(dataset))
    else:
        values = np.asarray(lengths)
    if values.ndim != 1:
        raise DatasetLengthsError(f"lengths must be one integer per sample (1-D), got shape {values.shape}")
    if dataset is not None:
        check_against_dataset(values, dataset, tokens_column)
    return values


def check_against_dataset(lengths: np.ndarray, dataset: Any, tokens_column: str = TOKENS_COLUMN) -> None:
    """Refuse lengths of another dataset: a different count, or a spot-checked sample whose tokens differ."""
    size = len(dataset)
    if len(lengths) != size:
        raise DatasetLengthsError(
            f"{len(lengths)} lengths for a dataset of {size} samples; give one length per sample, in the dataset's "
            "order (or lengths=None to read them from the dataset)"
        )
    for index in _spot_indices(size):
        sample = dataset[int(index)]
        if not isinstance(sample, dict) or tokens_column not in sample:
            return  # samples without a tokens field: nothing to compare against
        found = len(sample[tokens_column])
        if found != int(lengths[index]):
            raise DatasetLengthsError(
                f"sample {int(index)}: lengths says {int(lengths[index])} tokens but its {tokens_column!r} field holds "
                f"{found}; the lengths belong to another dataset or order. Pass lengths=None to read them from the "
                f"dataset, or recompute them after any filtering or shuffling"
            )


def _spot_indices(size: int) -> np.ndarray:
    """Up to :data:`SPOT_CHECKS` sample indices, the first and last included, the rest seeded over the dataset."""
    if size <= SPOT_CHECKS:
        return np.arange(size)
    middle = np.random.default_rng(0).choice(np.arange(1, size - 1), SPOT_CHECKS - 2, replace=False)
    return np.concatenate([[0], np.sort(middle), [size - 1]])


def _from_dataset(dataset: Any, column: str | None, tokens_column: str) -> np.ndarray:
    names = getattr(dataset, "column_names", None)
    if names is not None:  # a datasets.Dataset: read Arrow columns, never the decoded rows
        if column is None:
            column = LENGTH_COLUMN if LENGTH_COLUMN in names else tokens_column
        if column not in names:
            raise DatasetLengthsError(
                f"the dataset has no column {column!r} (columns: {', '.join(names)}); pass lengths= as a column name, "
                "a callable or a sequence"
            )
        return _arrow_lengths(dataset, column)
    key = column or tokens_column
    values = []
    for index in tqdm(range(len(dataset)), desc="sample lengths", disable=len(dataset) < 100_000):
        sample = dataset[index]
        if not isinstance(sample, dict) or key not in sample:
            raise DatasetLengthsError(
                f"sample {index} has no field {key!r}; pass lengths= (a sequence, a callable of the index, or the field "
                "that holds the tokens)"
            )
        value = sample[key]
        values.append(value if column not in (None, tokens_column) else len(value))
    return np.asarray(values)


def _arrow_lengths(dataset: Any, column: str) -> np.ndarray:
    """A ``datasets.Dataset`` column as lengths: the values of an integer column, the sizes of a list column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[column]
    if isinstance(table, pa.Table):
        table = table.column(0)
    if pa.types.is_list(table.type) or pa.types.is_large_list(table.type):
        table = pc.list_value_length(table)
    return np.asarray(table.to_numpy(zero_copy_only=False))


def _from_callable(function: Callable[[int], Any], size: int) -> np.ndarray:
    return np.asarray([function(index) for index in tqdm(range(size), desc="sample lengths", disable=size < 100_000)])
