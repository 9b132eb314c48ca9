"""Tokenized samples from a saved dataset, parquet and JSON lines."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.data.config import DataConfig
from harness.data.errors import DataValidationError
from harness.data.samples import load_samples

IDS = [[5, 6, 7, 8], [9], [1, 2, 3], [4, 4, 4, 4, 4, 4]]
MASKS = [[0, 0, 1, 1], [1], [0, 1, 1], [1, 1, 1, 0, 1, 1]]
DEFAULT_MASKS = [[0] + [1] * (len(row) - 1) for row in IDS]


def _cfg(source: Path, tmp_path: Path, **options) -> DataConfig:
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **options)


def _rows(samples) -> tuple[list, list]:
    pairs = samples.samples(range(len(samples)))
    for ids, mask in pairs:
        assert ids.dtype == np.int64 and mask.dtype == bool
    return [ids.tolist() for ids, _ in pairs], [mask.astype(int).tolist() for _, mask in pairs]


def test_save_to_disk_dataset(tmp_path: Path):
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": IDS, "loss_mask": MASKS, "text": list("abcd")}).save_to_disk(str(path))
    samples = load_samples(_cfg(path, tmp_path), progress=False)
    assert _rows(samples) == (IDS, MASKS)
    assert samples.lengths.tolist() == [len(r) for r in IDS] and samples.lengths.dtype == np.int64
    assert samples.tokenizer_path is None and samples.vocab_size is None and len(samples.fingerprint) == 64
    assert samples.sample(-1)[0].tolist() == IDS[-1]
    assert [ids.tolist() for ids, _ in samples.samples([3, 0, 3])] == [IDS[3], IDS[0], IDS[3]]


def test_save_to_disk_without_mask_gets_the_default(tmp_path: Path):
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": IDS}).save_to_disk(str(path))
    samples = load_samples(_cfg(path, tmp_path), progress=False)
    assert _rows(samples) == (IDS, DEFAULT_MASKS)
    assert "loss_mask filled" in samples.source
    clone = pickle.loads(pickle.dumps(samples))
    assert _rows(clone) == (IDS, DEFAULT_MASKS)
    assert load_samples(_cfg(path, tmp_path), progress=False).fingerprint == samples.fingerprint


def test_dataset_dict_splits(tmp_path: Path):
    path = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"input_ids": IDS, "loss_mask": MASKS}),
            "test": datasets.Dataset.from_dict({"input_ids": IDS[:2]}),
        }
    ).save_to_disk(str(path))
    train = load_samples(_cfg(path, tmp_path, split="train"), progress=False)
    test = load_samples(_cfg(path, tmp_path, split="test"), progress=False)
    assert _rows(train) == (IDS, MASKS) and _rows(test) == (IDS[:2], DEFAULT_MASKS[:2])
    assert train.fingerprint != test.fingerprint
    with pytest.raises(DataValidationError, match=r"no split given.*\['train', 'test'\].*data.split"):
        load_samples(_cfg(path, tmp_path), progress=False)
    with pytest.raises(DataValidationError, match=r"split 'valid' not found.*\['train', 'test'\]"):
        load_samples(_cfg(path, tmp_path, split="valid"), progress=False)
    single = tmp_path / "single"
    datasets.DatasetDict({"only": datasets.Dataset.from_dict({"input_ids": IDS})}).save_to_disk(str(single))
    assert len(load_samples(_cfg(single, tmp_path), progress=False)) == 4
    plain = tmp_path / "plain"
    datasets.Dataset.from_dict({"input_ids": IDS}).save_to_disk(str(plain))
    with pytest.raises(DataValidationError, match="single Dataset.*data.split to null"):
        load_samples(_cfg(plain, tmp_path, split="train"), progress=False)


def test_parquet(tmp_path: Path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"input_ids": IDS, "other": [1, 2, 3, 4]}), path, row_group_size=3)
    samples = load_samples(_cfg(path, tmp_path), progress=False)
    assert _rows(samples) == (IDS, DEFAULT_MASKS)
    assert samples.lengths.tolist() == [4, 1, 3, 6]
    masked = tmp_path / "masked.parquet"
    pq.write_table(pa.table({"input_ids": IDS, "loss_mask": [[bool(v) for v in m] for m in MASKS]}), masked)
    assert _rows(load_samples(_cfg(masked, tmp_path), progress=False)) == (IDS, MASKS)
    # the conversion is cached by path, size and mtime
    first = load_samples(_cfg(path, tmp_path), progress=False)
    pq.write_table(pa.table({"input_ids": IDS[:2]}), path)
    second = load_samples(_cfg(path, tmp_path), progress=False)
    assert len(second) == 2 and second.fingerprint != first.fingerprint
    # memory-mapped: pickles by file path, not by content
    assert len(pickle.dumps(samples)) < 10_000


def test_jsonl(tmp_path: Path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input_ids": i, "loss_mask": m}) + "\n" for i, m in zip(IDS, MASKS)))
    samples = load_samples(_cfg(path, tmp_path), progress=False)
    assert _rows(samples) == (IDS, MASKS)
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"input_ids": i}) + "\n" for i in IDS))
    assert _rows(load_samples(_cfg(bare, tmp_path), progress=False)) == (IDS, DEFAULT_MASKS)


def test_source_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_samples(_cfg(tmp_path / "nope.parquet", tmp_path), progress=False)
    text = tmp_path / "x.csv"
    text.write_text("1,2\n")
    with pytest.raises(DataValidationError, match="unknown data format '.csv'"):
        load_samples(_cfg(text, tmp_path), progress=False)
    no_ids = tmp_path / "no_ids.parquet"
    pq.write_table(pa.table({"tokens": IDS, "body": list("abcd")}), no_ids)
    with pytest.raises(DataValidationError, match=r"no 'input_ids' column; columns found: \['tokens', 'body'\].*tokenize"):
        load_samples(_cfg(no_ids, tmp_path), progress=False)
    plain = tmp_path / "plain.parquet"  # a text column: plain text, which needs the tokenizer
    pq.write_table(pa.table({"text": list("abcd")}), plain)
    with pytest.raises(DataValidationError, match=r"holds plain text: give data.tokenizer=PATH"):
        load_samples(_cfg(plain, tmp_path), progress=False)
    strings = tmp_path / "strings.jsonl"
    strings.write_text(json.dumps({"input_ids": "hello"}) + "\n")
    with pytest.raises(DataValidationError, match="'input_ids' has type string; expected a list of integers"):
        load_samples(_cfg(strings, tmp_path), progress=False)
    # a broken line is named by the file's own line number (pyarrow counts rows from 0 within a block)
    good = json.dumps({"input_ids": list(range(2, 30))})
    for bad, named in [('{"input_ids": [1, 2, 3', r"line 51 is not valid JSON: Expecting ',' delimiter at column 23"),
                       ('{"input_ids": {"a": 1}}', r"line 51: input_ids is not a list of integers \(\{\"a\": 1\}\)"),
                       ("[1, 2]", "line 51 is a JSON list, not an object")]:
        broken = tmp_path / "broken.jsonl"
        broken.write_text("\n".join([good] * 50 + [bad] + [good] * 9) + "\n")
        with pytest.raises(DataValidationError, match=named):
            load_samples(_cfg(broken, tmp_path), progress=False)
    not_dataset = tmp_path / "dir"
    not_dataset.mkdir()
    with pytest.raises(DataValidationError, match="not a dataset written by save_to_disk"):
        load_samples(_cfg(not_dataset, tmp_path), progress=False)
    parquet = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"input_ids": IDS}), parquet)
    with pytest.raises(DataValidationError, match="split.*only to a dataset directory"):
        load_samples(_cfg(parquet, tmp_path, split="train"), progress=False)
    no_ids_ds = tmp_path / "no_ids_ds"
    datasets.Dataset.from_dict({"body": list("ab")}).save_to_disk(str(no_ids_ds))
    with pytest.raises(DataValidationError, match=r"columns found: \['body'\]"):
        load_samples(_cfg(no_ids_ds, tmp_path), progress=False)


def _read_in_worker(samples, indices):
    return [ids.tolist() for ids, _ in samples.samples(indices)]


def _default_stop_signals():
    """A forked worker dies on the pool's SIGTERM whatever handler the parent process had installed."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _forked_pool_reads(path: str, cache_dir: str) -> list:
    """In a process of its own: load the samples, touch the Arrow table, then read it from two forked workers."""
    import multiprocessing

    samples = load_samples(DataConfig(source=path, cache_dir=cache_dir), progress=False)
    samples.sample(0)  # the parent has touched the Arrow table before forking
    with multiprocessing.get_context("fork").Pool(2, initializer=_default_stop_signals) as pool:
        # a bound on the wait: a worker deadlocked by the fork fails the test instead of hanging the suite
        return pool.starmap_async(_read_in_worker, [(samples, [0, 1]), (samples, [3, 2])]).get(timeout=60)


