"""Reading lengths (harness.data.lengths) from every supported source, and its error messages."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.data.lengths import LengthsSourceError, load_lengths
from harness.data.profiles import available_profiles, lognormal_lengths, profile_lengths

TOKEN_LISTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
EXPECTED = np.array([3, 1, 5, 2])


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("hf")
    dataset = datasets.Dataset.from_dict({"input_ids": TOKEN_LISTS, "num_tokens": [30, 10, 50, 20]})
    dataset.save_to_disk(str(root / "single"))
    datasets.DatasetDict(train=dataset, test=dataset.select([0, 1])).save_to_disk(str(root / "dict"))
    return root


def test_saved_dataset_gives_input_ids_lengths_by_default(saved_dataset):
    lengths = load_lengths(saved_dataset / "single")
    assert lengths.dtype == np.int64
    np.testing.assert_array_equal(lengths, EXPECTED)


def test_saved_dataset_numeric_column_and_missing_column(saved_dataset):
    np.testing.assert_array_equal(load_lengths(saved_dataset / "single", column="num_tokens"), [30, 10, 50, 20])
    with pytest.raises(LengthsSourceError, match=r"'labels' not found; columns present: \['input_ids', 'num_tokens'\]"):
        load_lengths(saved_dataset / "single", column="labels")


def test_saved_dataset_dict_needs_a_split(saved_dataset):
    np.testing.assert_array_equal(load_lengths(saved_dataset / "dict", split="test"), EXPECTED[:2])
    with pytest.raises(LengthsSourceError, match=r"no split given.*\['train', 'test'\]"):
        load_lengths(saved_dataset / "dict")


def test_directory_that_is_not_a_dataset(tmp_path):
    with pytest.raises(LengthsSourceError, match="not a dataset written by save_to_disk"):
        load_lengths(tmp_path)


def test_parquet_list_column_and_integer_column(tmp_path):
    path = tmp_path / "data.parquet"
    table = pa.table({"input_ids": TOKEN_LISTS, "n": [7, 8, 9, 10]})
    pq.write_table(table, path, row_group_size=2)  # two row groups, read one by one
    np.testing.assert_array_equal(load_lengths(path), EXPECTED)
    np.testing.assert_array_equal(load_lengths(path, column="n"), [7, 8, 9, 10])


def test_parquet_bad_values_name_the_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"length": [3.0, 4.5, 2.0], "text": ["a", "b", "c"], "maybe": [1, None, 2]}), path)
    with pytest.raises(LengthsSourceError, match=r"row 1 has value 4\.5.*whole number"):
        load_lengths(path)
    with pytest.raises(LengthsSourceError, match="'text' holds text; lengths are token counts: give --tokenizer PATH"):
        load_lengths(path, column="text")
    with pytest.raises(LengthsSourceError, match="'maybe' is missing \\(null\\) at row 1"):
        load_lengths(path, column="maybe")


def test_jsonl_length_column_list_column_and_line_numbers(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"length": len(t), "input_ids": t}) for t in TOKEN_LISTS) + "\n")
    np.testing.assert_array_equal(load_lengths(path), EXPECTED)
    np.testing.assert_array_equal(load_lengths(path, column="length"), EXPECTED)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"length": 3}\n{"length": 4}\n{"length": "four"}\n')
    with pytest.raises(LengthsSourceError, match=r"line 3: column 'length' has value 'four'"):
        load_lengths(bad)
    fractional = tmp_path / "fractional.jsonl"
    fractional.write_text('{"length": 3}\n{"length": 4.25}\n')
    with pytest.raises(LengthsSourceError, match=r"line 2 has value 4\.25"):
        load_lengths(fractional)


def test_jsonl_that_is_not_json_lines(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"length": 3}\n{"length": \n')
    with pytest.raises(LengthsSourceError, match="line 2 is not valid JSON"):
        load_lengths(path)


def test_npy_integer_float_and_bad_shapes(tmp_path):
    np.save(tmp_path / "ints.npy", np.array([5, 6, 7], dtype=np.int32))
    np.testing.assert_array_equal(load_lengths(tmp_path / "ints.npy"), [5, 6, 7])
    np.save(tmp_path / "floats.npy", np.array([5.0, 6.0, np.nan]))
    with pytest.raises(LengthsSourceError, match="index 2 has value nan"):
        load_lengths(tmp_path / "floats.npy")
    np.save(tmp_path / "matrix.npy", np.ones((2, 3), dtype=np.int64))
    with pytest.raises(LengthsSourceError, match=r"shape \(2, 3\).*1-D"):
        load_lengths(tmp_path / "matrix.npy")


def test_text_one_integer_per_line(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("12\n 7 \n\n300\n")
    np.testing.assert_array_equal(load_lengths(path), [12, 7, 300])
    bad = tmp_path / "bad.txt"
    bad.write_text("12\n7\n\n3.5\n")
    with pytest.raises(LengthsSourceError, match=r"line 4: '3\.5' is not an integer"):
        load_lengths(bad)


def test_missing_file_unknown_format_empty_and_misplaced_column(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*parquet"):
        load_lengths(tmp_path / "nowhere.parquet")
    (tmp_path / "lengths.csv").write_text("1\n2\n")
    with pytest.raises(LengthsSourceError, match=r"unknown lengths format '\.csv'"):
        load_lengths(tmp_path / "lengths.csv")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(LengthsSourceError, match="no lengths found"):
        load_lengths(tmp_path / "empty.txt")
    with pytest.raises(LengthsSourceError, match="column='x' does not apply"):
        load_lengths("profile:chat-902k", column="x")


def test_profile_by_prefix_and_by_bare_name_unknown_profile_lists_names():
    assert "chat-902k" in available_profiles()
    np.testing.assert_array_equal(load_lengths("profile:chat-902k")[:100], load_lengths("chat-902k")[:100])
    with pytest.raises(LengthsSourceError, match="unknown length profile 'nope'.*chat-902k"):
        load_lengths("profile:nope")


def test_chat_902k_matches_its_definition_and_is_deterministic():
    lengths = profile_lengths("chat-902k")
    assert lengths.size == 902_000 and lengths.dtype == np.int64
    assert lengths.min() >= 16 and lengths.max() <= 8192
    # median 600 survives the clipping (both clips cut < 1% of the mass, on opposite sides)
    assert abs(float(np.median(lengths)) - 600.0) <= 6.0
    # the upper clip holds P(lognormal > 8192) = 1 - Phi(ln(8192/600)) ~ 0.45% of the samples
    assert 0.0035 < float((lengths == 8192).mean()) < 0.0055
    np.testing.assert_array_equal(lengths, profile_lengths("chat-902k"))


def test_lognormal_lengths_seed_changes_the_draw():
    first = lognormal_lengths(1000, median=100.0, sigma=0.5, min_length=1, max_length=10_000, seed=1)
    second = lognormal_lengths(1000, median=100.0, sigma=0.5, min_length=1, max_length=10_000, seed=2)
    assert not np.array_equal(first, second)


def test_empty_or_truncated_npy_is_a_lengths_error_not_an_eof_traceback(tmp_path):
    (tmp_path / "empty.npy").write_bytes(b"")
    with pytest.raises(LengthsSourceError, match=r"empty\.npy: not a readable numeric \.npy array \(EOFError"):
        load_lengths(tmp_path / "empty.npy")
    np.save(tmp_path / "whole.npy", np.arange(1, 1000, dtype=np.int64))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "whole.npy").read_bytes()[:200])
    with pytest.raises(LengthsSourceError, match=r"cut\.npy: not a readable numeric \.npy array"):
        load_lengths(tmp_path / "cut.npy")


def test_values_beyond_int64_name_the_row_instead_of_wrapping_negative(tmp_path):
    # these used to be cast to int64 silently and reported (wrongly) as negative lengths
    np.save(tmp_path / "u64.npy", np.array([5, 2**63 + 10], dtype=np.uint64))
    with pytest.raises(LengthsSourceError, match=r"array at index 1 has value 9223372036854775818, which does not fit"):
        load_lengths(tmp_path / "u64.npy")
    np.save(tmp_path / "big.npy", np.array([5.0, 7.0, 1e20]))
    with pytest.raises(LengthsSourceError, match=r"array at index 2 has value 1e\+20, which does not fit"):
        load_lengths(tmp_path / "big.npy")
    pq.write_table(pa.table({"length": pa.array([5, 2**63 + 1], pa.uint64())}), tmp_path / "u64.parquet")
    with pytest.raises(LengthsSourceError, match=r"column 'length' at row 1 has value 9223372036854775809"):
        load_lengths(tmp_path / "u64.parquet")
    (tmp_path / "big.jsonl").write_text('{"length": 5}\n{"length": 99999999999999999999}\n')
    with pytest.raises(LengthsSourceError, match=r"column 'length' at line 2 has value 1e\+20, which does not fit"):
        load_lengths(tmp_path / "big.jsonl")
    (tmp_path / "big.txt").write_text("5\n6\n99999999999999999999\n")
    with pytest.raises(LengthsSourceError, match=r"line 3: '99999999999999999999' does not fit in a 64-bit integer"):
        load_lengths(tmp_path / "big.txt")
    np.save(tmp_path / "u64ok.npy", np.array([5, 2**40], dtype=np.uint64))
    np.testing.assert_array_equal(load_lengths(tmp_path / "u64ok.npy"), [5, 2**40])


def test_split_applies_only_to_saved_datasets(tmp_path):
    np.save(tmp_path / "ints.npy", np.array([5, 6], dtype=np.int64))
    with pytest.raises(LengthsSourceError, match=r"split='train' applies only to a dataset directory"):
        load_lengths(tmp_path / "ints.npy", split="train")
    with pytest.raises(LengthsSourceError, match=r"split='train' does not apply to a profile"):
        load_lengths("profile:chat-902k", split="train")


def test_stdlib_definitions_profile_is_a_small_real_corpus():
    lengths = profile_lengths("stdlib-defs")
    assert "stdlib-defs" in available_profiles()
    assert 1000 < lengths.size < 50_000 and lengths.dtype == np.int64
    assert lengths.min() >= 1 and lengths.max() <= 8192
    assert 30 < np.median(lengths) < 400  # characters / 4 of functions and classes
    np.testing.assert_array_equal(lengths, profile_lengths("stdlib-defs"))  # deterministic
