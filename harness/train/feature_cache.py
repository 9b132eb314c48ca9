"""Cached target features (``trainer.target_features=cached``): the frozen target's tapped outputs of every training
row, computed once and read by every run of a sweep, as SpecForge's offline mode trains from stored hidden states.

The target is frozen, so a document's features are the same under every strategy, seed and step: only the layout
they arrive in differs. The cache holds each training row's features computed with the row alone (its own padded
row: no neighbour, no padding), ``[length, taps · hidden]``, for the row's first ``trainer.max_tokens`` tokens
(a truncated row's features are that prefix's: the target is causal). A run reads them back in its micro-batches'
layout (:class:`CachedFeatures`), and the target runs only for the evaluation. Features computed in another layout
differ from these by rounding only (the packed, padded and separate layouts agree within ``batchlab-check``'s
tolerances), so a run from the cache follows a run with the target online within that rounding, not bit for bit.
Throughput measured from the cache leaves the target out: a comparison of strategies' speed keeps it online.

The entry is keyed by everything the features depend on (the target's checkpoint or config and init seed, the
tapped layers, the dtype, the data's fingerprint, the rows and the budget), built under the cache's lock, written
atomically (:func:`harness.data.cache.ensure_entry`, which checks its checksums on every read), and resumable: the
rows done so far are kept beside the entry, each saved chunk with its checksum, and an interrupted build goes on
from its last chunk that checks out.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import xxhash

from harness.data import cache
from harness.models.target import TargetFeatures
from harness.train.rank_models import TARGET_INIT_SEED, TargetSpec, pretrained_target_path

PREFIX = "features"
FEATURES_FILE = "features.npy"
INDEX_FILE = "index.npy"  # [dataset rows, 2]: start and length of each row's features (-1, 0: not cached)
#: rows computed per target forward (padded, sorted by length) and between two saves of a partial build
ROWS_PER_FORWARD = 8
ROWS_PER_SAVE = 64


@dataclass(frozen=True)
class FeaturesConfig:
    """What cached target features depend on besides the data and rows, and where they are kept."""

    target: TargetSpec
    """The frozen target that computes them."""
    target_layer_ids: Optional[list[int]]
    """``drafter.target_layer_ids`` as configured (None: DFlash's rule for the drafter's depth)."""
    num_hidden_layers: int
    """``drafter.num_hidden_layers``: the depth DFlash's rule taps for."""
    precision: str
    """``trainer.precision``: the target's dtype."""
    max_tokens: int
    """``trainer.max_tokens``: a row's features cover its first ``max_tokens`` tokens."""
    cache_dir: Path
    """``data.cache_dir`` resolved: where the entries live."""


def target_identity(target: TargetSpec) -> dict[str, Any]:
    """What a frozen target's outputs depend on: its checkpoint's files, or its config and init seed."""
    if target.pretrained:
        path = Path(pretrained_target_path(target)).expanduser().resolve()
        return {"checkpoint": cache.path_signature(path)}
    return {"config": target.kwargs, "init_seed": TARGET_INIT_SEED}


#: the run settings the features depend on besides the target and the data, by their config keys: the tapped
#: layers as configured (``drafter.target_layer_ids``, or DFlash's rule for the drafter's depth, which the target's
#: identity then fixes), so that a hit needs no target built
KEY_SETTINGS = {"drafter.target_layer_ids": "target_layer_ids", "drafter.num_hidden_layers": "num_hidden_layers",
                "trainer.precision": "precision", "trainer.max_tokens": "max_tokens"}


def cache_key(config: FeaturesConfig, fingerprint: str, rows: np.ndarray) -> str:
    """The entry's key: the target's identity, :data:`KEY_SETTINGS`, the data's fingerprint and the rows."""
    settings = {key: getattr(config, name) for key, name in KEY_SETTINGS.items()}
    return cache.digest({"target": target_identity(config.target), "settings": settings, "data": fingerprint,
                         "rows": np.asarray(rows, dtype=np.int64).tolist(), "version": 3})


