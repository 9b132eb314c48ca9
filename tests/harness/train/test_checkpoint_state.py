"""Checkpoints in-process, piece by piece: what a checkpoint file holds and how it is found again, the states it
restores (the RNG streams, the trainer's counters, the consumed-sample counts), the plan fingerprint and the
version checks that refuse a resume naming the file, and a write the file system refuses."""

from __future__ import annotations

import io
import random
import re
import sys

import numpy as np
import pytest
import torch
import torch.serialization
from support.train import Counter

from harness.data.cache import DamagedEntry, checksum_path, checksum_problem
from harness.train.distributed import Collectives, RankEnv
from harness.train.loop import checkpoint as ckpt
from harness.train.loop.checkpoint import (
    LAYOUT_KEYS,
    CheckpointManager,
    CheckpointVersionError,
    CheckpointWriteError,
    FingerprintMismatch,
    RngState,
    TorchState,
    check_fingerprint,
    check_versions,
    checkpoint_paths,
    component_state,
    latest_checkpoint,
    lengths_hash,
    load_checkpoint,
    newest_good_checkpoint,
    plan_fingerprint,
    save_checkpoint,
)
from harness.train.loop.consumed import ConsumedSamples
from harness.train.loop.step_record import StepRecord
from harness.train.loop.train_state import TrainState

FIX = ("resume it with the batchlab version that wrote it, or start a fresh run in a new directory (or set "
       "trainer.resume=false)")


class Stages:
    def __init__(self):
        self.seen = []

    def stage(self, name, step):
        self.seen.append((name, step))


def _manager(run_dir, components, *, fingerprint=None, config=None, is_main=True, status=None, keep=3):
    return CheckpointManager(run_dir, components, fingerprint=fingerprint or {"seed": 0, "world_size": 1},
                             config=config or {}, keep=keep, is_main=is_main, barrier=lambda: None,
                             status=status or Stages())


def _tamper(path):
    """Another state written over a checkpoint after its checksum: its sidecar no longer vouches for it."""
    torch.save({"tampered": True}, path)


def _written_on_a_gpu(monkeypatch):
    """torch.save from here on tags every storage as a CUDA device's, as a checkpoint written on a GPU is."""
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")


# ---------------------------------------------------------------- files: written, listed, found again
def test_a_saved_state_is_what_load_checkpoint_reads_and_a_new_run_directory_is_made(tmp_path):
    run_dir = tmp_path / "runs" / "new"  # neither exists yet
    state = {"format": 2, "components": {"a": {"version": 1, "state": {"w": torch.arange(3)}}}, "n": 5}
    path = save_checkpoint(run_dir, 7, state, keep=2)
    assert path == run_dir / "checkpoints" / "step-00000007.pt" and checksum_path(path).exists()
    loaded = load_checkpoint(path)
    assert loaded["n"] == 5 and loaded["components"]["a"]["state"]["w"].tolist() == [0, 1, 2]
    assert component_state(loaded, "a")["w"].tolist() == [0, 1, 2]


def test_the_latest_checkpoint_is_the_highest_step_not_the_last_in_text_order(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (9, 10, 11):
        save_checkpoint(tmp_path, step, {"step": step}, keep=3)
    assert [p.name for p in checkpoint_paths(tmp_path)] == ["step-00000009.pt", "step-00000010.pt", "step-00000011.pt"]
    assert latest_checkpoint(tmp_path).name == "step-00000011.pt"
    (tmp_path / "checkpoints" / "step-00000012.pt.tmp").write_bytes(b"partial")  # never listed
    assert latest_checkpoint(tmp_path).name == "step-00000011.pt"


def test_a_checkpoint_written_on_a_gpu_loads_on_the_cpu(tmp_path, monkeypatch):
    with monkeypatch.context() as patched:
        _written_on_a_gpu(patched)
        save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, keep=1)
    assert load_checkpoint(checkpoint_paths(tmp_path)[-1])["w"].device.type == "cpu"


