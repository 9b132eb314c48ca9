"""Elastic resume: a checkpoint taken on N ranks resumes on M ranks mid-epoch, every sample of the epoch once.

The run is killed (SIGKILL: back to its last periodic checkpoint) or stopped (SIGTERM: the ranks finish
their step and checkpoint it) part-way through its first epoch, then resumed with another ``trainer.nproc``: the rest of the epoch is re-planned for the
new world size, nothing consumed before is repeated, and the next epoch is planned as usual. Any other
change of the plan is still refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from support.process import failure_text
from support.train import (
    assert_same_records,
    assert_same_summary,
    compose_config,
    read_jsonl,
    signal_after_steps,
    train_cli,
)

from harness.data.cache import write_checksum
from harness.train.loop.checkpoint import FingerprintMismatch, check_fingerprint, checkpoint_paths, component_state
from harness.train.launch.run import RunDirectoryInUse, config_differences, run

# 21 steps an epoch on 2 ranks (42 on 1), 1.07 epochs: the resumed run finishes epoch 0 and starts epoch 1;
# one eval, at the end
ARGS = ["experiment=smoke", "strategy=bucketed", "logger=none", "trainer.progress=false",
        "trainer.stop_tokens=26500", "trainer.checkpoint_every_steps=4", "trainer.eval_every_tokens=100000"]


def _stop_mid_epoch(run_dir, cwd, extra, after_steps, sig):
    """Start the run, send ``sig`` to its process group after ``after_steps`` steps; the last checkpoint's state."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, "-m", "harness.cli.train", *ARGS, *extra, f"hydra.run.dir={run_dir}"],
                               cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    signal_after_steps(process, run_dir, after_steps, sig)
    if sig == signal.SIGTERM:
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    else:
        assert not (run_dir / "summary.json").exists()
    saved = torch.load(checkpoint_paths(run_dir)[-1], map_location="cpu", weights_only=False)
    assert component_state(saved, "progress")["epoch"] == 0 and 0 < component_state(saved, "progress")["step_in_epoch"], "the stop did not land mid-epoch"
    return saved


def _consumed(run_dir, epoch):
    """``(step, rows)`` of every micro-batch of ``epoch`` in the consumed logs of all ranks."""
    return [(r["step"], row) for path in sorted((run_dir / "consumed").glob("rank*.jsonl"))
            for r in read_jsonl(path) if r["epoch"] == epoch for row in r["rows"]]


def _assert_epoch_exactly_once(run_dir, checkpoint_step, train_samples):
    epoch0 = _consumed(run_dir, 0)
    rows = [row for _, row in epoch0]
    assert len(rows) == len(set(rows)) == train_samples, (
        f"epoch 0: {len(rows)} visits of {len(set(rows))} distinct rows, {train_samples} training samples")
    before = {row for step, row in epoch0 if step <= checkpoint_step}
    after = {row for step, row in epoch0 if step > checkpoint_step}
    assert before and after and not before & after
    epoch1 = [row for _, row in _consumed(run_dir, 1)]
    assert epoch1 and len(epoch1) == len(set(epoch1)) and set(epoch1) <= set(rows)


def _assert_metrics_continue(run_dir, checkpoint_step):
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    resumed = records[checkpoint_step]  # the first step after the checkpoint: the re-planned rest of epoch 0
    assert (resumed["epoch"], resumed["step_in_epoch"]) == (0, 0) and "plan_acf" not in resumed
    first_of_epoch1 = next(r for r in records if r["epoch"] == 1)
    assert first_of_epoch1["step_in_epoch"] == 0 and "plan_acf" in first_of_epoch1  # planned normally
    return records


@pytest.fixture(scope="module")
def stopped_on_two_ranks(tmp_path_factory, batchlab_cache):
    """A 2-rank run killed mid-epoch 0 (kept pristine: tests resume copies of it)."""
    run_dir = tmp_path_factory.mktemp("two-ranks") / "run"
    saved = _stop_mid_epoch(run_dir, run_dir.parent, ["trainer.nproc=2"], after_steps=6, sig=signal.SIGKILL)
    return run_dir, saved


