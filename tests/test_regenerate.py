"""batchlab-regenerate: prompts kept, completions are the target's greedy ones, cached, trainable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets import Dataset
from datasets.table import InMemoryTable

from harness.data import samples as samples_module
from harness.data.config import DataConfig
from harness.data.samples import TokenizedSamples, heldout_split, load_samples
from harness.eval.regenerate import RegenerateSettings, build_parser, regenerate
from harness.eval.speculative import greedy_decode
from harness.models.target import HybridTarget

TINY = Path(__file__).resolve().parents[1] / "conf" / "target" / "tiny.yaml"


@pytest.mark.parametrize("decoder", ["hf", "recompute"])
def test_regenerated_dataset(tmp_path, decoder):
    ids = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21], [22, 23, 24]]
    masks = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1], [0, 1, 1]]
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                      "loss_mask": pa.array(masks, type=pa.list_(pa.int8()))})
    dataset = Dataset(InMemoryTable(table))
    samples = TokenizedSamples(dataset, samples_module._lengths(dataset), "test data", "1" * 64)
    torch.manual_seed(0)
    target = HybridTarget(TINY)
    data = DataConfig(source="stdlib", cache_dir=str(tmp_path))
    settings = RegenerateSettings(max_new_tokens=3)
    path, meta, built = regenerate(data, TINY, settings, batch_size=3, progress=False, samples=samples, target=target,
                                   decoder=decoder)
    assert built and meta["rows"] == 4 and meta["rows_copied_without_prompt"] == 1
    again, _, built_again = regenerate(data, TINY, settings, batch_size=3, progress=False, samples=samples,
                                       target=target, decoder=decoder)
    assert again == path and not built_again  # cached
    loaded = load_samples(DataConfig(source=str(path), cache_dir=str(tmp_path)), progress=False)
    rows = loaded.samples(range(4))
    for (new_ids, new_mask), old_ids, old_mask in zip(rows, ids, masks):
        cut = old_mask.index(1)
        if cut == 0:  # no prompt: copied unchanged
            assert new_ids.tolist() == old_ids and new_mask.tolist() == [bool(m) for m in old_mask]
            continue
        completion_length = min(len(old_ids) - cut, 3)
        assert new_ids[:cut].tolist() == old_ids[:cut]
        assert new_ids[cut:].tolist() == greedy_decode(target, old_ids[:cut], completion_length)
        assert new_mask.tolist() == [False] * cut + [True] * completion_length
    # same row count: the held-out split holds out the same rows
    cfg = DataConfig()
    assert np.array_equal(heldout_split(len(loaded), cfg)[1], heldout_split(len(samples), cfg)[1])
    sampled, _, _ = regenerate(data, TINY, RegenerateSettings(max_new_tokens=3, temperature=1.0), progress=False,
                               samples=samples, target=target, decoder=decoder)
    assert sampled != path  # other settings, another cache entry


def test_cli_parser_defaults():
    args = build_parser().parse_args(["--max-new-tokens", "8", "--temperature", "0.7"])
    assert args.max_new_tokens == 8 and args.temperature == 0.7 and args.source == "stdlib"