def test_samples_in_forked_workers(tmp_path: Path):
    """DataLoader workers fork from a rank that has read the samples. The forking parent is a fresh process: a
    test process may hold other tests' threads (W&B's service, telemetry), and forking a process with threads can
    deadlock the child whatever the samples do."""
    import concurrent.futures
    import multiprocessing

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"input_ids": IDS}), path)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as parent:
        results = parent.submit(_forked_pool_reads, str(path), str(tmp_path / "cache")).result(timeout=180)
    assert results == [IDS[:2], [IDS[3], IDS[2]]]
    samples = load_samples(_cfg(path, tmp_path), progress=False)
    ids, mask = samples.sample(2)
    assert ids.flags.writeable and mask.flags.writeable
    assert samples.samples([]) == []


def test_the_readmes_own_data_example_builds_three_sources_that_load_alike(tmp_path: Path, batchlab_cache, monkeypatch):
    """docs/your-data.md: its Python block, run as written, writes the same rows as JSON lines, parquet and
    save_to_disk; each loads, with the prompt masked, and batchlab-plan reads the parquet file as the page says."""
    import re

    from harness.cli import plan as plan_cli

    section = (Path(__file__).resolve().parents[3] / "docs" / "your-data.md").read_text()
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/your-data.md", "exec"), {})  # noqa: S102 - the page's example, as a user runs it
    loaded = {name: load_samples(DataConfig(source=str(tmp_path / name), max_documents=None, vocab_size=1024),
                                 progress=False)
              for name in ("my_data.jsonl", "my_data.parquet", "my_data")}
    reference = loaded["my_data.jsonl"]
    assert len(reference) == 100
    for samples in loaded.values():
        assert samples.lengths.tolist() == reference.lengths.tolist()
        for row in (0, 1, 99):
            (ids, mask), (ids_ref, mask_ref) = samples.sample(row), reference.sample(row)
            assert ids.tolist() == ids_ref.tolist() and mask.tolist() == mask_ref.tolist()
            assert 0 < mask.sum() < mask.size and mask[0] == 0 and mask[-1] == 1  # the prompt is not trained on
    command = re.search(r"batchlab-plan (--lengths my_data\.parquet .*?)\s+#", section)[1].split()
    assert plan_cli.main([*command, "--strategies", "sorted"]) == 0
