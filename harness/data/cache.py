"""Content-addressed cache entries, built atomically and verified on every read.

An entry is a directory ``<cache_dir>/<prefix>-<hash>/``. It is built in a temporary sibling
directory (``.tmp-<prefix>-<hash>-<pid>-<random>``) and moved into place with ``os.replace``, so an
entry either exists complete or not at all: a crash mid-build leaves only a temporary directory,
which is never read (and is removed by the next build of the same entry once it is old enough that
no live build can own it). Concurrent builders of one entry (several ranks) are serialised with an
advisory file lock where the platform has one; the loser of a race uses the winner's entry.

An entry's key fingerprints its inputs, not its bytes, so ``meta.json`` also records each file's size and xxh3-128
checksum (and its own): written last, after the data, and checked whenever the entry is opened. A damaged entry is
never used: it is rebuilt, said in one line. Single files (calibrations, checkpoints) get the same check from a
sidecar ``<file>.xxh3`` (:func:`write_checksum`, :func:`checksum_problem`).
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
from typing import Any
from pathlib import Path

import xxhash

try:  # advisory locks: POSIX only; elsewhere concurrent builds just race (still atomic)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

META_FILE = "meta.json"
#: meta.json's record of the entry's files, {relative path: [bytes, xxh3-128 hex]}, and of itself (names no build's
#: own metadata may use)
FILES_KEY, META_CHECKSUM_KEY = "_checksums", "_meta_xxh3"
CHECKSUM_SUFFIX = ".xxh3"
_CHUNK = 1 << 22
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


def file_checksum(path: Path) -> str:
    """xxh3-128 hex of a file's bytes, read in 4 MiB chunks."""
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def content_record(root: Path) -> dict[str, list]:
    """Every file under ``root`` but ``meta.json``: ``{relative path: [bytes, xxh3-128 hex]}``."""
    record = {}
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(directory) / name
            relative = path.relative_to(root).as_posix()
            if relative != META_FILE:
                record[relative] = [path.stat().st_size, file_checksum(path)]
    return record


def _meta_checksum(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != META_CHECKSUM_KEY}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode())


def predates_checksums(meta: dict) -> bool:
    """Whether ``meta`` is an entry's written before batchlab recorded checksums (it cannot be verified)."""
    return FILES_KEY not in meta and META_CHECKSUM_KEY not in meta


def entry_problem(entry: Path, meta: dict | None = None) -> str | None:
    """Why the entry at ``entry`` must not be used (a file missing, cut short or with other bytes than its
    ``meta.json`` records; ``meta.json`` itself altered), or None when it is intact or predates checksums
    (:func:`predates_checksums`). A file that cannot be read for another reason than its absence raises."""
    meta = read_meta(entry) if meta is None else meta
    if meta is None:
        return f"{entry / META_FILE} is missing or unreadable"
    if predates_checksums(meta):
        return None
    if meta.get(META_CHECKSUM_KEY) != _meta_checksum(meta):
        return f"{entry / META_FILE} does not match its checksum"
    expected = meta.get(FILES_KEY)
    if not isinstance(expected, dict):
        return f"{entry / META_FILE} records no files"
    for relative, (size, checksum) in sorted(expected.items()):
        path = entry / relative
        try:
            actual = path.stat().st_size
            if actual != size:
                return f"{path} has {actual:,} bytes where {size:,} were written"
            if file_checksum(path) != checksum:
                return f"{path} does not match its checksum"
        except FileNotFoundError:
            return f"{path} is missing"
    return None  # files added later (e.g. a datasets cache beside its arrow files) change nothing written


def verified_meta(entry: Path) -> dict:
    """``meta.json`` of an entry given by path (e.g. ``target.pretrained=<entry>``) once its files check out;
    raises :class:`DamagedEntry` naming what is wrong otherwise."""
    meta = read_meta(entry)
    problem = _verified_problem(entry, meta)
    if problem:
        raise DamagedEntry(f"{entry} is damaged: {problem}. Rebuild it (delete it and run the command that made it), "
                           "or restore it from a good copy")
    return meta


class DamagedEntry(RuntimeError):
    """A cache entry or checkpoint whose bytes are not those written."""


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def write_checksum(path: Path) -> None:
    """Record ``path``'s size and checksum in its sidecar ``<path>.xxh3`` (atomically; call after the data is in
    place: a file without its sidecar is never trusted)."""
    record = {"bytes": path.stat().st_size, "xxh3_128": file_checksum(path)}
    sidecar = checksum_path(path)
    temporary = sidecar.with_name(f"{sidecar.name}.tmp{os.getpid()}")
    try:
        temporary.write_text(json.dumps(record) + "\n")
        os.replace(temporary, sidecar)
    finally:
        temporary.unlink(missing_ok=True)


def _sidecar_problem(path: Path, size: int, checksum: Callable[[], str]) -> str | None:
    """Why a file of ``size`` bytes and ``checksum()`` is not the one its sidecar recorded, or None."""
    try:
        record = json.loads(checksum_path(path).read_text())
    except (OSError, ValueError):
        return f"{path} has no readable checksum ({checksum_path(path).name}): a write cut short, or an older batchlab"
    if size != record.get("bytes"):
        return f"{path} has {size:,} bytes where {record.get('bytes')} were written"
    return None if checksum() == record.get("xxh3_128") else f"{path} does not match its checksum"


