"""Read the per-sample lengths of a dataset from any of the sources batchlab accepts.

``load_lengths(source)`` returns a 1-D int64 array, one length per sample, from:

- a Hugging Face dataset directory written by ``save_to_disk`` (``Dataset`` or ``DatasetDict``
  with ``split=``): the length of each row's ``input_ids`` by default, read from the Arrow list
  offsets (no pass over the tokens, no Python loop over rows);
- a ``.parquet`` file: a list column (its list lengths) or an integer length column;
- a ``.jsonl`` / ``.ndjson`` / ``.json`` file with one JSON object per line: same column rules;
- a ``.npy`` file holding a 1-D integer array;
- a ``.txt`` file with one integer per line (blank lines ignored);
- a bundled profile: ``profile:<name>`` or the bare profile name (see ``harness.data.profiles``).

Column rules (dataset, parquet, jsonl): ``column`` names the column; by default the first of
``input_ids``, ``length``, ``lengths``, ``num_tokens`` that exists (or the only column). A list
column gives its list lengths; a numeric column gives its values, which must be whole numbers.

Errors are :class:`LengthsSourceError` (a ``ValueError``) or ``FileNotFoundError``, and name the
file, the column, the row and the bad value, plus what to do about it. Only the format's reading
is checked here; the strategies check the values themselves (positive, within the budget).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from harness.data.chat.encode import conversation_lengths
from harness.data.chat.read import SCHEMAS
from harness.data.config import DataConfig
from harness.data.profiles import PROFILES, available_profiles, profile_lengths
from harness.data.source_rows import select_split
from harness.data.sources import column_names, detected_format
from harness.data.text_tokenize import TEXT_COLUMN, text_lengths

DEFAULT_COLUMNS = ("input_ids", "length", "lengths", "num_tokens")
PROFILE_PREFIX = "profile:"
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
SUPPORTED_FORMATS = (
    "a dataset directory written by save_to_disk, .parquet, .jsonl/.ndjson/.json (one object per "
    "line), .npy, .txt (one integer per line), or profile:<name> with <name> one of "
    + ", ".join(available_profiles())
)
# Inputs at least this large show a progress bar (on a terminal) while they are read.
PROGRESS_MIN_BYTES = 64 * 1024 * 1024


class LengthsSourceError(ValueError):
    """A lengths source that cannot be read as one integer length per sample."""


def load_lengths(
    source: str | os.PathLike[str],
    column: str | None = None,
    split: str | None = None,
    progress: bool | None = None,
) -> np.ndarray:
    """Read one length per sample from ``source`` (see the module docstring for the formats).

    Args:
        source: a path, ``profile:<name>`` or a bundled profile name.
        column: column to read for datasets, parquet and jsonl (default: see module docstring).
            Not accepted for ``.npy``, ``.txt`` or profiles.
        split: split of a saved ``DatasetDict`` (not needed when it has a single split).
        progress: show a progress bar; ``None`` shows one for large inputs when stderr is a
            terminal.

    Returns:
        1-D int64 array of lengths.

    Raises:
        FileNotFoundError: ``source`` is neither an existing path nor a bundled profile.
        LengthsSourceError: unknown format, missing column, missing split, null or non-integer
            value, empty source.
    """
    text = os.fspath(source)
    if text.startswith(PROFILE_PREFIX):
        return _load_profile(text[len(PROFILE_PREFIX) :], column, split)
    path = Path(text)
    if not path.exists():
        if text in PROFILES:
            return _load_profile(text, column, split)
        raise FileNotFoundError(
            f"lengths source {text!r} does not exist; give {SUPPORTED_FORMATS}"
        )
    if path.is_dir():
        lengths = _load_saved_dataset(path, column, split)
    else:
        if split is not None:
            raise LengthsSourceError(
                f"{path}: split={split!r} applies only to a dataset directory written by save_to_disk; "
                "drop the split option"
            )
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            lengths = _load_parquet(path, column, progress)
        elif suffix in JSONL_SUFFIXES:
            lengths = _load_jsonl(path, column, progress)
        elif suffix == ".npy":
            _reject_column(path, column, "a .npy file holds one array")
            lengths = _load_npy(path)
        elif suffix == ".txt":
            _reject_column(path, column, "a .txt file holds one integer per line")
            lengths = _load_text(path)
        else:
            raise LengthsSourceError(
                f"{path}: unknown lengths format {suffix or '(no extension)'!r}; give {SUPPORTED_FORMATS}"
            )
    if lengths.size == 0:
        raise LengthsSourceError(f"{path}: no lengths found (the source is empty)")
    return lengths


def user_lengths(source: str, column: str | None = None, split: str | None = None, tokenizer: str | None = None,
                 bad_rows: str = "refuse", cache_dir: Path | None = None,
                 progress: bool | None = None) -> tuple[np.ndarray, str]:
    """The one way in for a user's data, shared by ``batchlab-plan`` and ``batchlab-advise`` (and the samples a
    ``batchlab-train`` run tokenizes): ``(lengths, what was read)``.

    Without ``tokenizer``, :func:`load_lengths` (token id lists or integer lengths; a column of conversations or
    strings is refused, naming the option). With one (a Hugging Face tokenizer directory or a ``.gguf`` file), the
    conversations of ``source`` rendered whole with its chat template and counted, through the very cache a
    training run tokenizes with (so a plan counts the run's tokens); ``bad_rows`` as ``data.bad_rows``.
    """
    if tokenizer is None:
        return load_lengths(source, column=column, split=split, progress=progress), ""

    text = os.fspath(source)
    if text.startswith(PROFILE_PREFIX) or (text in PROFILES and not Path(text).exists()):
        raise LengthsSourceError(f"--tokenizer applies to a dataset of conversations or text, not to the bundled "
                                 f"profile {text!r} (already token counts); leave --tokenizer out")
    if column is not None and column not in (*SCHEMAS, TEXT_COLUMN):
        raise LengthsSourceError(f"--column {column!r} with --tokenizer: conversations are read from a 'messages' or "
                                 "'conversations' column and plain text from a 'text' column; leave --column out")
    path = Path(text).expanduser()
    cache = cache_dir if cache_dir is not None else DataConfig().resolved_cache_dir()
    detected = detected_format(column_names(path, split) or [])  # what a training run (data.format=auto) takes it for
    if detected == "tokenized":  # a run trains on them: their lengths are the ones to plan
        raise LengthsSourceError(f"{path} has an input_ids column: a training run uses those token ids, so their "
                                 "lengths are the ones to plan; leave --tokenizer out")
    if column == TEXT_COLUMN or (column is None and detected == "text"):
        lengths, words = text_lengths(path, split, tokenizer, cache, bad_rows=bad_rows, progress=progress is not False)
        return lengths, f"{words}, tokenized by {tokenizer}"
    lengths, words = conversation_lengths(path, split, tokenizer, cache, bad_rows=bad_rows,
                                          progress=progress is not False)
    return lengths, f"{words}, chat template of {tokenizer}"


# -- formats -------------------------------------------------------------------------------------
def _load_profile(name: str, column: str | None, split: str | None) -> np.ndarray:
    _reject_column(Path(PROFILE_PREFIX + name), column, "a profile is a list of lengths")
    if split is not None:
        raise LengthsSourceError(f"{PROFILE_PREFIX}{name}: split={split!r} does not apply to a profile; drop it")
    try:
        return profile_lengths(name)
    except ValueError as err:
        raise LengthsSourceError(str(err)) from None


def _load_saved_dataset(path: Path, column: str | None, split: str | None) -> np.ndarray:
    if not ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        raise LengthsSourceError(
            f"{path}: directory is not a dataset written by save_to_disk (no state.json or "
            f"dataset_dict.json); give {SUPPORTED_FORMATS}"
        )
    import datasets  # imported here: slow to import and only this format needs it

    loaded, split = select_split(datasets.load_from_disk(str(path)), split, path, LengthsSourceError,
                                 option="split= (--split on the command line)", drop_fix="")
    name = _pick_column(path, loaded.column_names, column)
    # The "arrow" format hands back the column as a pyarrow ChunkedArray (indices mapping applied);
    # list lengths then come from the Arrow offsets without touching the token values.
    arrow_column = loaded.with_format("arrow")[name]
    return _arrow_to_lengths(arrow_column, path, name, row_word="row")


def _load_parquet(path: Path, column: str | None, progress: bool | None) -> np.ndarray:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise LengthsSourceError(f"{path}: not a readable parquet file ({err})") from None
    name = _pick_column(path, parquet.schema_arrow.names, column)
    show = _show_progress(progress, path)
    parts = []
    with _progress_bar(show, total=parquet.metadata.num_rows, desc=f"reading {path.name}") as bar:
        for group in range(parquet.num_row_groups):
            chunk = parquet.read_row_group(group, columns=[name]).column(name)
            parts.append(chunk)
            bar.update(len(chunk))
    chunks = [c for part in parts for c in part.chunks]
    arrow_column = pa.chunked_array(chunks, type=parquet.schema_arrow.field(name).type)
    return _arrow_to_lengths(arrow_column, path, name, row_word="row")


def _load_jsonl(path: Path, column: str | None, progress: bool | None) -> np.ndarray:
    import pyarrow.json as pj

    show = _show_progress(progress, path)
    batches = []
    try:
        reader = pj.open_json(path)
        with _progress_bar(show, total=None, desc=f"reading {path.name}", unit=" rows") as bar:
            for batch in reader:
                batches.append(batch)
                bar.update(batch.num_rows)
    except pa.ArrowInvalid as err:
        # pyarrow's message names a row of one block only; find the exact line ourselves.
        _raise_jsonl_problem(path, column, err)
    if not batches:
        raise LengthsSourceError(f"{path}: no lengths found (the file has no JSON objects)")
    table = pa.Table.from_batches(batches)
    name = _pick_column(path, table.column_names, column)
    return _arrow_to_lengths(table.column(name), path, name, row_word="line", row_base=1)


def _load_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OSError) as err:  # EOFError: empty or truncated file
        raise LengthsSourceError(
            f"{path}: not a readable numeric .npy array ({type(err).__name__}: {err}); save lengths with "
            "np.save as an int64 array"
        ) from None
    if array.ndim != 1:
        raise LengthsSourceError(
            f"{path}: array has shape {array.shape}; expected a 1-D array of lengths (use .ravel() before saving)"
        )
    if array.dtype.kind in "iuf":
        return _to_int64(np.asarray(array), path, "array", row_word="index", row_base=0)
    raise LengthsSourceError(f"{path}: array dtype {array.dtype} is not numeric; save lengths as int64")


def _load_text(path: Path) -> np.ndarray:
    lines = path.read_bytes().splitlines()
    tokens = [line.strip() for line in lines]
    nonblank = [token for token in tokens if token]
    words = np.array(nonblank) if nonblank else np.zeros(0, dtype="S1")
    try:
        return words.astype(np.int64)
    except (ValueError, OverflowError):
        pass
    # Error path only: find the first line numpy could not parse and report it.
    int64 = np.iinfo(np.int64)
    for line_number, token in enumerate(tokens, start=1):
        if token:
            shown = token.decode("utf-8", errors="replace")
            try:
                value = int(token)
            except ValueError:
                raise LengthsSourceError(
                    f"{path}: line {line_number}: {shown!r} is not an integer; a .txt lengths file "
                    "holds one whole number per line"
                ) from None
            if not int64.min <= value <= int64.max:
                raise LengthsSourceError(
                    f"{path}: line {line_number}: {shown!r} does not fit in a 64-bit integer; no sample is "
                    "that long (check the file for corrupt values)"
                )
    raise LengthsSourceError(f"{path}: could not parse the file as one integer per line")


# -- helpers -------------------------------------------------------------------------------------
def _reject_column(path: Path, column: str | None, why: str) -> None:
    if column is not None:
        raise LengthsSourceError(f"{path}: column={column!r} does not apply ({why}); drop the column option")


def _pick_column(path: Path, present: list[str], column: str | None) -> str:
    if column is not None:
        if column not in present:
            raise LengthsSourceError(
                f"{path}: column {column!r} not found; columns present: {present}"
            )
        return column
    for candidate in DEFAULT_COLUMNS:
        if candidate in present:
            return candidate
    if len(present) == 1:
        return present[0]
    raise LengthsSourceError(
        f"{path}: none of the default length columns {list(DEFAULT_COLUMNS)} found; columns present: "
        f"{present} — choose one with column= (--column on the command line)"
    )


def _arrow_to_lengths(
    arrow_column: pa.ChunkedArray | pa.Array, path: Path, name: str, row_word: str, row_base: int = 0
) -> np.ndarray:
    """Lengths from an Arrow column: list lengths of a list column, or whole-number values."""
    if isinstance(arrow_column, pa.Array):
        arrow_column = pa.chunked_array([arrow_column])
    kind = arrow_column.type
    if arrow_column.null_count:
        first_null = int(np.flatnonzero(pc.is_null(arrow_column).to_numpy(zero_copy_only=False))[0])
        raise LengthsSourceError(
            f"{path}: column {name!r} is missing (null) at {row_word} {first_null + row_base}; "
            "every sample needs a length"
        )
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        items = kind.value_type
        if not (pa.types.is_integer(items) or pa.types.is_null(items)):
            # counting a list of turns or strings would plan turns (or words) as if they were tokens
            what = ("conversations (lists of turns)" if pa.types.is_struct(items)
                    else f"lists of {items}, not token ids")
            raise LengthsSourceError(
                f"{path}: column {name!r} holds {what}; lengths are token counts: give a column of token "
                "id lists (input_ids) or integer lengths, or for conversations --tokenizer DIR (each rendered with "
                "the tokenizer's chat template and its tokens counted)")
        lengths = pc.list_value_length(arrow_column)
        return np.ascontiguousarray(lengths.to_numpy(zero_copy_only=False), dtype=np.int64)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        values = arrow_column.to_numpy(zero_copy_only=False)
        return _to_int64(values, path, f"column {name!r}", row_word, row_base)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        raise LengthsSourceError(
            f"{path}: column {name!r} holds text; lengths are token counts: give --tokenizer PATH (the target's "
            "tokenizer directory or .gguf file) to count each text's tokens, or a column of token id lists or "
            "integer lengths")
    raise LengthsSourceError(
        f"{path}: column {name!r} has type {kind}; expected a list column (its list lengths are "
        "used) or integer lengths — choose another column"
    )


def _to_int64(values: np.ndarray, path: Path, what: str, row_word: str, row_base: int) -> np.ndarray:
    """Integer or float values as int64, refusing fractions, NaN/inf and values int64 cannot hold."""
    if values.dtype.kind == "f":
        bad = ~np.isfinite(values) | (values != np.rint(values))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise LengthsSourceError(
                f"{path}: {what} at {row_word} {row + row_base} has value {values[row].item()!r}, not a whole "
                "number of tokens; lengths must be integers"
            )
        too_large = np.abs(values) >= float(2**63)
    elif values.dtype.kind == "u" and values.dtype.itemsize == 8:
        too_large = values > np.iinfo(np.int64).max
    else:
        too_large = np.zeros(values.shape, dtype=bool)
    if too_large.any():
        row = int(np.flatnonzero(too_large)[0])
        raise LengthsSourceError(
            f"{path}: {what} at {row_word} {row + row_base} has value {values[row].item()!r}, which does not fit "
            "in a 64-bit integer; no sample is that long (check the source for corrupt values)"
        )
    return np.ascontiguousarray(values, dtype=np.int64)


def _raise_jsonl_problem(path: Path, column: str | None, err: Exception) -> None:
    """Scan a JSONL file line by line (error path only) and raise on the first bad line."""
    names: list[str] | None = None
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as decode_error:
                raise LengthsSourceError(
                    f"{path}: line {line_number} is not valid JSON ({decode_error.msg}); expected one "
                    "JSON object per line"
                ) from None
            if not isinstance(record, dict):
                raise LengthsSourceError(
                    f"{path}: line {line_number} holds a {type(record).__name__}, not a JSON object; "
                    "expected one object per line"
                )
            if names is None:
                names = list(record)
                name = _pick_column(path, names, column)
            value = record.get(name)
            ok = isinstance(value, list) or (
                isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
            )
            if not ok:
                raise LengthsSourceError(
                    f"{path}: line {line_number}: column {name!r} has value {value!r}; expected a list "
                    "or a whole number of tokens"
                )
    raise LengthsSourceError(f"{path}: could not read as JSON lines ({err})")


def _show_progress(progress: bool | None, path: Path) -> bool | None:
    """tqdm's ``disable`` semantics inverted: None = only on a terminal, for large files only."""
    if progress is None:
        return None if path.stat().st_size >= PROGRESS_MIN_BYTES else False
    return progress


def _progress_bar(show: bool | None, total: int | None, desc: str, unit: str = " rows"):
    from tqdm import tqdm

    # tqdm's disable=None turns the bar off when stderr is not a terminal.
    disable = None if show is None else not show
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, leave=False, unit_scale=True)
