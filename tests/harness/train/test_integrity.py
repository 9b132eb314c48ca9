"""Nothing damaged is used: every cache entry, calibration and checkpoint is checked against the checksums written
after it (harness/data/cache.py), and a write that fails part-way leaves the last good state readable."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_train_components import Counter
from support.train import compose_config, read_jsonl

from harness.data import cache
from harness.train.loop.checkpoint import (
    CheckpointManager,
    CheckpointWriteError,
    checkpoint_paths,
    newest_good_checkpoint,
    save_checkpoint,
)


def flip_byte(path: Path, at: float = 0.5) -> None:
    """One byte of ``path`` (at the fraction ``at`` of its length) changed."""
    data = bytearray(path.read_bytes())
    position = min(int(len(data) * at), len(data) - 1)
    data[position] ^= 0x01
    path.write_bytes(bytes(data))


def cut_short(path: Path) -> None:
    """``path`` without its last quarter: a write that stopped part-way."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 3 // 4])


DAMAGES = {"flipped": flip_byte, "truncated": cut_short}


# ---------------------------------------------------------------------------------------------- cache entries
def _entry(cache_dir: Path, builds: list[int]) -> tuple[Path, dict, bool]:
    def build(tmp: Path) -> dict:
        builds.append(1)
        (tmp / "data.npy").write_bytes(np.arange(1000, dtype=np.int64).tobytes())
        (tmp / "sub").mkdir()
        (tmp / "sub" / "rows.json").write_text(json.dumps({"rows": list(range(50))}))
        return {"rows": 50}

    return cache.ensure_entry(cache_dir, "kind", "k" * 8, build)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("name", ["data.npy", "sub/rows.json", "meta.json"])
def test_a_damaged_file_of_an_entry_is_never_used_and_the_entry_is_rebuilt(tmp_path, capsys, name, damage):
    builds = []
    entry, meta, built = _entry(tmp_path, builds)
    original = {p.relative_to(entry).as_posix(): p.read_bytes() for p in entry.rglob("*") if p.is_file()}
    assert built and set(meta[cache.FILES_KEY]) == {"data.npy", "sub/rows.json"}
    assert _entry(tmp_path, builds)[2] is False and len(builds) == 1  # intact: a hit
    DAMAGES[damage](entry / name)
    entry, meta, built = _entry(tmp_path, builds)
    assert built and len(builds) == 2, f"a {damage} {name} was used"
    assert f"cache entry {entry.name} is damaged" in capsys.readouterr().out
    for relative, data in original.items():
        if relative != "meta.json":  # meta.json's creation time differs
            assert (entry / relative).read_bytes() == data
    assert cache.entry_problem(entry) is None


def test_an_entry_of_an_older_batchlab_without_checksums_is_used_as_before_and_said_once(tmp_path, capsys):
    """Rebuilding it would change the files' times, and with them every key built on its signature (a pretrained
    target's regenerated completions, the data fingerprint): it is used, unverified, said once a process."""
    builds = []
    entry, meta, _ = _entry(tmp_path, builds)
    old = {k: v for k, v in meta.items() if k not in (cache.FILES_KEY, cache.META_CHECKSUM_KEY)}
    (entry / cache.META_FILE).write_text(json.dumps(old))
    for _ in range(2):
        assert _entry(tmp_path, builds)[2] is False and len(builds) == 1
    assert capsys.readouterr().out.count("predates checksums") == 1


def test_an_entry_keeps_its_own_metadata_and_may_not_use_the_caches_keys(tmp_path):
    entry, meta, _ = cache.ensure_entry(tmp_path, "own", "k", lambda tmp: (tmp / "a").write_text("x") and {"files": 3})
    assert meta["files"] == 3 and cache.read_meta(entry)["files"] == 3  # a build's own "files" (the corpus's count)
    with pytest.raises(ValueError, match="uses the cache's own key"):
        cache.ensure_entry(tmp_path, "own", "other", lambda tmp: {cache.FILES_KEY: 1})


def test_an_entry_given_by_path_is_refused_naming_the_damaged_file(tmp_path):
    entry, _, _ = _entry(tmp_path, [])
    assert cache.verified_meta(entry)["rows"] == 50
    flip_byte(entry / "data.npy")
    with pytest.raises(cache.DamagedEntry, match=r"data\.npy does not match its checksum"):
        cache.verified_meta(entry)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_calibration_is_measured_again(tmp_path, capsys, damage):
    from harness.advise.calibrate import CACHE_SUBDIR, calibrate, is_cached

    config = compose_config(["experiment=smoke", "logger=none"])
    measured = []

    def measure(shape):  # a micro-batch's time grows with its tokens (a usable fit), as on a real machine
        measured.append(shape)
        tokens = sum(shape.lengths)
        return [1e-3 + 1e-6 * tokens] * 3, [5e-4 + 5e-7 * tokens] * 3, 1e-3

    first, fresh = calibrate(config, tmp_path, progress=False, measure=measure)
    shapes = len(measured)
    assert fresh and is_cached(config, tmp_path)
    (path,) = (tmp_path / CACHE_SUBDIR).glob("*.json")  # the calibration (its checksum beside it: .json.xxh3)
    DAMAGES[damage](path)
    assert not is_cached(config, tmp_path)
    again, fresh = calibrate(config, tmp_path, progress=False, measure=measure)
    assert fresh and len(measured) == 2 * shapes and again.to_json() == first.to_json()
    assert "calibration cache is damaged" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- checkpoints