def test_a_checkpoint_holds_numpy_and_python_rng_states(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"rng": RngState().state_dict()}, keep=1)
    loaded = load_checkpoint(path)["rng"]
    assert loaded["python"] == random.getstate()
    assert np.array_equal(loaded["numpy"][1], np.random.get_state()[1])


def test_a_damaged_checkpoint_is_never_loaded_and_the_refusal_names_it(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"x": 1}, keep=1)
    _tamper(path)
    with pytest.raises(DamagedEntry) as refused:
        load_checkpoint(path)
    assert str(refused.value) == f"checkpoint {checksum_problem(path)}" and "step-00000001.pt" in str(refused.value)


def test_a_partial_write_is_only_ever_the_temporary_file(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"x": 1}, keep=2)
    directory = tmp_path / "checkpoints"
    seen = []
    real_save = torch.save

    def watched(state, handle):
        real_save(state, handle)
        seen.append(sorted(p.name for p in directory.iterdir()))

    monkeypatch.setattr(torch, "save", watched)
    save_checkpoint(tmp_path, 2, {"x": 2}, keep=2)
    assert seen == [["step-00000001.pt", "step-00000001.pt.xxh3", "step-00000002.pt.tmp"]]
    assert sorted(p.name for p in directory.iterdir()) == [
        "step-00000001.pt", "step-00000001.pt.xxh3", "step-00000002.pt", "step-00000002.pt.xxh3"]


def test_checkpoints_of_an_older_batchlab_without_checksums_are_pruned(tmp_path):
    for step in (1, 2):
        checksum_path(save_checkpoint(tmp_path, step, {"x": step}, keep=3)).unlink()
    save_checkpoint(tmp_path, 3, {"x": 3}, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000003.pt", "step-00000003.pt.xxh3"]


# ---------------------------------------------------------------- a write the file system refuses
def _full_disk(state, handle):
    handle.write(b"partial")
    raise OSError(28, "No space left on device")


def test_a_refused_write_names_every_earlier_checkpoint_left_untouched(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"x": 1}, keep=3)
    save_checkpoint(tmp_path, 2, {"x": 2}, keep=3)
    monkeypatch.setattr(torch, "save", _full_disk)
    with pytest.raises(CheckpointWriteError) as refused:
        save_checkpoint(tmp_path, 3, {"x": 3}, keep=3)
    path = tmp_path / "checkpoints" / "step-00000003.pt"
    assert str(refused.value) == (
        f"could not write checkpoint {path} ([Errno 28] No space left on device); the earlier checkpoints "
        "(step-00000001.pt, step-00000002.pt) are untouched: free space or raise the file size limit, then run the "
        "same command to resume")
    assert [p.name for p in checkpoint_paths(tmp_path)] == ["step-00000001.pt", "step-00000002.pt"]
    assert not path.with_name("step-00000003.pt.tmp").exists()


def test_a_refused_first_write_says_no_earlier_checkpoint_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", _full_disk)
    with pytest.raises(CheckpointWriteError) as refused:
        save_checkpoint(tmp_path, 1, {"x": 1}, keep=3)
    path = tmp_path / "checkpoints" / "step-00000001.pt"
    assert str(refused.value) == (f"could not write checkpoint {path} ([Errno 28] No space left on device); no "
                                  "earlier checkpoint exists")
    assert checkpoint_paths(tmp_path) == []


def test_a_refused_rewrite_of_the_same_step_does_not_count_it_as_earlier(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"x": 1}, keep=3)
    monkeypatch.setattr(torch, "save", _full_disk)
    with pytest.raises(CheckpointWriteError, match="; no earlier checkpoint exists$"):
        save_checkpoint(tmp_path, 1, {"x": 1}, keep=3)


