"""validate_samples: every error names the row, the field and the fix; no-anchor rows are counted."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from datasets import Dataset
from datasets.table import InMemoryTable

from harness.data import samples as samples_module
from harness.data.errors import DataValidationError
from harness.data.samples import TokenizedSamples, validate_samples

B = 4  # block size


def _samples(ids, masks=None, mask_type=pa.int8()) -> TokenizedSamples:
    columns = {"input_ids": pa.array(ids, type=pa.list_(pa.int32()))}
    if masks is None:
        masks = [None if row is None else [0] * min(len(row), 1) + [1] * (len(row) - 1) for row in ids]
    columns["loss_mask"] = pa.array(masks, type=pa.list_(mask_type))
    dataset = Dataset(InMemoryTable(pa.table(columns)))
    return TokenizedSamples(dataset, samples_module._lengths(dataset), "test data", "0" * 64)


def _validate(samples, indices=None, vocab_size=100, block_size=B, no_anchor="drop"):
    indices = np.arange(len(samples)) if indices is None else np.asarray(indices)
    return validate_samples(samples, indices, vocab_size=vocab_size, block_size=block_size, no_anchor=no_anchor)


def test_clean_rows_are_kept():
    samples = _samples([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    report = _validate(samples)
    assert report.kept.tolist() == [0, 1] and report.dropped_no_anchor.size == 0
    assert report.summary() == {"checked": 2, "kept": 2, "dropped_no_anchor": 0}
    assert report.kept.dtype == np.int64


def test_id_out_of_vocabulary_names_row_position_value_and_fix():
    samples = _samples([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 150, 5, 200]])
    with pytest.raises(DataValidationError) as info:
        _validate(samples)
    message = str(info.value)
    for part in ("row 2", "input_ids[3] = 150", "[0, 100)", "1 more bad value", "tokenize with the target's tokenizer"):
        assert part in message, (part, message)
    negative = _samples([[1, 2, 3, 4], [1, -7, 3, 4]])
    with pytest.raises(DataValidationError, match=r"row 1: input_ids\[1\] = -7 is outside the vocabulary.*raise data.vocab_size"):
        _validate(negative)
    # rows outside the checked indices do not fail this check
    assert _validate(samples, [0, 1]).kept.tolist() == [0, 1]


def test_mask_length_mismatch_names_row_and_both_lengths():
    samples = _samples([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6]], masks=[[0, 1, 1, 1], [0, 1, 1], [0, 1]])
    pattern = r"row 1: loss_mask has 3 entries but input_ids has 4 tokens.*one loss_mask entry per token"
    with pytest.raises(DataValidationError, match=pattern):
        _validate(samples)


def test_empty_sample_and_empty_dataset():
    samples = _samples([[1, 2, 3, 4], [], [1, 2, 3, 4, 5]])
    with pytest.raises(DataValidationError, match=r"row 1: input_ids is empty \(0 tokens\); remove empty samples"):
        _validate(samples)
    with pytest.raises(DataValidationError, match="dataset is empty"):
        _validate(_samples([]), [])
    nothing = _validate(_samples([[1, 2, 3, 4]]), np.zeros(0, dtype=np.int64))  # e.g. no held-out set
    assert nothing.kept.size == 0 and nothing.summary() == {"checked": 0, "kept": 0, "dropped_no_anchor": 0}
    with pytest.raises(IndexError, match="row 5 out of range"):
        _validate(_samples([[1, 2, 3, 4]]), [5])


def test_null_rows_and_bad_mask_values():
    nulls = _samples([[1, 2, 3, 4], None], masks=[[0, 1, 1, 1], [1]])
    with pytest.raises(DataValidationError, match="row 1: input_ids is null.*remove or fix"):
        _validate(nulls)
    twos = _samples([[1, 2, 3, 4], [1, 2, 3, 4]], masks=[[0, 1, 1, 1], [0, 1, 2, 1]])
    with pytest.raises(DataValidationError, match=r"row 1: loss_mask\[2\] = 2.*must be 0.*or 1"):
        _validate(twos)


def test_no_anchor_rows_are_dropped_and_counted():
    rows = [
        [1] * (B - 1),                    # 0: shorter than a block
        [1] * 10,                         # 1: mask all zero
        [1] * B,                          # 2: exactly a block, anchor at 0
        [1] * 8,                          # 3: only supervised pair starts at 5 > 8 - B: no anchor
        [1] * 8,                          # 4: supervised pair at p = 8 - B exactly: kept
        [1] * 8,                          # 5: supervised tokens never adjacent
        [1] * 20,                         # 6: default mask
    ]
    masks = [
        [1] * (B - 1),
        [0] * 10,
        [1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 1, 0, 1, 0, 1, 0],
        [0] + [1] * 19,
    ]
    samples = _samples(rows, masks)
    report = _validate(samples)
    assert report.kept.tolist() == [2, 4, 6]
    assert report.dropped_no_anchor.tolist() == [0, 1, 3, 5]
    assert report.summary() == {"checked": 7, "kept": 3, "dropped_no_anchor": 4}
    subset = _validate(samples, [6, 3, 2])
    assert subset.kept.tolist() == [6, 2] and subset.dropped_no_anchor.tolist() == [3]
    with pytest.raises(DataValidationError) as info:
        _validate(samples, no_anchor="error")
    message = str(info.value)
    for part in ("4 row(s)", "rows 0 (length 3), 1 (length 10), 3 (length 8), 5 (length 8)", "data.no_anchor='drop'",
                 f"p <= length - {B}"):
        assert part in message, (part, message)
    # block size 1 still needs p + 1 inside the sample
    assert _validate(_samples([[1], [1, 1]], [[1], [1, 1]]), block_size=1).kept.tolist() == [1]


def test_boolean_masks():
    samples = _samples([[1, 2, 3, 4], [1, 2, 3, 4]], [[False, True, True, True], [True, False, True, False]], pa.bool_())
    assert _validate(samples, block_size=2).kept.tolist() == [0]


def _reference_has_anchor(mask: np.ndarray, block_size: int) -> bool:
    length = mask.size
    return any(mask[p] and mask[p + 1] for p in range(0, length - max(block_size, 2) + 1))


def test_vectorised_scan_matches_a_reference_across_chunks_and_windows(monkeypatch):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=600)
    masks = [(rng.random(n) < rng.choice([0.05, 0.3, 0.9])).astype(np.int8) for n in lengths]
    ids = [rng.integers(0, 50, size=n) for n in lengths]
    half = 300
    table = pa.concat_tables(
        [
            pa.table({"input_ids": pa.array([x.tolist() for x in ids[:half]], type=pa.list_(pa.int32())),
                      "loss_mask": pa.array([m.tolist() for m in masks[:half]], type=pa.list_(pa.int8()))}),
            pa.table({"input_ids": pa.array([x.tolist() for x in ids[half:]], type=pa.list_(pa.int32())),
                      "loss_mask": pa.array([m.tolist() for m in masks[half:]], type=pa.list_(pa.int8()))}),
        ]
    )
    dataset = Dataset(InMemoryTable(table))
    samples = TokenizedSamples(dataset, samples_module._lengths(dataset), "random", "0" * 64)
    assert samples.column("loss_mask").num_chunks == 2
    monkeypatch.setattr(samples_module, "SCAN_WINDOW_TOKENS", 57)  # many windows, rows straddling them
    for block_size in (1, 2, 5, 16):
        report = _validate(samples, block_size=block_size)
        expected = [i for i, m in enumerate(masks) if _reference_has_anchor(m.astype(bool), block_size)]
        assert report.kept.tolist() == expected, block_size


def test_large_synthetic_dataset_validates_vectorised():
    rng = np.random.default_rng(1)
    rows = 200_000
    lengths = rng.integers(1, 64, size=rows)
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, 1000, size=int(offsets[-1]), dtype=np.int32)
    mask = np.ones(values.size, dtype=np.int8)
    mask[offsets[:-1]] = 0
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
        }
    )
    dataset = Dataset(InMemoryTable(table))
    samples = TokenizedSamples(dataset, samples_module._lengths(dataset), "synthetic", "0" * 64)
    report = _validate(samples, vocab_size=1000, block_size=16)
    # default mask (all but the first token): the first anchor is p = 1, so a row needs 1 + 16 tokens
    assert report.kept.size == int((lengths >= 17).sum())
    assert report.dropped_no_anchor.size == int((lengths < 17).sum())