def ensure_feature_cache(config: FeaturesConfig, samples: Any, rows: np.ndarray, make_target: Callable[[], Any],
                         progress: bool = False) -> tuple[Path, dict, bool]:
    """The cache entry of the target's tapped features of dataset ``rows``: ``(entry, meta, built)``; the target
    (``make_target()``) is built only when the entry is missing."""
    key = cache_key(config, samples.fingerprint, rows)
    cache_dir = config.cache_dir
    partial = cache_dir / f".{PREFIX}-{key}.partial"

    def build(tmp: Path) -> dict:
        target = make_target()
        taps = list(target.tap_layer_ids)
        _build_partial(partial, samples, np.asarray(rows, dtype=np.int64), target, taps,
                       int(config.max_tokens), progress)
        for name in (FEATURES_FILE, INDEX_FILE):
            shutil.move(str(partial / name), str(tmp / name))
        shutil.rmtree(partial, ignore_errors=True)
        return {"rows": int(len(rows)), "taps": taps, "hidden_size": int(target.hidden_size),
                "tokens": int(np.load(tmp / INDEX_FILE)[:, 1].sum())}

    return cache.ensure_entry(cache_dir, PREFIX, key, build)


@torch.no_grad()
def _build_partial(partial: Path, samples: Any, rows: np.ndarray, target: Any, taps: list[int], max_tokens: int,
                   progress: bool) -> None:
    """Compute the features into ``partial`` (created, or resumed from its last chunk that checks out:
    ``done.json`` records the rows written and each saved chunk's xxh3 checksum)."""
    lengths = np.minimum(samples.lengths[rows], max_tokens).astype(np.int64)
    sort = np.argsort(lengths, kind="stable")  # similar lengths together: little padding
    order = rows[sort]
    ends = np.cumsum(lengths[sort])  # the features' rows hold the sorted rows' tokens in order
    width = len(taps) * int(target.hidden_size)
    partial.mkdir(parents=True, exist_ok=True)
    done_file = partial / "done.json"
    record = _resume_record(partial, done_file)
    if record["rows"] == 0:
        index = np.full((len(samples), 2), (-1, 0), dtype=np.int64)
        index[order, 1] = lengths[sort]
        index[order, 0] = ends - lengths[sort]
        np.save(partial / INDEX_FILE, index)
        np.lib.format.open_memmap(partial / FEATURES_FILE, mode="w+", dtype=np.float32,
                                  shape=(int(lengths.sum()), width)).flush()
        record = {"rows": 0, "index": cache.file_checksum(partial / INDEX_FILE), "chunks": []}
    index = np.load(partial / INDEX_FILE)
    features = np.load(partial / FEATURES_FILE, mmap_mode="r+")
    done = _verified_rows(features, record, ends, partial)
    record["rows"], record["chunks"] = done, [c for c in record["chunks"] if c[0] <= done]
    from tqdm import tqdm

    from harness.models.layout import TokenBatch

    with tqdm(total=len(order), initial=done, desc="target features", unit=" rows", disable=not progress,
              leave=False) as bar:
        for first in range(done, len(order), ROWS_PER_FORWARD):
            batch_rows = order[first:first + ROWS_PER_FORWARD]
            documents = [torch.from_numpy(ids[:max_tokens]) for ids, _ in samples.samples(batch_rows)]
            outputs = target(TokenBatch.from_documents(documents, "padded"), tap_layer_ids=taps).hidden_states
            joined = torch.cat(outputs, dim=-1).float().cpu().numpy()
            for position, row in enumerate(batch_rows):
                start, length = index[row]
                features[start:start + length] = joined[position, :length]
            bar.update(len(batch_rows))
            written = first + len(batch_rows)
            if written % ROWS_PER_SAVE < ROWS_PER_FORWARD or written == len(order):
                features.flush()
                begin = record["chunks"][-1][0] if record["chunks"] else 0
                record["chunks"].append([written, _chunk_checksum(features, ends, begin, written)])
                record["rows"] = written
                _write_json_atomic(done_file, record)
    del features