def test_a_refused_checksum_write_after_the_rename_is_a_write_error_too(tmp_path, monkeypatch):
    def no_space(path):
        raise OSError(28, "No space left on device")

    save_checkpoint(tmp_path, 1, {"x": 1}, keep=3)
    monkeypatch.setattr(ckpt, "write_checksum", no_space)  # the temporary file is renamed already
    with pytest.raises(CheckpointWriteError, match=r"step-00000002\.pt \(\[Errno 28\]"):
        save_checkpoint(tmp_path, 2, {"x": 2}, keep=3)
    assert newest_good_checkpoint(tmp_path, say=lambda line: None).name == "step-00000001.pt"


def test_an_error_that_is_not_a_write_is_raised_as_it_is(tmp_path, monkeypatch):
    def unpicklable(state, handle):
        handle.write(b"partial")
        raise RuntimeError("cannot pickle 'generator' object")

    monkeypatch.setattr(torch, "save", unpicklable)
    with pytest.raises(RuntimeError, match="cannot pickle") as raised:
        save_checkpoint(tmp_path, 1, {"x": 1}, keep=3)
    assert not isinstance(raised.value, CheckpointWriteError)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []  # its temporary file removed


def _caused(error, cause=None, context=None):
    error.__cause__, error.__context__ = cause, context
    return error