def checksum_problem(path: Path) -> str | None:
    """Why the file ``path`` must not be used (missing, no sidecar, other size or bytes), or None."""
    try:
        return _sidecar_problem(path, path.stat().st_size, lambda: file_checksum(path))
    except FileNotFoundError:
        return f"{path} is missing"


def write_json_checked(path: Path, values: Any, **dump: Any) -> None:
    """``values`` as JSON at ``path`` (temporary file, fsync, rename) with its checksum sidecar written after it."""
    temporary = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        _write_synced(temporary, json.dumps(values, **dump))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    write_checksum(path)


def read_json_checked(path: Path, what: str) -> Any | None:
    """The JSON at ``path`` when it is there and intact (its bytes read once, checked against the sidecar, then
    parsed); None when it is absent, or damaged (said in one line: ``what`` is rebuilt)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    problem = _sidecar_problem(path, len(data), lambda: xxhash.xxh3_128_hexdigest(data))
    if problem is None:
        return json.loads(data)
    print(f"batchlab: {what} cache is damaged ({problem}); rebuilding it", flush=True)
    return None


def ensure_entry(
    cache_dir: Path, prefix: str, key: str, build: Callable[[Path], dict]
) -> tuple[Path, dict, bool]:
    """The cache entry ``<prefix>-<key>``, built by ``build(tmp_dir) -> meta`` when missing.

    ``build`` writes everything into ``tmp_dir`` and returns the metadata to store as ``meta.json``
    (the key is added to it). Returns ``(entry_dir, meta, built)``; ``built`` is False on a hit.
    """
    entry = entry_path(cache_dir, prefix, key)
    meta = _intact_meta(entry, key)
    if meta is not None:
        return entry, meta, False
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _lock(cache_dir / f".{prefix}-{key}.lock"):
        meta = read_meta(entry)  # built by another process while we waited
        if meta is not None and meta.get("key") == key:
            problem = entry_problem(entry, meta)
            if problem is None:
                _said_unverified(entry, meta)
                return entry, meta, False
        elif entry.exists():  # a finished entry always has its meta.json (it is renamed into place whole)
            problem = (f"{entry / META_FILE} is missing or unreadable" if meta is None
                       else f"{entry / META_FILE} names another key")
        else:
            problem = None
        if problem:
            print(f"batchlab: cache entry {entry.name} is damaged ({problem}); rebuilding it", flush=True)
        _remove_stale_tmp(cache_dir, prefix, key)
        if entry.exists():  # damaged (not ours to trust): moved aside whole first, so nothing reads half of it
            aside = cache_dir / f"{TMP_PREFIX}{prefix}-{key}-damaged-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.replace(entry, aside)
            shutil.rmtree(aside, ignore_errors=True)
        tmp = cache_dir / f"{TMP_PREFIX}{prefix}-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            meta = dict(build(tmp))
            reserved = sorted({FILES_KEY, META_CHECKSUM_KEY} & set(meta))
            if reserved:
                raise ValueError(f"the {prefix} entry's metadata uses the cache's own key(s) {reserved}; rename them")
            meta["key"] = key
            meta["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            meta[FILES_KEY] = content_record(tmp)  # the data's checksums, then meta.json: written last
            meta[META_CHECKSUM_KEY] = _meta_checksum(meta)
            _write_synced(tmp / META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")
            try:
                os.replace(tmp, entry)
            except OSError:
                # Lost a race with a builder that had no lock: keep its (complete) entry.
                existing = read_meta(entry)
                if existing is None or existing.get("key") != key or entry_problem(entry, existing):
                    raise
                meta = existing
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return entry, meta, True


#: entries this process has verified, by path: the (inode, size, mtime) of each of their files then (a file
#: rewritten or replaced since differs), so an entry opened again by the same process is not read twice over
_VERIFIED: dict[str, tuple] = {}
_SAID_UNVERIFIED: set[str] = set()


def _stamp(entry: Path) -> tuple | None:
    """(inode, size, mtime) of every file of the entry, meta.json first; None without a meta.json."""
    try:
        files = [entry / META_FILE, *sorted(p for p in entry.rglob("*") if p.name != META_FILE)]
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in (f.stat() for f in files))
    except FileNotFoundError:
        return None


def _intact_meta(entry: Path, key: str) -> dict | None:
    """The entry's meta when it is this key's finished build and its files check out (or it predates checksums);
    else None (the caller rebuilds under the lock, where a damaged entry is reported)."""
    meta = read_meta(entry)
    if meta is None or meta.get("key") != key or _verified_problem(entry, meta) is not None:
        return None
    _said_unverified(entry, meta)
    return meta


def _verified_problem(entry: Path, meta: dict | None) -> str | None:
    """:func:`entry_problem`, computed once a process while the entry's files stay as they were (:func:`_stamp`)."""
    stamp = _stamp(entry)
    if stamp is not None and _VERIFIED.get(str(entry)) == stamp:
        return None
    problem = entry_problem(entry, meta)
    if problem is None and stamp is not None:
        _VERIFIED[str(entry)] = stamp
    return problem


def _said_unverified(entry: Path, meta: dict) -> None:
    """One line, once a process, for an entry an older batchlab wrote without checksums: it is used as before."""
    if predates_checksums(meta) and str(entry) not in _SAID_UNVERIFIED:
        _SAID_UNVERIFIED.add(str(entry))
        print(f"batchlab: cache entry {entry.name} predates checksums (an older batchlab wrote it): used unverified; "
              "delete it to have it rebuilt with them", flush=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


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
