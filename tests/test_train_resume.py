"""Checkpoint and resume: a run killed mid-epoch continues exactly as the uninterrupted run; other plans are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from train_support import compose_config, read_jsonl, train_cli

from harness.train.checkpoint import FingerprintMismatch, checkpoint_paths
from harness.train.trainer import run

# 2 ranks, small enough to be quick, long enough to kill after a checkpoint but before the end
ARGS = ["experiment=smoke", "strategy=bucketed", "logger=none", "trainer.progress=false", "trainer.record_consumed=true",
        "trainer.stop_tokens=30000", "trainer.checkpoint_every_steps=4", "trainer.eval_every_tokens=8000"]
DETERMINISTIC = ("loss", "loss_max_rank", "grad_norm", "tau", "accuracy", "lr", "grad_diversity", "tokens_seen",
                 "real_tokens", "computed_slots", "eval_loss", "eval_tau", "epoch", "step_in_epoch")


def _launch(run_dir, cwd):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "harness.cli.train", *ARGS, f"hydra.run.dir={run_dir}"], cwd=cwd,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def test_killed_run_resumes_exactly(tmp_path, batchlab_cache):
    reference = tmp_path / "reference"
    result = train_cli([*ARGS, f"hydra.run.dir={reference}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    expected = read_jsonl(reference / "metrics.jsonl")
    assert len(expected) >= 16

    killed = tmp_path / "killed"
    process = _launch(killed, tmp_path)
    deadline = time.time() + 240
    try:
        while time.time() < deadline:  # kill the whole job (launcher and ranks) a few steps past a checkpoint
            metrics = killed / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 10:
                break
            assert process.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    steps_before = len(read_jsonl(killed / "metrics.jsonl"))
    assert 10 <= steps_before < len(expected), "the kill did not land mid-run"
    assert checkpoint_paths(killed), "no checkpoint before the kill"

    resumed = train_cli([*ARGS, f"hydra.run.dir={killed}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    got = read_jsonl(killed / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got):  # bit-identical on CPU: same batches, anchors, states
        for key in DETERMINISTIC:
            assert have.get(key) == want.get(key), f"step {want['step']}: {key} {have.get(key)} != {want.get(key)}"
    for rank in (0, 1):  # the same micro-batches, in the same order, nothing repeated
        assert read_jsonl(killed / "consumed" / f"rank{rank}.jsonl") == read_jsonl(
            reference / "consumed" / f"rank{rank}.jsonl")
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["samples_seen_once"] is True and summary["status"] == "complete"


def test_resume_with_another_plan_is_refused(tmp_path, batchlab_cache):
    base = ["experiment=smoke", "trainer.nproc=1", "trainer.num_workers=0", "logger=none", "trainer.progress=false",
            "trainer.stop_tokens=3000", "strategy=packed"]
    run(compose_config(base), tmp_path)
    assert checkpoint_paths(tmp_path)
    with pytest.raises(FingerprintMismatch) as refused:
        run(compose_config([*base, "trainer.max_tokens=512"]), tmp_path)
    assert "max_tokens: checkpoint 1024, now 512" in str(refused.value)
    with pytest.raises(FingerprintMismatch, match="strategy: checkpoint 'packed', now 'sorted'"):
        run(compose_config([*base, "strategy=sorted"]), tmp_path)
    with pytest.raises(FingerprintMismatch, match="seed: checkpoint 0, now 1"):
        run(compose_config([*base, "seed=1"]), tmp_path)
    # a finished run in the same directory with the same plan resumes (nothing left to do) and keeps its numbers
    before = read_jsonl(tmp_path / "metrics.jsonl")
    summary = run(compose_config(base), tmp_path)
    assert summary["status"] == "complete" and read_jsonl(tmp_path / "metrics.jsonl") == before