@pytest.mark.parametrize(("error", "refused"), [
    (OSError(28, "No space left on device"), True),
    (RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/0"), True),
    (RuntimeError("cannot pickle 'generator' object"), False),
    (_caused(RuntimeError("serialization failed"), cause=OSError(27, "File too large")), True),
    (_caused(RuntimeError("serialization failed"), context=OSError(27, "File too large")), True),
    (_caused(RuntimeError("serialization failed"), cause=ValueError("bad"), context=OSError(27, "x")), False),
    (_caused(RuntimeError("serialization failed"), context=ValueError("bad")), False),
])
def test_a_write_failure_is_the_file_system_refusing_anywhere_in_the_chain(error, refused):
    assert ckpt._write_failure(error) is refused


# ---------------------------------------------------------------- the newest good checkpoint
def _three(tmp_path):
    return [save_checkpoint(tmp_path, step, {"x": step}, keep=3) for step in (1, 2, 3)]


def test_damaged_checkpoints_passed_over_are_said_and_kept_in_place_unless_set_aside(tmp_path):
    first, second, third = _three(tmp_path)
    _tamper(third)
    _tamper(second)
    problems = f"{checksum_problem(third)}; {checksum_problem(second)}"
    said = []
    assert newest_good_checkpoint(tmp_path, say=said.append) == first
    assert said == [f"batchlab-train: passed over 2 damaged checkpoint(s) ({problems}); resuming from "
                    "step-00000001.pt, the newest good one"]
    assert checkpoint_paths(tmp_path) == [first, second, third]  # not renamed: set_aside is off by default
    said.clear()
    assert newest_good_checkpoint(tmp_path, say=said.append, set_aside=True) == first
    assert said == [f"batchlab-train: passed over 2 damaged checkpoint(s) ({problems}); resuming from "
                    "step-00000001.pt, the newest good one (the damaged ones renamed *.damaged)"]
    assert checkpoint_paths(tmp_path) == [first]
    assert third.with_name("step-00000003.pt.damaged").exists()
    assert third.with_name("step-00000003.pt.xxh3.damaged").exists()


def test_when_no_checkpoint_is_good_the_refusal_names_every_one(tmp_path):
    paths = _three(tmp_path)
    for path in paths:
        _tamper(path)
    with pytest.raises(DamagedEntry) as refused:
        newest_good_checkpoint(tmp_path, say=lambda line: None)
    problems = "; ".join(checksum_problem(path) for path in reversed(paths))
    assert str(refused.value) == (
        f"no checkpoint in {tmp_path / 'checkpoints'} can be resumed: {problems}. Restore one from a good copy, or "
        "start a fresh run in a new directory (or set trainer.resume=false)")


def test_the_newest_of_an_older_batchlabs_checkpoints_is_used_unverified(tmp_path):
    paths = _three(tmp_path)
    for path in paths:
        checksum_path(path).unlink()
    said = []
    assert newest_good_checkpoint(tmp_path, say=said.append) == paths[-1]
    assert said == [f"batchlab-train: the checkpoints in {tmp_path / 'checkpoints'} predate checksums (an older "
                    "batchlab wrote them): resuming from step-00000003.pt unverified"]


# ---------------------------------------------------------------- the manager
def test_the_manager_saves_its_config_and_says_the_stage(tmp_path):
    stages = Stages()
    _manager(tmp_path, {"a": Counter(4)}, config={"seed": 3}, status=stages).save(5)
    saved = load_checkpoint(checkpoint_paths(tmp_path)[-1])
    assert saved["config"] == {"seed": 3} and saved["format"] == 2
    assert component_state(saved, "a") == {"value": 4}
    assert stages.seen == [("checkpoint", 5)]


def test_only_the_main_rank_says_what_it_passed_over(tmp_path, capsys):
    for step in (1, 2):
        _manager(tmp_path, {"a": Counter(step)}).save(step)
    _tamper(checkpoint_paths(tmp_path)[-1])
    other = Counter()
    assert _manager(tmp_path, {"a": other}, is_main=False).restore().path.name == "step-00000001.pt"
    assert other.value == 1 and capsys.readouterr().out == ""
    assert [p.name for p in checkpoint_paths(tmp_path)] == ["step-00000001.pt", "step-00000002.pt"]  # not set aside


def test_what_the_main_rank_says_on_resume_is_flushed_at_once(tmp_path, monkeypatch):
    for step in (1, 2):
        _manager(tmp_path, {"a": Counter(step)}).save(step)
    _tamper(checkpoint_paths(tmp_path)[-1])
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8"))  # block-buffered, as in a pipe
    _manager(tmp_path, {"a": Counter()}).restore()
    assert b"passed over 1 damaged checkpoint(s)" in raw.getvalue()


def test_the_manager_restores_a_checkpoint_written_on_a_gpu_with_numpy_state(tmp_path, monkeypatch):
    with monkeypatch.context() as patched:
        _written_on_a_gpu(patched)
        _manager(tmp_path, {"w": TorchState(torch.nn.Linear(2, 1)), "rng": RngState()}).save(1)
    module = torch.nn.Linear(2, 1)
    restored = _manager(tmp_path, {"w": TorchState(module), "rng": RngState()}).restore()
    assert restored.path.name == "step-00000001.pt" and module.weight.device.type == "cpu"


def test_the_managers_refusals_name_the_checkpoint(tmp_path):
    _manager(tmp_path, {"a": Counter(1)}).save(1)
    path = checkpoint_paths(tmp_path)[-1]
    newer = Counter()
    newer.state_version = 2
    with pytest.raises(CheckpointVersionError, match=re.escape(f"checkpoint {path} cannot be resumed")):
        _manager(tmp_path, {"a": newer}).restore()
    refusal = re.escape(f"checkpoint {path} was written for another batching plan")
    with pytest.raises(FingerprintMismatch, match=refusal):
        _manager(tmp_path, {"a": Counter()}, fingerprint={"seed": 1, "world_size": 1}).restore()


# ---------------------------------------------------------------- states
def _draws():
    return torch.rand(3).tolist(), np.random.random(3).tolist(), [random.random() for _ in range(3)]


def test_the_rng_streams_continue_identically_after_a_restore():
    saved = RngState().state_dict()
    assert set(saved) == {"torch", "numpy", "python"}
    expected = _draws()
    _draws()  # the streams move on
    RngState().load_state_dict(saved)
    assert _draws() == expected


def test_a_torch_state_round_trips_a_module():
    source, target = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    TorchState(target).load_state_dict(TorchState(source).state_dict())
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)


def _record(tokens, samples, slots):
    return StepRecord(real_tokens=tokens, samples=samples, computed_slots=slots, loss=0.0, tau=0.0,
                      tokens_per_second=0.0, metrics={})