def _resume_record(partial: Path, done_file: Path) -> dict:
    """``done.json`` of an interrupted build, or a fresh start (said when it is unreadable or its index damaged)."""
    if not done_file.is_file():
        return {"rows": 0, "chunks": []}
    try:
        record = json.loads(done_file.read_text())
        if not (isinstance(record.get("rows"), int) and isinstance(record.get("chunks"), list)):
            raise ValueError("no rows or chunks recorded")
        np.load(partial / FEATURES_FILE, mmap_mode="r")  # missing or cut short: OSError or ValueError
        problem = None if cache.file_checksum(partial / INDEX_FILE) == record["index"] else "its index is damaged"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        problem = f"its {done_file.name} or files are unreadable ({error})"
    if problem:
        print(f"batchlab: the interrupted feature build in {partial} cannot be resumed ({problem}); starting it "
              "again", flush=True)
        return {"rows": 0, "chunks": []}
    return record


def _chunk_checksum(features: np.ndarray, ends: np.ndarray, begin: int, end: int) -> str:
    """xxh3-128 of the features of sorted rows ``[begin, end)``."""
    first = int(ends[begin - 1]) if begin else 0
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(features[first:int(ends[end - 1])]).data)


def _verified_rows(features: np.ndarray, record: dict, ends: np.ndarray, partial: Path) -> int:
    """The rows of the interrupted build that check out: up to the first saved chunk whose checksum fails."""
    begin = 0
    for end, checksum in record["chunks"]:
        if end > len(ends) or _chunk_checksum(features, ends, begin, end) != checksum:
            print(f"batchlab: the interrupted feature build in {partial} is damaged after row {begin} of "
                  f"{len(ends)}; computing the rest again", flush=True)
            return begin
        begin = end
    return begin


def _write_json_atomic(path: Path, values: dict) -> None:
    temporary = path.with_suffix(f".tmp{os.getpid()}")
    temporary.write_text(json.dumps(values))
    os.replace(temporary, path)


class FeatureStore:
    """A cache entry read back: each dataset row's features ``[length, taps · hidden]``, memory-mapped."""

    def __init__(self, entry: Path, taps: list[int]) -> None:
        self.features = np.load(entry / FEATURES_FILE, mmap_mode="r")
        self.index = np.load(entry / INDEX_FILE)
        self.taps = list(taps)

    def row(self, row: int, length: int) -> np.ndarray:
        start, cached = (int(v) for v in self.index[row])
        if start < 0 or length > cached:
            raise KeyError(f"dataset row {row} ({length} tokens) is not in the feature cache ({cached} cached): the "
                           "cache was built for other rows; delete it or run with trainer.target_features=online")
        return self.features[start:start + length]

    def batch_features(self, batch: Any, device: torch.device, dtype: torch.dtype = torch.float32) -> TargetFeatures:
        """A micro-batch's tapped features in its layout: ``[B, L, D]`` padded rows (zeros at the pads) or
        ``[1, T, D]`` for a packed row, one tensor per tap."""
        tokens = batch.tokens
        documents = [self.row(int(r), int(n)) for r, n in zip(batch.sample_indices.tolist(), batch.lengths.tolist())]
        width = documents[0].shape[1]
        if tokens.cu_seqlens is not None:
            joined = np.zeros((1, int(tokens.input_ids.shape[1]), width), dtype=np.float32)
            joined[0, :sum(len(d) for d in documents)] = np.concatenate(documents)
        else:
            joined = np.zeros((len(documents), int(tokens.input_ids.shape[1]), width), dtype=np.float32)
            for position, document in enumerate(documents):
                joined[position, :len(document)] = document
        tensor = torch.from_numpy(joined).to(device=device, dtype=dtype)
        hidden = width // len(self.taps)
        return TargetFeatures(self.taps, [tensor[..., i * hidden:(i + 1) * hidden] for i in range(len(self.taps))])


def feature_store(config: FeaturesConfig, samples: Any, rows: np.ndarray, make_target: Callable[[], Any],
                  taps: list[int]) -> FeatureStore:
    """The cache entry of ``rows``' features (built first when missing, by ``make_target()``'s target) read back,
    checked to hold the drafter's layers ``taps``."""
    entry, meta, _ = ensure_feature_cache(config, samples, rows, make_target)
    if meta["taps"] != list(taps):
        raise ValueError(f"the feature cache {entry} holds layers {meta['taps']}, the drafter reads {list(taps)}")
    return FeatureStore(entry, taps)
