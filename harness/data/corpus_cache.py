"""Build and cache the tokenized embedded corpus.

Two cache levels under the cache directory:

- ``stdlib-corpus-<hash>/documents.parquet``: every parsed definition (module, name, prompt,
  completion) of the corpus files; depends on the Python version, the corpus root, the file list
  (with sizes and mtimes) and ``FORMAT_VERSION``. Rebuilt only when the interpreter's stdlib
  changes.
- ``stdlib-<hash>/``: the tokenized samples (``datasets`` ``save_to_disk`` layout: columns
  ``input_ids`` list<int32>, ``loss_mask`` list<int8>, ``module``, ``name``), ``tokenizer.json`` and
  ``meta.json``; the hash adds ``max_documents``, ``subset_seed``, ``vocab_size`` and the
  ``tokenizers`` version. Changing any of them builds a new entry; the old one stays valid.

Both are built atomically (see :mod:`harness.data.cache`).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.data import cache
from harness.data.config import DataConfig
from harness.data.corpus import (
    EXCLUDED_DIRS,
    CodeDocument,
    build_corpus,
    corpus_files,
    select_documents,
    stdlib_root,
)
from harness.data.hf_tokenizer import load_hf_tokenizer
from harness.data.tokenizer import (
    encode_prompt_completion,
    save_tokenizer,
    train_tokenizer,
)

# Bump when the corpus split, the tokenization or the cache layout changes.
FORMAT_VERSION = 1
CORPUS_PREFIX = "stdlib-corpus"
SAMPLES_PREFIX = "stdlib"
DOCUMENTS_FILE = "documents.parquet"
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class StdlibBuild:
    """A tokenized-corpus cache entry."""

    path: Path  # the entry directory (a save_to_disk dataset plus tokenizer.json and meta.json)
    key: str  # its hash: the data's fingerprint
    meta: dict
    built: bool  # False when the entry came from the cache

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER_FILE


def corpus_inputs(root: Path | None = None, files: list[Path] | None = None) -> tuple[Path, list[Path], dict]:
    """The corpus root, its files and everything the parsed corpus depends on."""
    root = stdlib_root() if root is None else Path(root)
    paths = corpus_files(root) if files is None else [Path(f) for f in files]
    payload = {
        "format": FORMAT_VERSION,
        "python": sys.version,
        "implementation": sys.implementation.name,
        "root": str(root.resolve()),
        "excluded": sorted(EXCLUDED_DIRS),
        "files": [cache.file_signature(p) for p in paths],
    }
    return root, paths, payload


def corpus_documents(
    cfg: DataConfig,
    progress: bool = True,
    root: str | os.PathLike[str] | None = None,
    files: list[str | os.PathLike[str]] | None = None,
) -> tuple[list[CodeDocument], dict]:
    """Every parsed definition of the corpus (first cache level, no subset) and its summary."""
    root, paths, corpus_payload = corpus_inputs(root, None if files is None else [Path(f) for f in files])
    return _documents(cfg.resolved_cache_dir(), cache.digest(corpus_payload), root, paths, progress)


#: the data settings the tokenized corpus depends on besides the parsed corpus (``data.<name>``)
SAMPLES_KEY_SETTINGS = ("max_documents", "subset_seed", "vocab_size", "tokenizer")


def samples_key(cfg: DataConfig, corpus_payload: dict) -> str:
    """The tokenized corpus's key: the corpus, :data:`SAMPLES_KEY_SETTINGS` (a given tokenizer by its files' sizes
    and times) and the tokenizers library's version."""
    import tokenizers

    settings = {name: getattr(cfg, name) for name in SAMPLES_KEY_SETTINGS}
    if settings["tokenizer"] is None:  # the embedded BPE: the same key as before a tokenizer could be given
        del settings["tokenizer"]
    else:
        settings["tokenizer"] = cache.path_signature(Path(settings["tokenizer"]).expanduser().resolve())
    return cache.digest({"corpus": corpus_payload, **settings, "tokenizers": tokenizers.__version__})


def stdlib_samples(
    cfg: DataConfig,
    progress: bool = True,
    root: str | os.PathLike[str] | None = None,
    files: list[str | os.PathLike[str]] | None = None,
) -> StdlibBuild:
    """The tokenized corpus for ``cfg`` (built, or read from the cache).

    Args:
        cfg: data options (``max_documents``, ``subset_seed``, ``vocab_size``, cache directory).
        progress: show progress bars on stderr while building.
        root: corpus root (default: the stdlib); for tests and other code trees.
        files: the files to parse (default: every corpus file under ``root``).
    """
    cache_dir = cfg.resolved_cache_dir()
    root, paths, corpus_payload = corpus_inputs(root, None if files is None else [Path(f) for f in files])
    corpus_key = cache.digest(corpus_payload)
    key = samples_key(cfg, corpus_payload)

    def build(tmp: Path) -> dict:
        return build_tokenized_corpus(
            tmp, cfg, lambda: _documents(cache_dir, corpus_key, root, paths, progress), progress
        )

    path, meta, built = cache.ensure_entry(cache_dir, SAMPLES_PREFIX, key, build)
    return StdlibBuild(path=path, key=key, meta=meta, built=built)