def _manager(run_dir, counter):
    return CheckpointManager(run_dir, {"counter": counter}, fingerprint={"seed": 0}, config={}, keep=3,
                             is_main=True, barrier=lambda: None,
                             status=type("Status", (), {"stage": staticmethod(lambda name, step: None)})())


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_checkpoint_falls_back_to_the_newest_good_one(tmp_path, capsys, damage):
    writer = Counter()
    for step in (1, 2, 3):
        writer.value = step
        _manager(tmp_path, writer).save(step)
    DAMAGES[damage](checkpoint_paths(tmp_path)[-1])
    reader = Counter()
    restored = _manager(tmp_path, reader).restore()
    assert restored.path.name == "step-00000002.pt" and reader.value == 2
    out = capsys.readouterr().out
    assert "passed over 1 damaged checkpoint(s)" in out and "step-00000003.pt" in out
    # set aside, so that later saves (steps 3 and on again) are never pruned in its place
    assert (tmp_path / "checkpoints" / "step-00000003.pt.damaged").exists()
    assert [p.name for p in checkpoint_paths(tmp_path)] == ["step-00000001.pt", "step-00000002.pt"]
    writer.value = 3
    _manager(tmp_path, writer).save(3)
    assert _manager(tmp_path, reader).restore().path.name == "step-00000003.pt" and reader.value == 3
    DAMAGES[damage](checkpoint_paths(tmp_path)[-1])
    for path in checkpoint_paths(tmp_path)[:-1]:
        DAMAGES[damage](path)
    with pytest.raises(cache.DamagedEntry, match="no checkpoint in .* can be resumed") as refused:
        _manager(tmp_path, Counter()).restore()
    assert all(f"step-0000000{step}.pt" in str(refused.value) for step in (1, 2, 3))


def test_checkpoints_of_an_older_batchlab_resume_unverified_said(tmp_path):
    save_checkpoint(tmp_path, 1, {"x": 1}, keep=2)
    save_checkpoint(tmp_path, 2, {"x": 2}, keep=2)
    for path in checkpoint_paths(tmp_path):
        cache.checksum_path(path).unlink()
    said = []
    assert newest_good_checkpoint(tmp_path, say=said.append).name == "step-00000002.pt"
    assert "predate checksums" in said[0]


def test_a_checkpoint_without_its_checksum_is_not_trusted(tmp_path):
    save_checkpoint(tmp_path, 1, {"x": 1}, keep=2)
    save_checkpoint(tmp_path, 2, {"x": 2}, keep=2)
    cache.checksum_path(checkpoint_paths(tmp_path)[-1]).unlink()  # the write stopped before its sidecar
    assert newest_good_checkpoint(tmp_path, say=lambda line: None).name == "step-00000001.pt"


WRITE_UNDER_LIMIT = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    import torch
    from harness.train.loop.checkpoint import CheckpointWriteError, save_checkpoint
    run_dir = Path(sys.argv[1])
    save_checkpoint(run_dir, 1, {"weights": torch.zeros(16)}, keep=2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # a full disk, as the file system sees it
    try:
        save_checkpoint(run_dir, 2, {"weights": torch.zeros(100_000)}, keep=2)
    except CheckpointWriteError as error:
        print(error)
        sys.exit(3)
""")


def test_a_checkpoint_write_cut_short_by_a_file_size_limit_leaves_the_last_good_one(tmp_path):
    result = subprocess.run([sys.executable, "-c", WRITE_UNDER_LIMIT, str(tmp_path)], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[3], timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "could not write checkpoint" in result.stdout and "step-00000001.pt) are untouched" in result.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001.pt", "step-00000001.pt.xxh3"]
    assert newest_good_checkpoint(tmp_path).name == "step-00000001.pt"


def test_a_checkpoint_write_error_names_the_file(tmp_path, monkeypatch):
    import torch

    def full_disk(state, handle):
        handle.write(b"partial")
        raise OSError(28, "No space left on device")

    save_checkpoint(tmp_path, 1, {"x": 1}, keep=2)
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"step-00000002\.pt \(\[Errno 28\] No space left on device\)"):
        save_checkpoint(tmp_path, 2, {"x": 2}, keep=2)
    assert [p.name for p in checkpoint_paths(tmp_path)] == ["step-00000001.pt"]


# ---------------------------------------------------------------------------------------------- a run end to end
RUN = ["experiment=smoke", "trainer.nproc=1", "trainer.num_workers=0", "trainer.stop_tokens=3000", "logger=none",
       "trainer.progress=false", "strategy=packed", "trainer.target_features=cached", "eval.every_tokens=3000",
       "checkpoint.every_steps=2"]


def test_a_run_never_trains_on_a_damaged_cache_entry(tmp_path, monkeypatch, capsys):
    """Every entry a run opens (the corpus and its tokenizer, the features), one byte flipped in its largest file:
    the next run says each is damaged, rebuilds it, and trains exactly as the first."""
    from harness.train.launch.run import run

    monkeypatch.setenv("BATCHLAB_CACHE", str(tmp_path / "cache"))
    run(compose_config(RUN), tmp_path / "first")
    entries = sorted(p for p in (tmp_path / "cache").iterdir() if p.is_dir() and cache.read_meta(p) is not None)
    kinds = {p.name.rsplit("-", 1)[0] for p in entries}
    assert {"stdlib", "features"} <= kinds, kinds
    for entry in entries:
        largest = max((p for p in entry.rglob("*") if p.is_file() and p.name != cache.META_FILE),
                      key=lambda p: p.stat().st_size)
        flip_byte(largest)
    capsys.readouterr()
    run(compose_config(RUN), tmp_path / "second")
    out = capsys.readouterr().out
    for entry in entries:
        assert f"cache entry {entry.name} is damaged" in out, entry.name
    first, second = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("first", "second"))
    assert [r.get("loss") for r in first] == [r.get("loss") for r in second]
