"""What a data source's rows are read as: the split of a saved dataset, and the default loss mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def select_split(loaded, split: str | None, path: Path, error: type[Exception], option: str,
                 drop_fix: str):
    """``(dataset, split)`` of what ``load_from_disk`` returned: a Dataset as it is (no split may be asked
    for), a DatasetDict's ``split`` (its only split when none is given); ``error`` names the splits."""
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            wanted = "no split given" if split is None else f"split {split!r} not found"
            raise error(f"{path}: {wanted}; this DatasetDict has splits {splits} — pass one with {option}")
        return loaded[split], split
    if split is not None:
        raise error(f"{path}: split={split!r} given but this is a single Dataset, not a DatasetDict{drop_fix}")
    return loaded, split


def default_loss_mask(ids: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A loss mask of ones with the first token of every row zeroed, same list layout as ``ids``."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks() if ids.num_chunks != 1 else ids.chunk(0)
    lengths = pc.list_value_length(ids).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.ones(int(offsets[-1]), dtype=np.int8)
    values[offsets[:-1][lengths > 0]] = 0
    large = pa.types.is_large_list(ids.type)
    array_type = pa.LargeListArray if large else pa.ListArray
    offsets_array = pa.array(offsets if large else offsets.astype(np.int32))
    return array_type.from_arrays(offsets_array, pa.array(values, type=pa.int8()), mask=ids.is_null())