@pytest.fixture(scope="module")
def resumed_on_one_rank(tmp_path_factory, stopped_on_two_ranks):
    """A copy of the 2-rank run resumed on 1 rank, run to the end: ``(run dir, stdout)``."""
    source, saved = stopped_on_two_ranks
    run_dir = tmp_path_factory.mktemp("one-rank") / "run"
    shutil.copytree(source, run_dir)
    # killed after its last checkpoint: the steps past it are consumed again, and rank 1 is no more
    step = component_state(saved, "progress")["global_step"]
    assert max(r["step"] for r in read_jsonl(run_dir / "consumed" / "rank1.jsonl")) > step, "killed at a checkpoint"
    resumed = train_cli([*ARGS, "trainer.nproc=1", f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert resumed.returncode == 0, failure_text(resumed)
    return run_dir, resumed.stdout


def test_two_ranks_resume_on_one_rank_mid_epoch_exactly_once(stopped_on_two_ranks, resumed_on_one_rank):
    _, saved = stopped_on_two_ranks
    run_dir, stdout = resumed_on_one_rank
    step, step_in_epoch = component_state(saved, "progress")["global_step"], component_state(saved, "progress")["step_in_epoch"]
    assert saved["fingerprint"]["world_size"] == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    left = summary["train_samples"] - int((component_state(saved, "consumed")["counts"] > 0).sum())
    assert (f"resumed a 2-rank checkpoint on 1 rank at epoch 0, step {step_in_epoch}: {left} samples left in the "
            "epoch, re-planned") in stdout
    assert summary["status"] == "complete" and summary["world_size"] == 1
    assert summary["tokens_seen"] >= 26500 and summary["epochs_exactly_once"] == [True]
    assert summary["samples_seen_once"] is True
    _assert_epoch_exactly_once(run_dir, step, summary["train_samples"])
    assert max(r["step"] for r in read_jsonl(run_dir / "consumed" / "rank1.jsonl")) == step  # cut back to it
    records = _assert_metrics_continue(run_dir, step)
    # one rank from the checkpoint on: the rest of epoch 0 takes the steps its 1-rank plan has
    planned = int(re.search(r"re-planned \((\d+) steps\)", stdout).group(1))
    assert sum(r["epoch"] == 0 and r["step"] > step for r in records) == planned > 21 - step_in_epoch
    assert not (run_dir / "consumed" / "rank1.jsonl").read_text().count('"epoch": 1')


def test_a_resume_inside_the_replanned_epoch_repeats_it_exactly(tmp_path, stopped_on_two_ranks, resumed_on_one_rank):
    """2 ranks -> 1 rank, stopped again inside the re-planned epoch, -> 1 rank: the same run as 2 -> 1 directly."""
    source, saved = stopped_on_two_ranks
    reference, _ = resumed_on_one_rank
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    again = _stop_mid_epoch(run_dir, tmp_path, ["trainer.nproc=1"],
                            after_steps=component_state(saved, "progress")["global_step"] + 6, sig=signal.SIGTERM)
    assert again["fingerprint"]["world_size"] == 1 and component_state(again, "data")["replanned"] is not None
    resumed = train_cli([*ARGS, "trainer.nproc=1", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert resumed.returncode == 0, failure_text(resumed)
    assert "resumed a" not in resumed.stdout  # the same world size: the checkpoint's own (re-planned) plan
    assert_same_records(reference, run_dir)  # bit-identical on CPU: same batches, anchors, states
    assert_same_summary(reference, run_dir)
    for rank in (0, 1):
        assert read_jsonl(run_dir / "consumed" / f"rank{rank}.jsonl") == read_jsonl(
            reference / "consumed" / f"rank{rank}.jsonl")
    assert json.loads((run_dir / "summary.json").read_text())["epochs_exactly_once"] == [True]


def test_one_rank_resumes_on_two_ranks_with_another_accumulation(tmp_path, batchlab_cache):
    run_dir = tmp_path / "run"
    saved = _stop_mid_epoch(run_dir, tmp_path, ["trainer.nproc=1", "trainer.grad_accum=2"], after_steps=4,
                            sig=signal.SIGTERM)
    step, step_in_epoch = component_state(saved, "progress")["global_step"], component_state(saved, "progress")["step_in_epoch"]
    resumed = train_cli([*ARGS, "trainer.nproc=2", "trainer.grad_accum=1", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert resumed.returncode == 0, failure_text(resumed)
    assert (f"resumed a 1-rank checkpoint on 2 ranks (grad_accum 2 -> 1) at epoch 0, step {step_in_epoch}: "
            in resumed.stdout)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == 2 and summary["grad_accum"] == 1
    assert summary["epochs_exactly_once"] == [True] and summary["samples_seen_once"] is True
    _assert_epoch_exactly_once(run_dir, step, summary["train_samples"])
    rank1 = read_jsonl(run_dir / "consumed" / "rank1.jsonl")
    assert rank1 and min(r["step"] for r in rank1) == step + 1  # the second rank joined at the resume
    _assert_metrics_continue(run_dir, step)


def test_other_changes_than_the_world_size_are_still_refused(tmp_path, stopped_on_two_ranks):
    source, saved = stopped_on_two_ranks
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    base = [*ARGS, "trainer.nproc=1", "trainer.num_workers=0"]
    # a changed setting is refused by the run directory, naming it (and not the world size)
    with pytest.raises(RunDirectoryInUse) as refused:
        run(compose_config([*base, "seed=1"]), run_dir)
    assert "seed: 0 -> 1" in str(refused.value) and "nproc" not in str(refused.value)
    # a checkpoint written for another plan is refused by its fingerprint, naming the difference
    latest = checkpoint_paths(run_dir)[-1]
    tampered = {**saved, "fingerprint": {**saved["fingerprint"], "lengths_sha256": "0" * 64}}
    torch.save(tampered, latest)
    write_checksum(latest)  # a well-formed checkpoint of another plan, not a damaged one
    with pytest.raises(FingerprintMismatch) as refused:
        run(compose_config(base), run_dir)
    message = str(refused.value)
    assert "lengths_sha256" in message and "world_size" not in message.split("(only")[0]
    assert "only world_size, grad_accum may change on resume" in message


def test_layout_keys_are_the_only_allowed_differences():
    saved = {"world_size": 2, "grad_accum": 1, "seed": 0, "max_tokens": 1024}
    assert check_fingerprint(saved, dict(saved), "ckpt", allowed=("world_size", "grad_accum")) == []
    assert check_fingerprint(saved, {**saved, "world_size": 1, "grad_accum": 2}, "ckpt",
                             allowed=("world_size", "grad_accum")) == ["grad_accum", "world_size"]
    with pytest.raises(FingerprintMismatch, match="world_size: checkpoint 2, now 1"):
        check_fingerprint(saved, {**saved, "world_size": 1}, "ckpt")  # not allowed: refused as before
    with pytest.raises(FingerprintMismatch, match="max_tokens: checkpoint 1024, now 512") as refused:
        check_fingerprint(saved, {**saved, "world_size": 1, "max_tokens": 512}, "ckpt", allowed=("world_size",))
    assert "world_size: checkpoint" not in str(refused.value)
    old = {"trainer": {"nproc": 2, "grad_accum": 1, "max_tokens": 1024}, "seed": 0}
    new = {"trainer": {"nproc": 1, "grad_accum": 2, "max_tokens": 1024}, "seed": 0}
    assert config_differences(old, new) == []
    assert config_differences(old, {**new, "seed": 3}) == ["seed: 0 -> 3"]
