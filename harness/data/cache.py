"""Content-addressed cache entries, built atomically.

An entry is a directory ``<cache_dir>/<prefix>-<hash>/``. It is built in a temporary sibling
directory (``.tmp-<prefix>-<hash>-<pid>-<random>``) and moved into place with ``os.replace``, so an
entry either exists complete or not at all: a crash mid-build leaves only a temporary directory,
which is never read (and is removed by the next build of the same entry once it is old enough that
no live build can own it). Concurrent builders of one entry (several ranks) are serialised with an
advisory file lock where the platform has one; the loser of a race uses the winner's entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

try:  # advisory locks: POSIX only; elsewhere concurrent builds just race (still atomic)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

META_FILE = "meta.json"
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 24 * 3600


def digest(payload) -> str:
    """sha256 hex of a JSON-serialisable payload (keys sorted)."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_signature(path: Path) -> list:
    """(path, size, mtime_ns) of a file: what a cache entry built from it depends on."""
    stat = path.stat()
    return [str(path), stat.st_size, stat.st_mtime_ns]


def tree_signature(root: Path) -> list:
    """Signatures of every file under ``root`` (sorted by relative path)."""
    entries = []
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(directory) / name
            stat = path.stat()
            entries.append([path.relative_to(root).as_posix(), stat.st_size, stat.st_mtime_ns])
    return entries


def path_signature(path: Path) -> list:
    """:func:`tree_signature` of a directory, :func:`file_signature` of a file."""
    return tree_signature(path) if path.is_dir() else file_signature(path)


def entry_path(cache_dir: Path, prefix: str, key: str) -> Path:
    return cache_dir / f"{prefix}-{key}"


def read_meta(entry: Path) -> dict | None:
    """The entry's ``meta.json``, or None when the entry is absent or not a finished build."""
    try:
        return json.loads((entry / META_FILE).read_text())
    except (OSError, ValueError):
        return None


def ensure_entry(
    cache_dir: Path, prefix: str, key: str, build: Callable[[Path], dict]
) -> tuple[Path, dict, bool]:
    """The cache entry ``<prefix>-<key>``, built by ``build(tmp_dir) -> meta`` when missing.

    ``build`` writes everything into ``tmp_dir`` and returns the metadata to store as ``meta.json``
    (the key is added to it). Returns ``(entry_dir, meta, built)``; ``built`` is False on a hit.
    """
    entry = entry_path(cache_dir, prefix, key)
    meta = read_meta(entry)
    if meta is not None and meta.get("key") == key:
        return entry, meta, False
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _lock(cache_dir / f".{prefix}-{key}.lock"):
        meta = read_meta(entry)  # built by another process while we waited
        if meta is not None and meta.get("key") == key:
            return entry, meta, False
        _remove_stale_tmp(cache_dir, prefix, key)
        if entry.exists():  # an entry without a valid meta.json (not ours to trust): rebuild
            shutil.rmtree(entry, ignore_errors=True)
        tmp = cache_dir / f"{TMP_PREFIX}{prefix}-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            meta = dict(build(tmp))
            meta["key"] = key
            meta["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            try:
                os.replace(tmp, entry)
            except OSError:
                # Lost a race with a builder that had no lock: keep its (complete) entry.
                existing = read_meta(entry)
                if existing is None or existing.get("key") != key:
                    raise
                meta = existing
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return entry, meta, True


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale_tmp(cache_dir: Path, prefix: str, key: str) -> None:
    """Temporary directories of this entry left by builds that died long ago."""
    now = time.time()
    for tmp in cache_dir.glob(f"{TMP_PREFIX}{prefix}-{key}-*"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """``datasets``' own progress bars ("Saving the dataset") off within the block: batchlab shows its own."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