def build_tokenized_corpus(tmp: Path, cfg: DataConfig, documents, progress: bool) -> dict:
    """Select, train the tokenizer, tokenize and save into ``tmp``. Returns the entry's meta."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    started = time.perf_counter()
    all_documents, corpus_meta = documents()
    chosen = select_documents(all_documents, cfg.max_documents, cfg.subset_seed)
    if not chosen:
        raise ValueError(
            f"the corpus under {corpus_meta['root']} has no definitions to train on; check the corpus "
            "root (data.source='stdlib' reads this interpreter's standard library)"
        )
    texts = [d.text for d in chosen]
    if cfg.tokenizer is None:
        tokenizer = train_tokenizer(texts, cfg.vocab_size)
        vocab_size = tokenizer.get_vocab_size()
    else:  # data.tokenizer (a target checkpoint's own, by default): its fast tokenizer's backend encodes the same way
        given = load_hf_tokenizer(cfg.tokenizer)
        tokenizer, vocab_size = given.backend_tokenizer, len(given)
    offsets, input_ids, loss_mask = encode_prompt_completion(
        tokenizer, [d.prompt for d in chosen], [d.completion for d in chosen]
    )
    list_type = np.int32 if offsets[-1] < np.iinfo(np.int32).max else np.int64
    list_offsets = pa.array(offsets.astype(list_type))
    make = pa.ListArray if list_type is np.int32 else pa.LargeListArray
    table = pa.table(
        {
            "input_ids": make.from_arrays(list_offsets, pa.array(input_ids, type=pa.int32())),
            "loss_mask": make.from_arrays(list_offsets, pa.array(loss_mask, type=pa.int8())),
            "module": pa.array([d.module for d in chosen], type=pa.string()),
            "name": pa.array([d.name for d in chosen], type=pa.string()),
        }
    )
    with cache.quiet_datasets():
        datasets.Dataset(InMemoryTable(table)).save_to_disk(str(tmp))
    save_tokenizer(tokenizer, tmp / TOKENIZER_FILE)
    lengths = np.diff(offsets)
    return {
        "format": FORMAT_VERSION,
        "source": "stdlib",
        "corpus": corpus_meta,
        "max_documents": cfg.max_documents,
        "subset_seed": cfg.subset_seed,
        "vocab_size_requested": cfg.vocab_size,
        "vocab_size": vocab_size,
        **({} if cfg.tokenizer is None else {"tokenizer": str(cfg.tokenizer)}),
        "num_samples": len(chosen),
        "total_tokens": int(offsets[-1]),
        "supervised_tokens": int(loss_mask.sum(dtype=np.int64)),
        "median_length": float(np.median(lengths)),
        "max_length": int(lengths.max()),
        "build_seconds": round(time.perf_counter() - started, 3),
    }


def _documents(cache_dir: Path, corpus_key: str, root: Path, paths: list[Path], progress: bool):
    """All parsed documents of the corpus (first cache level) and their summary."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def build(tmp: Path) -> dict:
        started = time.perf_counter()
        documents, stats = build_corpus(root=root, files=paths, progress=progress)
        table = pa.table(
            {
                "module": [d.module for d in documents],
                "name": [d.name for d in documents],
                "prompt": [d.prompt for d in documents],
                "completion": [d.completion for d in documents],
            },
            schema=pa.schema([(c, pa.string()) for c in ("module", "name", "prompt", "completion")]),
        )
        pq.write_table(table, tmp / DOCUMENTS_FILE)
        return {
            "format": FORMAT_VERSION,
            "root": str(root),
            "python": sys.version.split()[0],
            **stats.summary(),
            "skipped_file_names": stats.skipped_files[:50],
            "parse_seconds": round(time.perf_counter() - started, 3),
        }

    entry, meta, _ = cache.ensure_entry(cache_dir, CORPUS_PREFIX, corpus_key, build)
    table = pq.read_table(entry / DOCUMENTS_FILE)
    columns = [table.column(c).to_pylist() for c in ("module", "name", "prompt", "completion")]
    documents = [CodeDocument(*row) for row in zip(*columns)]
    summary = {k: meta[k] for k in ("root", "python", "files", "skipped_files", "documents",
                                    "skipped_empty_completion")}
    return documents, summary