def test_the_train_state_counts_steps_and_epochs():
    state = TrainState(epoch=1, step_in_epoch=3, global_step=10, tokens_seen=100, samples_seen=20, computed_slots=300)
    state.advance(3, _record(7, 2, 9))
    state.advance(4, _record(5, 3, 8))
    assert (state.global_step, state.step_in_epoch) == (12, 5)
    assert (state.tokens_seen, state.samples_seen, state.computed_slots) == (112, 25, 317)
    state.end_epoch(True)
    state.end_epoch(False)
    assert (state.epoch, state.step_in_epoch, state.epochs_exactly_once) == (3, 0, [True, False])


def test_the_train_state_round_trips():
    state = TrainState(epoch=2, step_in_epoch=4, global_step=9, tokens_seen=50, samples_seen=6, computed_slots=70,
                       next_eval_tokens=64, train_time_s=1.5, epochs_exactly_once=[True, True],
                       last_eval={"tau": 2.0})
    restored = TrainState()
    restored.load_state_dict(state.state_dict())
    assert restored == state


def test_a_fresh_count_is_of_integers_and_has_no_resumed_total():
    consumed = ConsumedSamples(4, Collectives(RankEnv()))
    assert consumed.resumed_total is None  # tests/support/rank_hook.py tells a resumed run by it
    assert consumed.state_dict()["counts"].dtype == np.int64


def test_a_resumed_count_goes_to_rank_0_only():
    total = np.array([1, 0, 1, 1])
    other = ConsumedSamples(4, Collectives(RankEnv(1, 2)))
    other.load_state_dict({"counts": total})
    assert other.counts.tolist() == [0, 0, 0, 0] and other.resumed_total.tolist() == [1, 0, 1, 1]
    main = ConsumedSamples(4, Collectives(RankEnv()))
    main.load_state_dict({"counts": total})
    assert main.counts.tolist() == [1, 0, 1, 1]


# ---------------------------------------------------------------- the plan fingerprint
PLAN = dict(lengths_sha256="abc", data_fingerprint="data", max_tokens=4096, max_samples=8, strategy="packed",
            strategy_options={"b": 2, "a": 1}, balance="tokens", oversize="drop", world_size=2, grad_accum=3,
            seed=7, block_size=16, num_anchors=4, max_blocks=5, step_tokens=8192)


def test_the_fingerprint_holds_each_plan_value_under_its_name():
    fingerprint = plan_fingerprint(**PLAN)
    assert fingerprint == {**PLAN, "strategy_options": {"a": 1, "b": 2}}
    assert list(fingerprint["strategy_options"]) == ["a", "b"]
    assert set(LAYOUT_KEYS) <= set(fingerprint)


@pytest.mark.parametrize("key", sorted(set(PLAN) - set(LAYOUT_KEYS)))
def test_each_plan_value_refuses_a_change_and_is_named(tmp_path, key):
    saved = plan_fingerprint(**PLAN)
    current = plan_fingerprint(**{**PLAN, key: {"c": 3} if key == "strategy_options" else "other"})
    with pytest.raises(FingerprintMismatch, match=f"{key}: checkpoint "):
        check_fingerprint(saved, current, tmp_path / "step-00000001.pt", allowed=LAYOUT_KEYS)


def test_the_layout_may_change_when_allowed():
    saved = plan_fingerprint(**PLAN)
    current = plan_fingerprint(**{**PLAN, "world_size": 4, "grad_accum": 1})
    assert check_fingerprint(saved, current, "p", allowed=LAYOUT_KEYS) == ["grad_accum", "world_size"]
    assert check_fingerprint(saved, saved, "p", allowed=LAYOUT_KEYS) == []


