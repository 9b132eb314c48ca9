"""DataConfig validation and the held-out split."""

from __future__ import annotations

import numpy as np
import pytest

from harness.data.config import DataConfig, DataConfigError
from harness.data.samples import heldout_split


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"no_anchor": "skip"}, r"data.no_anchor='skip': choose one of \['drop', 'error'\]"),
        ({"heldout_fraction": 1.0}, r"data.heldout_fraction=1.0 is outside \[0, 1\)"),
        ({"heldout_fraction": -0.1}, r"data.heldout_fraction=-0.1 is outside"),
        ({"heldout_fraction": "a"}, r"data.heldout_fraction='a': give a number"),
        ({"max_documents": 0}, r"data.max_documents=0 is too small: give an integer >= 1 or null"),
        ({"max_heldout": -3}, r"data.max_heldout=-3 is too small.*heldout_fraction=0"),
        ({"vocab_size": 100}, r"data.vocab_size=100 is too small: give an integer >= 258"),
        ({"vocab_size": 1024.0}, r"data.vocab_size=1024.0: give an integer"),
        ({"subset_seed": -1}, r"data.subset_seed=-1 is too small"),
        ({"heldout_seed": True}, r"data.heldout_seed=True: give an integer"),
        ({"source": ""}, r"data.source='': give 'stdlib'"),
        ({"split": ""}, r"data.split='': give a split name"),
        ({"cache_dir": ""}, r"data.cache_dir='': give a directory path"),
    ],
)
def test_bad_values_name_the_field_and_the_fix(options, pattern):
    with pytest.raises(DataConfigError, match=pattern):
        DataConfig(**options)


def test_defaults():
    cfg = DataConfig()
    assert (cfg.source, cfg.max_documents, cfg.vocab_size, cfg.no_anchor) == ("stdlib", 800, 1024, "drop")
    assert cfg.is_stdlib and not DataConfig(source="x.parquet").is_stdlib
    DataConfig(max_documents=None, max_heldout=None, heldout_fraction=0.0)


def test_heldout_split_is_a_deterministic_partition():
    cfg = DataConfig(heldout_fraction=0.1, max_heldout=None)
    train, heldout = heldout_split(1000, cfg)
    assert heldout.size == 100 and train.size == 900
    assert train.dtype == np.int64 and heldout.dtype == np.int64
    assert np.all(np.diff(train) > 0) and np.all(np.diff(heldout) > 0)
    assert not np.intersect1d(train, heldout).size
    assert np.array_equal(np.union1d(train, heldout), np.arange(1000))
    again_train, again_heldout = heldout_split(1000, cfg)
    assert np.array_equal(again_train, train) and np.array_equal(again_heldout, heldout)
    # only num_samples and the heldout_* options matter
    other = DataConfig(heldout_fraction=0.1, max_heldout=None, subset_seed=9, vocab_size=2048, no_anchor="error",
                       max_documents=5, source="elsewhere.parquet")
    assert np.array_equal(heldout_split(1000, other)[1], heldout)
    reseeded = DataConfig(heldout_fraction=0.1, max_heldout=None, heldout_seed=7)
    assert not np.array_equal(heldout_split(1000, reseeded)[1], heldout)
    assert not heldout.tolist() == list(range(900, 1000))  # a random draw, not the tail


def test_heldout_split_sizes():
    assert heldout_split(1000, DataConfig(heldout_fraction=0.5, max_heldout=64))[1].size == 64
    assert heldout_split(10, DataConfig(heldout_fraction=0.05))[1].size == 1  # ceil: at least one
    assert heldout_split(1, DataConfig(heldout_fraction=0.5))[1].size == 0  # keeps one training sample
    assert heldout_split(0, DataConfig())[0].size == 0
    train, heldout = heldout_split(50, DataConfig(heldout_fraction=0.0))
    assert heldout.size == 0 and train.tolist() == list(range(50))
    with pytest.raises(ValueError, match="non-negative integer"):
        heldout_split(-1, DataConfig())
