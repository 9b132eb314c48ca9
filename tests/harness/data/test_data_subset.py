"""data.max_length and data.max_rows (harness/data/subset.py): every row cut at a supervised span's end within the
length (inside its first span when none ends there; dropped when its prompt fills it), then a seeded subset drawn from
the rows left, every outcome counted in the samples' description."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.data.config import DataConfig, DataConfigError
from harness.data.samples import load_samples
from harness.data.subset import OUTCOMES, cut_point, rows_selected

WHOLE, AFTER_SPAN, INSIDE_FIRST, DROPPED = OUTCOMES


@pytest.mark.parametrize(("mask", "max_length", "expected"), [
    ([0, 0, 1, 1], 4, (4, WHOLE)),
    ([0, 1, 1, 0, 0, 1, 1, 1], 6, (3, AFTER_SPAN)),          # the first reply ends at 3; the second runs past 6
    ([0, 1, 1, 0, 1, 1, 0, 1], 6, (6, AFTER_SPAN)),          # a reply ending exactly at the cut is whole
    ([0, 1, 1, 0, 1, 1, 1, 1], 6, (3, AFTER_SPAN)),          # ... but not one that goes on past it
    ([0, 0, 1, 1, 1, 1, 1, 1], 5, (5, INSIDE_FIRST)),        # no reply ends within 5: the first is cut
    ([0, 0, 0, 0, 0, 0, 1, 1], 5, (0, DROPPED)),             # the prompt alone fills 5
    ([0, 0, 0, 0, 0, 1, 1, 1], 5, (0, DROPPED)),             # nothing of the reply would be left
])
def test_a_row_is_cut_at_its_last_reply_within_the_length(mask, max_length, expected):
    assert cut_point(np.array(mask), max_length) == expected


def test_the_subset_is_drawn_from_the_rows_left_and_repeats_with_its_seed():
    lengths = np.array([4, 8, 8, 3, 8, 2, 8, 5])
    masks = {1: [0, 1, 0, 1, 1, 1, 1, 1], 2: [0] * 8, 4: [0, 0, 1, 1, 1, 1, 1, 1], 6: [0] * 7 + [1]}
    rows, ends, outcomes = rows_selected(lengths, lambda r: np.array(masks[r]), None, 5, seed=0)
    assert rows.tolist() == [0, 1, 3, 4, 5, 7] and ends.tolist() == [4, 2, 3, 5, 2, 5]
    assert outcomes == {WHOLE: 4, AFTER_SPAN: 1, INSIDE_FIRST: 1, DROPPED: 2}
    picks = {seed: rows_selected(lengths, lambda r: np.array(masks[r]), 4, 5, seed=seed)[0].tolist() for seed in range(6)}
    assert all(len(p) == 4 and p == sorted(p) and set(p) <= {0, 1, 3, 4, 5, 7} for p in picks.values())
    assert picks[0] == rows_selected(lengths, lambda r: np.array(masks[r]), 4, 5, seed=0)[0].tolist()
    assert len({tuple(p) for p in picks.values()}) > 1  # another seed, another subset


def test_a_source_is_cut_and_subset_and_says_so(tmp_path: Path):
    rows = [([5, 6, 7, 8], [0, 0, 1, 1]), ([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 1, 0, 0, 1, 1, 1]),
            ([9] * 8, [0] * 7 + [1]), ([3, 4], [0, 1])]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input_ids": i, "loss_mask": m}) + "\n" for i, m in rows))
    samples = load_samples(DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"), max_length=6), progress=False)
    assert [samples.sample(r)[0].tolist() for r in range(len(samples))] == [[5, 6, 7, 8], [1, 2, 3], [3, 4]]
    assert samples.lengths.tolist() == [4, 3, 2]
    assert ("3 of 4 rows kept: cut to data.max_length=6 tokens (2 kept whole, 1 cut after a supervised span, "
            "1 dropped: prompt fills max_length)") in samples.source
    two = load_samples(DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"), max_length=6, max_rows=2),
                       progress=False)
    assert len(two) == 2 and "data.max_rows=2 drawn with seed 0" in two.source
    assert two.fingerprint not in (samples.fingerprint,)  # another selection, another cache key


@pytest.mark.parametrize("source", ["stdlib", "stdlib-chat", "bundled"])
def test_max_rows_and_max_length_are_refused_for_the_embedded_corpus(source):
    with pytest.raises(DataConfigError, match=rf"data.max_rows=5 applies to your own data, not to data.source='{source}'"):
        DataConfig(source=source, max_rows=5)
    with pytest.raises(DataConfigError, match="data.max_length=1 is too small"):
        DataConfig(source="x.jsonl", max_length=1)
