"""Plain text to training samples: a ``text`` column tokenized by the user's tokenizer (a Hugging Face tokenizer
directory or a ``.gguf`` file), every token supervised but the first (nothing predicts it), as for pre-tokenized
rows without a ``loss_mask``.

The whole source is read once before anything is tokenized, and every bad row is reported together (a count per
kind, the first few of each, named by row or line): text that is not a string, empty text, a row without the
column, a line that is not JSON; ``data.bad_rows=drop`` leaves them out, counted. The texts are tokenized in
batches by the fast tokenizer (one call per batch, on every core) with the tokenizer's own special tokens (e.g.
a BOS it adds), and cached like the other sources: one Arrow file of ``input_ids`` and ``loss_mask`` keyed by the
file, the tokenizer's files and ``data.bad_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.data import cache
from harness.data.chat.encode import plain_backend, sample_lengths, write_samples
from harness.data.chat.read import NO_COLUMN, NOT_TEXT, BadRow, BadRows, source_records
from harness.data.config import BAD_ROWS_CHOICES
from harness.data.errors import DataValidationError
from harness.data.hf_tokenizer import load_hf_tokenizer

FORMAT_VERSION = 1
PREFIX = "text"
DATA_FILE = "data.arrow"
TEXT_COLUMN = "text"
EMPTY_TEXT = "empty text"
NO_TEXT_KEY = "no text key"  # the shared reader's "no conversation key", for a text source
ENCODE_BATCH = 512


class TextError(DataValidationError):
    """Text rows the trainer cannot use (named by row, with the fix)."""


@dataclass
class TextRows:
    """The texts a source holds, ``(where, text)`` in order, and the bad rows found."""

    rows: list[tuple[str, str]] = field(default_factory=list)
    bad: BadRows = field(default_factory=BadRows)
    read: int = 0
    notes: list[str] = field(default_factory=list)

    def words(self) -> str:
        dropped = f", {self.bad.total} bad dropped ({self.bad.words()})" if self.bad.total else ""
        return f"{len(self.rows)} texts ({TEXT_COLUMN!r} column){dropped}" + "".join(f"; {n}" for n in self.notes)


def has_text_column(names: list[str]) -> bool:
    return TEXT_COLUMN in names


def _text_column(path: Path, names: list[str]) -> str:
    if TEXT_COLUMN not in names:
        raise TextError(f"{path}: no {TEXT_COLUMN!r} column (columns: {names}); give plain text in a 'text' column, "
                        "conversations in a 'messages' or 'conversations' column, or token ids in 'input_ids'")
    return TEXT_COLUMN


def read_texts(path: Path, split: str | None, bad_rows: str = "refuse") -> TextRows:
    """Every text of ``path``'s ``text`` column, checked; every bad row refused together, or dropped and counted."""
    if bad_rows not in BAD_ROWS_CHOICES:
        raise TextError(f"data.bad_rows={bad_rows!r}: choose one of {list(BAD_ROWS_CHOICES)}")
    records, _, notes = source_records(path, split, pick=_text_column, error=TextError)
    out = TextRows(notes=notes)
    for where, value in records:
        out.read += 1
        try:
            out.rows.append((where, _checked(value, f"{path}: {where}")))
        except BadRow as problem:
            out.bad.add(problem)
    if out.bad.total and bad_rows == "refuse":
        raise TextError(out.bad.report(path, out.read, "nothing was tokenized", what="rows"))
    if not out.rows:
        raise TextError(f"{path}: no text is left of {out.read} rows ({out.bad.total} bad dropped)")
    return out


def _checked(value: Any, where: str) -> str:
    if isinstance(value, BadRow):  # the row itself could not be read (not JSON, no text key)
        raise BadRow(NO_TEXT_KEY, str(value)) if value.kind == NO_COLUMN else value
    if not isinstance(value, str):
        raise BadRow(NOT_TEXT, f"{where}: {TEXT_COLUMN!r} is {type(value).__name__} {str(value)[:40]!r}, not text; "
                               "give the row's text as a string")
    if not value.strip():
        raise BadRow(EMPTY_TEXT, f"{where}: empty text; give the row's text or remove the row")
    return value


def tokenized_texts(path: Path, split: str | None, tokenizer_path: str | Path, cache_dir: Path,
                    progress: bool = True, bad_rows: str = "refuse") -> tuple[Path, dict, str]:
    """The cached Arrow file of ``path``'s texts tokenized: ``(file, meta, fingerprint)``."""

    location = Path(tokenizer_path).expanduser()
    fingerprint = cache.digest({"format": FORMAT_VERSION, "source": cache.path_signature(path), "split": split,
                                "tokenizer": cache.path_signature(location), "bad_rows": bad_rows})

    def build(tmp: Path) -> dict:
        from tqdm import tqdm

        texts = read_texts(path, split, bad_rows)  # refuses before tokenizing
        tokenizer = load_hf_tokenizer(location)
        backend = plain_backend(tokenizer)  # each text alone: no padding or truncation a tokenizer.json switches on
        parts: list[np.ndarray] = []
        with tqdm(total=len(texts.rows), desc=f"tokenize {path.name}", unit=" texts", disable=not progress,
                  leave=False) as bar:
            for start in range(0, len(texts.rows), ENCODE_BATCH):
                batch = [text for _, text in texts.rows[start:start + ENCODE_BATCH]]
                parts += [np.asarray(encoding.ids, dtype=np.int32) for encoding in backend.encode_batch(batch)]
                bar.update(len(batch))
        write_samples(tmp / DATA_FILE, parts)  # every token supervised but each text's first
        return {"source": str(path), "rows": len(parts), "bad": texts.bad.counts, "tokenizer": str(location),
                "vocab_size": len(tokenizer), "words": texts.words()}

    entry, meta, _ = cache.ensure_entry(cache_dir, PREFIX, fingerprint, build)
    return entry / DATA_FILE, meta, fingerprint


def text_lengths(path: Path, split: str | None, tokenizer_path: str | Path, cache_dir: Path, bad_rows: str = "refuse",
                 progress: bool = True) -> tuple[np.ndarray, str]:
    """The token count of every text of ``path`` (the cache a training run tokenizes with), and what was read."""

    arrow, meta, _ = tokenized_texts(path, split, tokenizer_path, cache_dir, progress, bad_rows)
    return sample_lengths(arrow), meta["words"]