def test_a_fingerprint_mismatch_names_every_difference_and_what_may_change():
    saved, path = {"seed": 0, "strategy": "a", "world_size": 1}, "ckpt/step-00000001.pt"
    with pytest.raises(FingerprintMismatch) as refused:
        check_fingerprint(saved, {**saved, "seed": 1, "strategy": "b", "world_size": 2}, path,
                          allowed=LAYOUT_KEYS)
    assert str(refused.value) == (
        f"checkpoint {path} was written for another batching plan, so resuming would not repeat the uninterrupted "
        "run: seed: checkpoint 0, now 1; strategy: checkpoint 'a', now 'b' (only world_size, grad_accum may change "
        "on resume). Resume with the checkpoint's settings, or start a fresh run in a new directory (or set "
        "trainer.resume=false)")
    with pytest.raises(FingerprintMismatch) as refused:
        check_fingerprint(saved, {**saved, "world_size": 2}, path)
    assert str(refused.value).endswith("run: world_size: checkpoint 1, now 2. Resume with the checkpoint's settings, "
                                       "or start a fresh run in a new directory (or set trainer.resume=false)")


def test_a_plan_value_only_one_side_has_is_a_difference():
    with pytest.raises(FingerprintMismatch, match="step_tokens: checkpoint None, now 8192"):
        check_fingerprint({"seed": 0}, {"seed": 0, "step_tokens": 8192}, "p")
    with pytest.raises(FingerprintMismatch, match="step_tokens: checkpoint 8192, now None"):
        check_fingerprint({"seed": 0, "step_tokens": 8192}, {"seed": 0}, "p")


def test_the_lengths_hash_sees_values_not_dtypes():
    lengths, rows = np.array([5, 9, 3]), np.array([0, 2, 4])
    digest = lengths_hash(lengths, rows)
    assert lengths_hash(lengths.astype(np.int32), rows.astype(np.int32)) == digest
    assert lengths_hash(lengths.astype(np.uint16), rows) == digest
    assert lengths_hash(lengths, rows.astype(np.int16)) == digest
    assert lengths_hash(np.array([5, 9, 4]), rows) != digest and lengths_hash(lengths, np.array([0, 2, 5])) != digest


# ---------------------------------------------------------------- versions
@pytest.mark.parametrize(("saved", "message"), [
    ({"fingerprint": {}}, "has checkpoint format 1, this batchlab reads format 2: an older batchlab wrote it"),
    (["a bare list"], "has checkpoint format 1, this batchlab reads format 2: an older batchlab wrote it"),
    ({"format": 1}, "has checkpoint format 1, this batchlab reads format 2: an older batchlab wrote it"),
    ({"format": 99}, "has checkpoint format 99, this batchlab reads format 2: a newer batchlab wrote it"),
])
def test_another_checkpoint_format_is_refused_naming_the_file(saved, message):
    with pytest.raises(CheckpointVersionError) as refused:
        check_versions(saved, {"a": 1}, "run/step-00000001.pt")
    assert str(refused.value) == f"checkpoint run/step-00000001.pt {message}; {FIX}"


@pytest.mark.parametrize(("entry", "reads", "problem"), [
    ({"version": 1, "state": {}}, 2, "'a' state is version 1 (older), this batchlab reads 2"),
    ({"version": 2, "state": {}}, 1, "'a' state is version 2 (newer), this batchlab reads 1"),
    ({"state": {}}, 1, "'a' state is version None (older), this batchlab reads 1"),
])
def test_another_state_version_is_refused_naming_the_file(entry, reads, problem):
    with pytest.raises(CheckpointVersionError) as refused:
        check_versions({"format": 2, "components": {"a": entry}}, {"a": reads}, "run/step-00000001.pt")
    assert str(refused.value) == f"checkpoint run/step-00000001.pt cannot be resumed by this batchlab: {problem}; {FIX}"


def test_every_version_problem_is_named_at_once():
    with pytest.raises(CheckpointVersionError) as refused:
        check_versions({"format": 2, "components": {"b": {"version": 3}}}, {"a": 1, "b": 1}, "p")
    assert "this batchlab: 'a' is missing; 'b' state is version 3 (newer), this batchlab reads 1; resume" in str(
        refused.value)


def test_a_checkpoint_without_components_misses_each_one():
    with pytest.raises(CheckpointVersionError, match="'a' is missing"):
        check_versions({"format": 2}, {"a": 1}, "p")
    check_versions({"format": 2}, {}, "p")  # nothing expected, nothing missing
