"""The data layer's entry point: tokenized samples, the held-out split, and validation.

``load_samples(cfg)`` opens the samples ``cfg.source`` names (the embedded stdlib corpus, built and
cached on first use, or a saved dataset / parquet / JSON lines file) as a memory-mapped
``datasets.Dataset`` with ``input_ids`` and ``loss_mask``, plus one length per row read from the
Arrow list offsets.

``heldout_split(n, cfg)`` splits row indices into train and held-out sets from ``cfg.heldout_*``
only: the same held-out rows for every strategy and run seed. ``validation_split(train, cfg)`` sets a
validation split aside from the training rows (``cfg.validation_*``), for tuning without the test rows.

``validate_samples(...)`` checks the rows a run will use against the target's vocabulary and the
drafter's block size, vectorised over Arrow buffers (no Python loop over rows): ids in range,
``loss_mask`` aligned with ``input_ids``, no empty or null samples, and at least one position that
can anchor a block (``loss_mask[p] and loss_mask[p+1]`` and ``p <= len - block_size``); rows with no
anchor are dropped and counted, or rejected.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from harness.data import bundled
from harness.data.config import NO_ANCHOR_CHOICES, DataConfig
from harness.data.corpus_cache import stdlib_samples
from harness.data.errors import DataValidationError
from harness.data.sources import load_source
from harness.data.subset import cut_subset

__all__ = [
    "DataConfig",
    "DataValidationError",
    "TokenizedSamples",
    "ValidationReport",
    "heldout_split",
    "load_samples",
    "validate_samples",
    "validation_split",
]

# Tokens per window of the anchor scan: bounds its temporary arrays (about 9 bytes per token).
SCAN_WINDOW_TOKENS = 1 << 22
# Rows named in an error that lists several.
SHOWN_ROWS = 5


@dataclass(eq=False)
class TokenizedSamples:
    """Tokenized samples, memory-mapped.

    Attributes:
        dataset: columns ``input_ids`` and ``loss_mask`` (filled when the source lacks it), plus
            ``module`` and ``name`` for the embedded corpus.
        lengths: int64, one per row.
        source: human-readable description.
        fingerprint: sha256 hex of the data identity (cache hash; or the source files' paths, sizes
            and mtimes with the split and options).
        tokenizer_path: ``tokenizer.json`` of the embedded corpus, the tokenizer directory whose chat template
            made the samples of conversations, else None.
        vocab_size: the tokenizer's vocabulary size when known, else None.
    """

    dataset: object
    lengths: np.ndarray
    source: str
    fingerprint: str
    tokenizer_path: str | None = None
    vocab_size: int | None = None
    _table: pa.Table | None = field(default=None, init=False, repr=False, compare=False)
    _readers: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.lengths.size)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int64 [L], loss_mask bool [L])`` of one row."""
        return self.samples([index])[0]

    def samples(self, indices: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Rows ``indices`` in order, each as ``(input_ids int64, loss_mask bool)``.

        Rows are read straight from the Arrow buffers through their list offsets (no gather of the
        column, which for a many-chunk memory-mapped dataset would copy it whole). Safe to call in
        forked or spawned DataLoader workers (the object pickles by file path, not by content)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise IndexError(f"row {bad} out of range for {n} samples")
        idx = np.where(idx < 0, idx + n, idx)
        if self._readers is None:
            table = self._arrow_table()
            self._readers = (_RowReader(table.column("input_ids")), _RowReader(table.column("loss_mask")))
        ids_reader, mask_reader = self._readers
        out = []
        for row in idx.tolist():
            # Fresh writable arrays (views of Arrow buffers are read-only, and may be memory-mapped).
            out.append((ids_reader.row(row).astype(np.int64), mask_reader.row(row) != 0))
        return out

    def _arrow_table(self) -> pa.Table:
        """The input_ids and loss_mask columns as one pyarrow Table (indices mapping applied)."""
        if self._table is None:
            dataset = self.dataset.select_columns(["input_ids", "loss_mask"])
            if getattr(dataset, "_indices", None) is not None:
                dataset = dataset.flatten_indices()
            table = dataset.data
            self._table = table.table if hasattr(table, "table") else table
        return self._table

    def column(self, name: str) -> pa.ChunkedArray:
        """A column of the whole dataset as a pyarrow ChunkedArray (no copy)."""
        if name in ("input_ids", "loss_mask"):
            return self._arrow_table().column(name)
        return self.dataset.with_format("arrow")[name]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_table"] = None  # rebuilt lazily; the dataset itself pickles by file path
        state["_readers"] = None
        return state


def load_samples(
    cfg: DataConfig,
    progress: bool = True,
    *,
    corpus_root: str | None = None,
    corpus_files: Sequence[str] | None = None,
) -> TokenizedSamples:
    """Open the samples ``cfg.source`` names.

    Args:
        cfg: data options.
        progress: progress bars on stderr while building or converting.
        corpus_root, corpus_files: embedded corpus only — another code tree (and/or file list) to
            parse instead of the standard library (tests use small trees).

    Raises:
        FileNotFoundError: the source does not exist.
        DataValidationError: unreadable format, no ``input_ids`` column, wrong column types, missing
            or ambiguous split.
    """
    import datasets

    if cfg.source in bundled.SHIPPED_DATA:
        return _cut(_shipped_samples(cfg, corpus_root, corpus_files), cfg)
    if cfg.is_stdlib:
        if cfg.split is not None:
            raise DataValidationError(
                f"data.split={cfg.split!r} applies only to a DatasetDict written by save_to_disk, not to "
                "data.source='stdlib'; set data.split to null"
            )

        build = stdlib_samples(cfg, progress=progress, root=corpus_root, files=corpus_files)
        dataset = datasets.load_from_disk(str(build.path))
        meta = build.meta
        corpus = meta["corpus"]
        subset = "all" if cfg.max_documents is None else f"seeded subset (seed {cfg.subset_seed})"
        description = (
            f"stdlib corpus of Python {corpus['python']} at {corpus['root']}: {meta['num_samples']} of "
            f"{corpus['documents']} definitions ({subset}), "
            + (f"byte-level BPE vocab {meta['vocab_size']}" if cfg.tokenizer is None else
               f"tokenizer {cfg.tokenizer} (vocab {meta['vocab_size']})")
        )
        samples = TokenizedSamples(
            dataset=dataset,
            lengths=_lengths(dataset),
            source=description,
            fingerprint=build.key,
            tokenizer_path=str(build.tokenizer_path),
            vocab_size=int(meta["vocab_size"]),
        )
    else:
        if corpus_root is not None or corpus_files is not None:
            raise ValueError("corpus_root / corpus_files apply only to data.source='stdlib'")

        loaded = load_source(cfg, progress=progress)
        samples = _cut(TokenizedSamples(
            dataset=loaded.dataset,
            lengths=_lengths(loaded.dataset),
            source=loaded.description,
            fingerprint=loaded.fingerprint,
            tokenizer_path=loaded.tokenizer_path,
            vocab_size=loaded.vocab_size,
        ), cfg)
    return samples


def _cut(samples: TokenizedSamples, cfg: DataConfig) -> TokenizedSamples:
    """``samples`` cut to ``data.max_length`` and subset to ``data.max_rows`` (:func:`~harness.data.subset.cut_subset`,
    a fingerprint of its own); as they are when neither is set."""
    if cfg.max_rows is None and cfg.max_length is None:
        return samples
    dataset, words, key = cut_subset(samples, cfg)
    return TokenizedSamples(dataset=dataset, lengths=_lengths(dataset), source=f"{samples.source}; {words}",
                            fingerprint=key, tokenizer_path=samples.tokenizer_path, vocab_size=samples.vocab_size)


def _shipped_samples(cfg: DataConfig, corpus_root: str | None,
                     corpus_files: Sequence[str] | None) -> TokenizedSamples:
    """``data.source=bundled`` or ``sharegpt-smollm2``: the main job's or the real-model study's data as shipped
    (:mod:`harness.data.bundled`), checked against its manifest before it is read."""
    import datasets

    artefact = bundled.SHIPPED_DATA[cfg.source]
    if corpus_root is not None or corpus_files is not None:
        raise ValueError("corpus_root / corpus_files apply only to data.source='stdlib'")
    if cfg.split is not None:
        raise DataValidationError(f"data.split={cfg.split!r} does not apply to data.source={artefact.source!r} (one "
                                  "split); set data.split to null")
    manifest = artefact.verify()
    dataset = datasets.load_from_disk(str(artefact.samples_dir())).select_columns(["input_ids", "loss_mask"])
    recipe, tokenizer = manifest["recipe"], None
    if artefact is bundled.EMBEDDED:
        description = (f"the embedded default as shipped ({manifest['fingerprint'][:12]}): {len(dataset):,} stdlib "
                       f"definitions of Python {recipe['python']}, completions regenerated by the tiny target, "
                       f"byte-level BPE vocab {manifest['vocab_size']}")
        tokenizer = str(bundled.target_dir(artefact.root) / bundled.TOKENIZER_FILE)
    else:
        description = (f"{artefact.title} ({manifest['fingerprint'][:12]}): {len(dataset):,} ShareGPT V3 "
                       f"conversations, every assistant turn {recipe['target_file']}'s greedy reply, vocab "
                       f"{manifest['vocab_size']:,}")
    return TokenizedSamples(dataset=dataset, lengths=_lengths(dataset), source=description,
                            fingerprint=manifest["fingerprint"], tokenizer_path=tokenizer,
                            vocab_size=int(manifest["vocab_size"]))


def heldout_split(num_samples: int, cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(train_indices, heldout_indices)``: sorted int64, disjoint, together ``range(num_samples)``.

    The held-out count is ``ceil(heldout_fraction * num_samples)``, capped by ``max_heldout`` and by
    ``num_samples - 1`` (at least one training sample); the rows are a random draw from
    ``numpy.random.default_rng(heldout_seed)``. Only ``num_samples`` and the ``heldout_*`` options
    matter: never the run seed or the strategy.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 0:
        raise ValueError(f"num_samples={num_samples!r}: give a non-negative integer")
    n = int(num_samples)
    count = math.ceil(float(cfg.heldout_fraction) * n) if cfg.heldout_fraction > 0 else 0
    if cfg.max_heldout is not None:
        count = min(count, cfg.max_heldout)
    count = max(0, min(count, n - 1))
    order = np.random.default_rng(cfg.heldout_seed).permutation(n)
    heldout = np.sort(order[:count]).astype(np.int64)
    train = np.sort(order[count:]).astype(np.int64)
    return train, heldout


#: the last entry of the validation split's seed sequence (keeps its draw apart from the held-out one's)
VALIDATION_PURPOSE = 0x5A11_D001


def validation_split(train_rows: np.ndarray, cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(train_rows, validation_rows)``: the validation split set aside from :func:`heldout_split`'s training rows,
    sorted int64, disjoint. The count is ``ceil(validation_fraction * len(train_rows))``, capped by
    ``max_validation`` and by ``len(train_rows) - 1``; the rows are a random draw from
    ``numpy.random.default_rng([heldout_seed, VALIDATION_PURPOSE])``: never the run seed or the strategy. With
    ``validation_fraction=0`` the training rows are returned whole."""
    rows = np.asarray(train_rows, dtype=np.int64)
    count = math.ceil(float(cfg.validation_fraction) * rows.size) if cfg.validation_fraction > 0 else 0
    if cfg.max_validation is not None:
        count = min(count, cfg.max_validation)
    count = max(0, min(count, rows.size - 1))
    if count == 0:
        return rows, np.zeros(0, dtype=np.int64)
    order = np.random.default_rng([cfg.heldout_seed, VALIDATION_PURPOSE]).permutation(rows.size)
    return np.sort(rows[order[count:]]), np.sort(rows[order[:count]])


@dataclass(eq=False)
class ValidationReport:
    """Which of the checked rows a run can use.

    Attributes:
        kept: int64 row indices (in the order given) that pass.
        dropped_no_anchor: int64 row indices dropped because no position can anchor a block.
    """

    kept: np.ndarray
    dropped_no_anchor: np.ndarray

    def summary(self) -> dict:
        return {
            "checked": int(self.kept.size + self.dropped_no_anchor.size),
            "kept": int(self.kept.size),
            "dropped_no_anchor": int(self.dropped_no_anchor.size),
        }


def validate_samples(
    samples: TokenizedSamples,
    indices: np.ndarray,
    *,
    vocab_size: int,
    block_size: int,
    no_anchor: str,
) -> ValidationReport:
    """Check rows ``indices`` of ``samples`` for training with a drafter of ``block_size``.

    Raises:
        DataValidationError: empty dataset; null rows; an id outside
            ``[0, vocab_size)``; ``loss_mask`` and ``input_ids`` of different lengths; an empty
            sample; with ``no_anchor="error"``, rows with no anchor position. Each message names the
            row, the field and the fix.
    """
    if no_anchor not in NO_ANCHOR_CHOICES:
        raise ValueError(f"no_anchor={no_anchor!r}: choose one of {list(NO_ANCHOR_CHOICES)}")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: give the drafter's block size (an integer >= 1)")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r}: give the target's vocabulary size (an integer >= 1)")
    n = len(samples)
    where = samples.source
    if n == 0:
        raise DataValidationError(
            f"{where}: the dataset is empty (0 rows); give a source with at least one sample"
        )
    indices = np.asarray(indices)
    if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
        raise ValueError(f"indices must be a 1-D integer array, got shape {indices.shape} dtype {indices.dtype}")
    indices = indices.astype(np.int64, copy=False)
    if indices.size == 0:  # e.g. an empty held-out set (heldout_fraction=0): nothing to check
        empty = np.zeros(0, dtype=np.int64)
        return ValidationReport(kept=empty, dropped_no_anchor=empty.copy())
    if indices.min() < 0 or indices.max() >= n:
        bad = int(indices[(indices < 0) | (indices >= n)][0])
        raise IndexError(f"row {bad} out of range for {n} samples")
    selected = np.zeros(n, dtype=bool)
    selected[indices] = True

    ids = samples.column("input_ids")
    mask = samples.column("loss_mask")
    for name, column in (("input_ids", ids), ("loss_mask", mask)):
        if column.null_count:
            rows = _selected_rows(pc.is_null(column), selected)
            if rows.size:
                raise DataValidationError(
                    f"{where}: row {rows[0]}: {name} is null{_more(rows)}; every sample needs a list of "
                    f"token {'ids' if name == 'input_ids' else 'mask values'} — remove or fix those rows"
                )
    ids_lengths = samples.lengths
    mask_lengths = _list_lengths(mask)
    mismatch = np.flatnonzero(selected & (ids_lengths != mask_lengths))
    if mismatch.size:
        row = int(mismatch[0])
        raise DataValidationError(
            f"{where}: row {row}: loss_mask has {mask_lengths[row]} entries but input_ids has "
            f"{ids_lengths[row]} tokens{_more(mismatch)}; give one loss_mask entry per token (or drop the "
            "loss_mask column to supervise every token but the first)"
        )
    empty = np.flatnonzero(selected & (ids_lengths == 0))
    if empty.size:
        raise DataValidationError(
            f"{where}: row {int(empty[0])}: input_ids is empty (0 tokens){_more(empty)}; remove empty "
            "samples from the source"
        )
    _check_values(ids, "input_ids", selected, where, vocab_size)
    _check_values(mask, "loss_mask", selected, where, None)

    has_anchor = _anchor_rows(mask, int(block_size), n)
    ok = has_anchor[indices]
    dropped = indices[~ok]
    if dropped.size and no_anchor == "error":
        shown = ", ".join(
            f"{int(r)} (length {int(ids_lengths[r])})" for r in dropped[:SHOWN_ROWS]
        )
        raise DataValidationError(
            f"{where}: {dropped.size} row(s) have no position that can anchor a block of {block_size} "
            f"(loss_mask[p] and loss_mask[p+1] both 1 with p <= length - {block_size}): rows {shown}"
            f"{' ...' if dropped.size > SHOWN_ROWS else ''}; set data.no_anchor='drop' to drop them, or give "
            f"samples with at least {max(block_size, 2)} tokens and two consecutive supervised tokens "
            "early enough"
        )
    return ValidationReport(kept=indices[ok], dropped_no_anchor=dropped)


# -- helpers -------------------------------------------------------------------------------------
class _RowReader:
    """Random access to the rows of a list column: per-chunk offsets and values as numpy views
    (zero copy; boolean values, bit-packed in Arrow, are read per row instead)."""

    def __init__(self, column: pa.ChunkedArray):
        self.chunks = [chunk for chunk in column.chunks if len(chunk)]
        sizes = np.array([len(chunk) for chunk in self.chunks], dtype=np.int64)
        self.starts = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.starts[1:])
        self.offsets: list[np.ndarray | None] = [None] * len(self.chunks)
        self.values: list[np.ndarray | None] = [None] * len(self.chunks)
        self.boolean = pa.types.is_boolean(column.type.value_type)

    def row(self, index: int) -> np.ndarray:
        chunk_id = int(np.searchsorted(self.starts, index, side="right")) - 1
        local = index - int(self.starts[chunk_id])
        chunk = self.chunks[chunk_id]
        if self.boolean:
            return chunk.slice(local, 1).flatten().to_numpy(zero_copy_only=False)
        if self.values[chunk_id] is None:
            offsets = chunk.offsets.to_numpy()
            self.values[chunk_id] = chunk.values.to_numpy(zero_copy_only=False)
            self.offsets[chunk_id] = offsets
        offsets = self.offsets[chunk_id]
        return self.values[chunk_id][offsets[local] : offsets[local + 1]]


def _lengths(dataset) -> np.ndarray:
    column = dataset.with_format("arrow")["input_ids"]
    return _list_lengths(column)


def _list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    lengths = pc.list_value_length(column).fill_null(0)
    return np.ascontiguousarray(lengths.to_numpy(zero_copy_only=False), dtype=np.int64)


def _selected_rows(flags: pa.ChunkedArray, selected: np.ndarray) -> np.ndarray:
    return np.flatnonzero(flags.to_numpy(zero_copy_only=False) & selected)


def _more(rows: np.ndarray) -> str:
    if rows.size <= 1:
        return ""
    shown = ", ".join(str(int(r)) for r in rows[1:SHOWN_ROWS])
    return f" (and {rows.size - 1} more row(s): {shown}{' ...' if rows.size > SHOWN_ROWS else ''})"


def _chunks(column: pa.ChunkedArray) -> Iterator[tuple[int, pa.Array]]:
    """(first row, chunk) of every non-empty chunk."""
    row = 0
    for chunk in column.chunks:
        if len(chunk):
            yield row, chunk
        row += len(chunk)


def _check_values(
    column: pa.ChunkedArray, name: str, selected: np.ndarray, where: str, vocab_size: int | None
) -> None:
    """No null values inside the lists; ids in ``[0, vocab_size)``; mask values 0/1."""
    for first_row, chunk in _chunks(column):
        values = chunk.flatten()
        bad_null = values.null_count > 0
        if pa.types.is_boolean(values.type) and not bad_null:
            continue
        if not bad_null:
            bounds = pc.min_max(values)
            low, high = bounds["min"].as_py(), bounds["max"].as_py()
            limit = vocab_size if vocab_size is not None else 2
            if low is None or (low >= 0 and high < limit):
                continue
        offsets = chunk.offsets.to_numpy().astype(np.int64)
        offsets -= offsets[0]
        flat = values.to_numpy(zero_copy_only=False)
        if bad_null:
            bad = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))
        else:
            limit = vocab_size if vocab_size is not None else 2
            bad = np.flatnonzero((flat < 0) | (flat >= limit))
        local_rows = np.searchsorted(offsets, bad, side="right") - 1
        rows = local_rows + first_row
        keep = selected[rows]
        if not keep.any():
            continue
        position = int(bad[keep][0] - offsets[local_rows[keep][0]])
        row = int(rows[keep][0])
        count = int(keep.sum())
        others = f" ({count - 1} more bad value(s) in the checked rows)" if count > 1 else ""
        if bad_null:
            raise DataValidationError(
                f"{where}: row {row}: {name}[{position}] is null{others}; every token needs a "
                f"{'token id' if name == 'input_ids' else 'mask value (0 or 1)'} — fix or remove the row"
            )
        value = flat[bad[keep][0]].item()
        if vocab_size is not None:
            raise DataValidationError(
                f"{where}: row {row}: input_ids[{position}] = {value} is outside the vocabulary "
                f"[0, {vocab_size}){others}; tokenize with the target's tokenizer (vocab_size {vocab_size}), "
                "or give a target whose vocabulary covers these ids (a random-weight target's is target.vocab_size, "
                "which batchlab-train sets from data.vocab_size: raise data.vocab_size above the largest id)"
            )
        raise DataValidationError(
            f"{where}: row {row}: loss_mask[{position}] = {value}{others}; loss_mask values must be 0 "
            "(not supervised) or 1 (supervised) — fix the mask"
        )


def _anchor_rows(mask: pa.ChunkedArray, block_size: int, n: int) -> np.ndarray:
    """Per row: is there a position p with mask[p] and mask[p+1] and p <= len - block_size?"""
    need = max(block_size, 2)  # p + 1 must lie inside the sample too
    has = np.zeros(n, dtype=bool)
    for first_row, chunk in _chunks(mask):
        offsets = chunk.offsets.to_numpy().astype(np.int64)
        values = chunk.flatten()
        base = offsets[0]
        rows = len(chunk)
        start = 0
        while start < rows:
            # Rows [start, stop) with at most SCAN_WINDOW_TOKENS tokens (at least one row).
            stop = int(np.searchsorted(offsets, offsets[start] + SCAN_WINDOW_TOKENS, side="right")) - 1
            stop = min(max(stop, start + 1), rows)
            o = offsets[start : stop + 1] - offsets[start]
            window = values.slice(offsets[start] - base, o[-1]).to_numpy(zero_copy_only=False)
            m = window if window.dtype == bool else window != 0
            pair = m[:-1] & m[1:]
            cumulative = np.zeros(m.size, dtype=np.int32 if m.size < 2**31 else np.int64)
            np.cumsum(pair, out=cumulative[1:])
            lengths = np.diff(o)
            long_enough = lengths >= need
            row_start = o[:-1][long_enough]
            row_last = o[1:][long_enough] - need  # the last allowed anchor position
            counts = cumulative[row_last + 1] - cumulative[row_start]
            local = np.zeros(stop - start, dtype=bool)
            local[long_enough] = counts > 0
            has[first_row + start : first_row + stop] = local
            start = stop
    return has

