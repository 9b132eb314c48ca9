"""The tokenized-corpus cache: hits, rebuilds on change, atomic builds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.data import cache, corpus_cache
from harness.data.config import CACHE_ENV, DataConfig
from harness.data.samples import load_samples


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    root.mkdir()
    for name in ("a", "b"):
        (root / f"{name}.py").write_text(
            "".join(f"def {name}{i}(x):\n    '''Doc {i}.'''\n    return x * {i} + {i}\n\n" for i in range(10))
        )
    return root


@pytest.fixture
def spies(monkeypatch):
    calls = {"tokenize": 0, "parse": 0}
    build_tokenized, build_corpus = corpus_cache.build_tokenized_corpus, corpus_cache.build_corpus

    def tokenize_spy(*args, **kwargs):
        calls["tokenize"] += 1
        return build_tokenized(*args, **kwargs)

    def parse_spy(*args, **kwargs):
        calls["parse"] += 1
        return build_corpus(*args, **kwargs)

    monkeypatch.setattr(corpus_cache, "build_tokenized_corpus", tokenize_spy)
    monkeypatch.setattr(corpus_cache, "build_corpus", parse_spy)
    return calls


def _load(tree: Path, cache_dir: Path, **options):
    cfg = DataConfig(**{"max_documents": 8, "vocab_size": 300, "cache_dir": str(cache_dir), **options})
    return load_samples(cfg, progress=False, corpus_root=str(tree))


def test_second_load_hits_the_cache(tree: Path, tmp_path: Path, spies):
    first = _load(tree, tmp_path / "c")
    assert spies == {"tokenize": 1, "parse": 1}
    second = _load(tree, tmp_path / "c")
    assert spies == {"tokenize": 1, "parse": 1}
    assert second.fingerprint == first.fingerprint
    assert [second.sample(i)[0].tolist() for i in range(len(second))] == [
        first.sample(i)[0].tolist() for i in range(len(first))
    ]
    entry = Path(first.tokenizer_path).parent
    assert entry.name == f"stdlib-{first.fingerprint}"
    assert {"meta.json", "tokenizer.json", "state.json"} <= {p.name for p in entry.iterdir()}
    # the entry is a plain save_to_disk dataset: the planning tools read its lengths directly
    from harness.data.lengths import load_lengths

    assert load_lengths(entry).tolist() == first.lengths.tolist()


def test_changing_options_or_files_rebuilds(tree: Path, tmp_path: Path, spies):
    base = _load(tree, tmp_path / "c")
    bigger = _load(tree, tmp_path / "c", vocab_size=320)
    assert spies == {"tokenize": 2, "parse": 1}  # the parsed corpus is reused
    assert bigger.fingerprint != base.fingerprint
    _load(tree, tmp_path / "c", subset_seed=3)
    assert spies["tokenize"] == 3
    _load(tree, tmp_path / "c")  # the first entry is still there
    assert spies["tokenize"] == 3
    # a changed source file (size and mtime) invalidates both levels
    path = tree / "a.py"
    path.write_text(path.read_text() + "def extra(y):\n    return y\n")
    changed = _load(tree, tmp_path / "c")
    assert spies == {"tokenize": 4, "parse": 2}
    assert changed.fingerprint != base.fingerprint


def test_partial_builds_never_count(tree: Path, tmp_path: Path, spies, monkeypatch):
    cache_dir = tmp_path / "c"
    original = corpus_cache.build_tokenized_corpus

    def crash(tmp, *args, **kwargs):
        (tmp / "half-written").write_text("x")
        raise KeyboardInterrupt("killed mid-build")

    monkeypatch.setattr(corpus_cache, "build_tokenized_corpus", crash)
    with pytest.raises(KeyboardInterrupt):
        _load(tree, cache_dir)
    assert not any(p.name.startswith("stdlib-") and "corpus" not in p.name for p in cache_dir.iterdir())
    monkeypatch.setattr(corpus_cache, "build_tokenized_corpus", original)
    samples = _load(tree, cache_dir)
    key = samples.fingerprint
    # a temporary directory left by a killed process, and an entry without meta.json, are ignored
    entry = cache_dir / f"stdlib-{key}"
    stale = cache_dir / f".tmp-stdlib-{key}-12345-deadbeef"
    stale.mkdir()
    (stale / "meta.json").write_text("{}")
    (entry / "meta.json").unlink()
    again = _load(tree, cache_dir)
    assert again.fingerprint == key and (entry / "meta.json").exists()
    assert len(again) == len(samples)


def test_ensure_entry_is_atomic(tmp_path: Path):
    def build(tmp: Path) -> dict:
        (tmp / "data").write_text("payload")
        return {"answer": 42}

    entry, meta, built = cache.ensure_entry(tmp_path, "thing", "k1", build)
    assert built and meta["answer"] == 42 and meta["key"] == "k1" and (entry / "data").read_text() == "payload"
    entry2, meta2, built2 = cache.ensure_entry(tmp_path, "thing", "k1", lambda tmp: pytest.fail("rebuilt"))
    assert entry2 == entry and not built2 and meta2 == meta

    def broken(tmp: Path) -> dict:
        (tmp / "data").write_text("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        cache.ensure_entry(tmp_path, "thing", "k2", broken)
    assert not (tmp_path / "thing-k2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_cache_dir_resolution(monkeypatch, tmp_path: Path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert DataConfig().resolved_cache_dir() == tmp_path / "env"
    assert DataConfig(cache_dir=str(tmp_path / "x")).resolved_cache_dir() == tmp_path / "x"
    monkeypatch.delenv(CACHE_ENV)
    assert DataConfig().resolved_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "batchlab"
