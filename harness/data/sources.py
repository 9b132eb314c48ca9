"""Tokenized samples from outside the embedded corpus.

Accepted sources (``DataConfig.source``):

- a directory written by ``datasets`` ``save_to_disk``: a ``Dataset``, or a ``DatasetDict`` with
  ``split`` (optional when it has one split);
- a ``.parquet`` file;
- a ``.jsonl`` / ``.ndjson`` / ``.json`` file with one JSON object per line.

Columns: ``input_ids`` (required, a list of integers per row) and ``loss_mask`` (optional, a list
of 0/1 or booleans per row, same length as ``input_ids``). A missing ``loss_mask`` means every
token is supervised except the first (it has nothing to predict it from). Other columns are
ignored.

Everything stays memory-mapped Arrow: a saved dataset is used in place; parquet and JSON lines are
converted once into an Arrow file in the batchlab cache (keyed by the file's path, size and mtime);
a missing ``loss_mask`` is written once as an Arrow column in the cache and joined on. No sample is
ever materialised as a Python list.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from harness.data import cache
from harness.data.chat.corpus import stdlib_chat
from harness.data.chat.encode import tokenized_conversations
from harness.data.chat.read import conversation_column, first_array_element, is_json_array
from harness.data.config import STDLIB_CHAT_SOURCE, DataConfig
from harness.data.errors import DataValidationError
from harness.data.source_rows import default_loss_mask, select_split
from harness.data.text_tokenize import has_text_column, tokenized_texts

FORMAT_VERSION = 1
SOURCE_PREFIX = "source"
DATA_FILE = "data.arrow"
MASK_FILE = "loss_mask.arrow"
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
SUPPORTED = (
    "'stdlib' (the embedded corpus), a directory written by datasets' save_to_disk, a .parquet file, "
    "or a .jsonl file (one JSON object per line) with an input_ids column (or conversations, or a text column with "
    "data.tokenizer)"
)
# Rows per record batch written into the cache (datasets writes 1000).
WRITE_BATCH_ROWS = 1000
JSON_BLOCK_BYTES = 64 << 20


class DataSourceError(DataValidationError):
    """A source that cannot be read as tokenized samples."""


@dataclass
class LoadedSource:
    dataset: object  # datasets.Dataset with input_ids and loss_mask
    description: str
    fingerprint: str
    tokenizer_path: str | None = None  # conversations: the tokenizer whose chat template was applied
    vocab_size: int | None = None


def load_source(cfg: DataConfig, progress: bool = True) -> LoadedSource:
    """Open ``cfg.source`` (not the embedded corpus) as a memory-mapped ``datasets.Dataset``; conversations are
    tokenized with their chat template first (cached)."""
    if cfg.source == STDLIB_CHAT_SOURCE:
        conversations, tokenizer, _ = stdlib_chat(cfg, progress=progress)
        return _load_conversations(conversations, cfg, progress, tokenizer=cfg.tokenizer or str(tokenizer))
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data.source={cfg.source!r} does not exist; give {SUPPORTED}")
    path = path.resolve()
    if _is_conversations(path, cfg):
        return _load_conversations(path, cfg, progress, tokenizer=cfg.tokenizer)
    if _is_text(path, cfg):
        return _load_texts(path, cfg, progress, tokenizer=cfg.tokenizer)
    if path.is_dir():
        return _load_saved(path, cfg, progress)
    if cfg.split is not None:
        raise DataSourceError(
            f"{path}: data.split={cfg.split!r} applies only to a dataset directory written by "
            "save_to_disk; set data.split to null"
        )
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        kind = "parquet"
    elif suffix in JSONL_SUFFIXES:
        kind = "jsonl"
    else:
        raise DataSourceError(f"{path}: unknown data format {suffix or '(no extension)'!r}; give {SUPPORTED}")
    fingerprint = cache.digest(
        {"format": FORMAT_VERSION, "kind": kind, "file": cache.file_signature(path)}
    )

    def build(tmp: Path) -> dict:
        rows, has_mask = _convert(path, kind, tmp / DATA_FILE, progress)
        return {"source": str(path), "kind": kind, "rows": rows, "loss_mask_given": has_mask}

    entry, meta, _ = cache.ensure_entry(cfg.resolved_cache_dir(), SOURCE_PREFIX, fingerprint, build)
    import datasets

    dataset = datasets.Dataset.from_file(str(entry / DATA_FILE))
    note = "" if meta.get("loss_mask_given") else ", loss_mask filled (all but the first token)"
    return LoadedSource(dataset, f"{kind} {path} ({len(dataset)} rows{note})", fingerprint)


# -- conversations -------------------------------------------------------------------------------
def _is_conversations(path: Path, cfg: DataConfig) -> bool:
    """``data.format``, or for ``auto`` whether the source has a conversation column and no input_ids."""
    return _format_of(path, cfg) == "conversations"


def _is_text(path: Path, cfg: DataConfig) -> bool:
    """``data.format=text``, or for ``auto`` whether the source has a ``text`` column and no input_ids (nor
    conversations, which come first)."""
    return _format_of(path, cfg) == "text"


def _format_of(path: Path, cfg: DataConfig) -> str | None:
    if cfg.format != "auto":
        return cfg.format
    names = column_names(path, cfg.split)
    return None if names is None else detected_format(names)


def detected_format(names: list[str]) -> str | None:
    """What ``data.format=auto`` takes a source with these columns for: ``tokenized`` (it has ``input_ids``),
    ``conversations`` (a conversation column), ``text`` (a ``text`` column), in that order; None: none of them."""

    if "input_ids" in names:
        return "tokenized"
    if conversation_column(names) is not None:
        return "conversations"
    return "text" if has_text_column(names) else None


def column_names(path: Path, split: str | None) -> list[str] | None:
    """The source's columns (the first line's keys for JSON lines); None when they cannot be read here."""
    import json

    try:
        if path.is_dir():
            import datasets

            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded[split] if split in loaded else next(iter(loaded.values()))
            return loaded.column_names
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).schema_arrow.names

        if is_json_array(path):  # a JSON array (ShareGPT's own files): its first element's keys
            record = first_array_element(path)
            return list(record) if isinstance(record, dict) else None
        with path.open() as lines:
            first = next((line for line in lines if line.strip()), "")
        record = json.loads(first) if first else None
        return list(record) if isinstance(record, dict) else None
    except (OSError, ValueError, pa.ArrowInvalid):
        return None  # the tokenized path names the problem


def _load_conversations(path: Path, cfg: DataConfig, progress: bool, tokenizer: str | None) -> LoadedSource:

    if tokenizer is None:
        raise DataSourceError(
            f"{path} holds conversations: give data.tokenizer=DIR, a local Hugging Face tokenizer directory with "
            "the target's chat template (a pretrained target's checkpoint gives its own), or data.source="
            "stdlib-chat for the embedded chat corpus")
    arrow, meta, fingerprint = tokenized_conversations(Path(path), cfg.split, tokenizer, cfg.incomplete,
                                                       cfg.resolved_cache_dir(), progress, cfg.bad_rows)
    import datasets

    dataset = datasets.Dataset.from_file(str(arrow))
    description = (f"{meta['words']} from {path}, chat template of {meta['tokenizer']} (assistant-only loss "
                   f"mask from its {meta['mask']})")
    return LoadedSource(dataset, description, fingerprint, tokenizer_path=meta["tokenizer"],
                        vocab_size=int(meta["vocab_size"]))


def _load_texts(path: Path, cfg: DataConfig, progress: bool, tokenizer: str | None) -> LoadedSource:

    if tokenizer is None:
        raise DataSourceError(f"{path} holds plain text: give data.tokenizer=PATH, the target's tokenizer (a local "
                              "Hugging Face tokenizer directory or a .gguf file), to tokenize it")
    arrow, meta, fingerprint = tokenized_texts(Path(path), cfg.split, tokenizer, cfg.resolved_cache_dir(), progress,
                                               cfg.bad_rows)
    import datasets

    dataset = datasets.Dataset.from_file(str(arrow))
    description = f"{meta['words']} from {path}, tokenized by {meta['tokenizer']} (every token but the first trained)"
    return LoadedSource(dataset, description, fingerprint, tokenizer_path=meta["tokenizer"],
                        vocab_size=int(meta["vocab_size"]))


# -- save_to_disk directories --------------------------------------------------------------------
def _load_saved(path: Path, cfg: DataConfig, progress: bool) -> LoadedSource:
    if not ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        raise DataSourceError(
            f"{path}: directory is not a dataset written by save_to_disk (no state.json or "
            f"dataset_dict.json); give {SUPPORTED}"
        )
    import datasets

    loaded, split = select_split(datasets.load_from_disk(str(path)), cfg.split, path, DataSourceError,
                                 option="data.split", drop_fix="; set data.split to null")
    columns = loaded.column_names
    _check_columns(path, loaded.features.arrow_schema, "row")
    fingerprint = cache.digest(
        {"format": FORMAT_VERSION, "kind": "save_to_disk", "root": str(path), "split": split,
         "files": cache.tree_signature(path)}
    )
    dataset = loaded.select_columns([c for c in ("input_ids", "loss_mask") if c in columns])
    note = ""
    if "loss_mask" not in columns:
        ids = dataset.with_format("arrow")["input_ids"]

        def build(tmp: Path) -> dict:
            schema = pa.schema([("loss_mask", _list_type_like(ids.type, pa.int8()))])
            with pa.OSFile(str(tmp / MASK_FILE), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
                for start in range(0, len(ids), WRITE_BATCH_ROWS):
                    part = ids.slice(start, WRITE_BATCH_ROWS)
                    writer.write_batch(pa.record_batch([default_loss_mask(part)], schema=schema))
            return {"source": str(path), "split": split, "rows": len(ids)}

        entry, _, _ = cache.ensure_entry(cfg.resolved_cache_dir(), SOURCE_PREFIX + "-mask", fingerprint, build)
        mask = datasets.Dataset.from_file(str(entry / MASK_FILE))
        dataset = datasets.concatenate_datasets([dataset, mask], axis=1)
        note = ", loss_mask filled (all but the first token)"
    where = f"{path} split {split!r}" if split is not None else str(path)
    return LoadedSource(dataset, f"dataset {where} ({len(dataset)} rows{note})", fingerprint)


# -- parquet / JSON lines ------------------------------------------------------------------------
def _convert(path: Path, kind: str, out: Path, progress: bool) -> tuple[int, bool]:
    """Stream ``path`` into an Arrow file holding input_ids and loss_mask. Returns (rows, has_mask)."""
    from tqdm import tqdm

    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as err:
            raise DataSourceError(f"{path}: not a readable parquet file ({err})") from None
        schema = parquet.schema_arrow
        _check_columns(path, schema, "row")
        names = [c for c in ("input_ids", "loss_mask") if c in schema.names]
        batches = parquet.iter_batches(columns=names, batch_size=WRITE_BATCH_ROWS)
        total = parquet.metadata.num_rows
    else:
        import pyarrow.json as pj

        try:
            # Blocks large enough for one very long sample per line (the default is 1 MiB).
            reader = pj.open_json(path, read_options=pj.ReadOptions(block_size=JSON_BLOCK_BYTES))
        except pa.ArrowInvalid as err:
            raise DataSourceError(
                f"{path}: not readable as JSON lines ({_first_bad_json_line(path) or err}); expected one JSON "
                "object per line"
            ) from None
        schema = reader.schema
        _check_columns(path, schema, "line")
        batches = reader
        total = None
    has_mask = "loss_mask" in schema.names
    ids_type = schema.field("input_ids").type
    out_schema = pa.schema(
        [("input_ids", ids_type),
         ("loss_mask", schema.field("loss_mask").type if has_mask else _list_type_like(ids_type, pa.int8()))]
    )
    rows = 0
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_stream(sink, out_schema) as writer, tqdm(
        total=total, desc=f"converting {path.name}", unit=" rows", disable=not progress, leave=False
    ) as bar:
        try:
            for batch in batches:
                for start in range(0, batch.num_rows, WRITE_BATCH_ROWS):
                    part = batch.slice(start, WRITE_BATCH_ROWS)
                    ids = part.column(part.schema.get_field_index("input_ids"))
                    mask = (part.column(part.schema.get_field_index("loss_mask")) if has_mask
                            else default_loss_mask(ids))
                    writer.write_batch(pa.record_batch([ids, mask], schema=out_schema))
                    rows += part.num_rows
                    bar.update(part.num_rows)
            bar.refresh()  # its last state shows every row, not the count of its first draw
        except pa.ArrowInvalid as err:
            where = _first_bad_json_line(path) if path.suffix != ".parquet" else None
            raise DataSourceError(
                f"{path}: could not read the file ({where or err}); check that every line (row) has input_ids as "
                "a list of integers"
            ) from None
    return rows, has_mask


# -- helpers -------------------------------------------------------------------------------------
def _first_bad_json_line(path: Path) -> str | None:
    """``line 51: ...`` for the first line of a JSON-lines file that is not a JSON object whose input_ids (and
    loss_mask) are lists of integers; None when every line is. Only on the error path: pyarrow's messages
    count rows from 0 within a block, not the file's lines."""
    import json

    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\n"))
            except json.JSONDecodeError as err:
                return f"line {number} is not valid JSON: {err.msg} at column {err.colno}"
            if not isinstance(record, dict):
                return f"line {number} is a JSON {type(record).__name__}, not an object"
            for column in ("input_ids", "loss_mask"):
                value = record.get(column)
                if column in record and not (isinstance(value, list) and all(
                        isinstance(v, int) and not isinstance(v, bool) for v in value)):
                    return f"line {number}: {column} is not a list of integers ({json.dumps(value)[:60]})"
    return None


def _check_columns(path: Path, schema: pa.Schema, row_word: str) -> None:
    names = list(schema.names)
    if "input_ids" not in names:
        raise DataSourceError(
            f"{path}: no 'input_ids' column; columns found: {names} — tokenize the data with the target's "
            "tokenizer and store the token ids of each sample in an input_ids column"
        )
    for name in ("input_ids", "loss_mask"):
        if name in names and not _is_int_list(schema.field(name).type, allow_bool=name == "loss_mask"):
            raise DataSourceError(
                f"{path}: column {name!r} has type {schema.field(name).type}; expected a list of "
                f"{'integers' if name == 'input_ids' else '0/1 integers or booleans'} per {row_word}"
            )


def _is_int_list(kind: pa.DataType, allow_bool: bool) -> bool:
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return False
    value = kind.value_type
    return pa.types.is_integer(value) or (allow_bool and pa.types.is_boolean(value))


def _list_type_like(kind: pa.DataType, value: pa.DataType) -> pa.DataType:
    return pa.large_list(value) if pa.types.is_large_list(kind) else pa.list_(value)


