"""Failures never hang: a rank that dies ends the job quickly, naming the rank, its stage and its step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.process import failure_text, run_process
from support.rank_hook import TEST_FAIL_ENV
from support.train import assert_same_records, assert_same_summary, read_jsonl, train_cli

from harness.train.loop.checkpoint import component_state, latest_checkpoint, load_checkpoint
from harness.train.status import RECORD_SIZE, RankStatus, describe, read_statuses, status_path

# 2 gloo ranks, a checkpoint every 2 steps, long enough that step 5 is mid-run
ARGS = ["experiment=smoke", "strategy=bucketed", "logger=none", "trainer.progress=false",
        "trainer.stop_tokens=30000", "trainer.checkpoint_every_steps=2", "trainer.eval_every_tokens=100000",
        "trainer.eval_real_prompts=0"]
FAIL_STEP = 5
# the agent notices a dead rank within 0.5 s and stops the rest; a rank that ignores SIGTERM is SIGKILLed after 30 s
BOUND_S = 30


def _fail(run_dir, spec, *extra):
    """Run with ``BATCHLAB_TEST_FAIL=spec``; (result, seconds from the failing rank's last status to the end)."""
    result = train_cli([*ARGS, *extra, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                       env_extra={TEST_FAIL_ENV: spec}, timeout=240)
    ended = time.time()
    failing_rank = int(spec.split(":")[0])
    status = read_statuses(run_dir)[failing_rank]
    return result, ended - status["time"]


def _assert_checkpoint_survives(run_dir, last_step):
    path = latest_checkpoint(run_dir)
    assert path is not None and path.name == f"step-{last_step:08d}.pt", path
    saved = load_checkpoint(path)
    assert component_state(saved, "progress")["global_step"] == last_step
    assert set(component_state(saved, "drafter")) and component_state(saved, "optimizer")["state"]
    return path


def _message(result):
    lines = [line for line in result.stderr.splitlines() if line.startswith("batchlab-train: rank")]
    assert len(lines) == 1, result.stderr[-6000:]
    # the message, not a Python traceback of the launcher, ends the output
    assert "Traceback" not in result.stderr.split(lines[0])[1], result.stderr[-3000:]
    assert "RankFailed" not in result.stderr and "Error executing job" not in result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, batchlab_cache):
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = train_cli([*ARGS, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert result.returncode == 0, failure_text(result)
    return run_dir


def test_killed_rank_ends_the_job_naming_rank_stage_and_step(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    result, after_kill = _fail(run_dir, f"1:{FAIL_STEP}:drafter_backward:kill")
    assert result.returncode == 1, result.stderr[-6000:]
    assert after_kill < BOUND_S, f"the job took {after_kill:.1f} s to end after the kill"
    message = _message(result)
    assert message.startswith(f"batchlab-train: rank 1 failed in stage 'drafter_backward' of step {FAIL_STEP}"), message
    assert "killed by signal 9 (SIGKILL)" in message and "out-of-memory killer" in message
    assert "rank 0 in stage" in message  # where the survivor was when it was stopped
    checkpoint = _assert_checkpoint_survives(run_dir, FAIL_STEP - 1)
    assert str(checkpoint) in message and f"hydra.run.dir={run_dir}" in message
    assert not (run_dir / "summary.json").exists()

    # the surviving checkpoint resumes the run to its end: the uninterrupted run, bit for bit
    resumed = train_cli([*ARGS, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert resumed.returncode == 0, failure_text(resumed)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["samples_seen_once"] is True
    assert all(s["stage"] == "done" for s in read_statuses(run_dir).values())
    assert_same_records(uninterrupted, run_dir)
    assert_same_summary(uninterrupted, run_dir)
    for rank in (0, 1):
        assert read_jsonl(run_dir / "consumed" / f"rank{rank}.jsonl") == read_jsonl(
            uninterrupted / "consumed" / f"rank{rank}.jsonl")


def test_exception_in_a_rank_is_named_with_its_stage_and_step(tmp_path, batchlab_cache):
    run_dir = tmp_path / "run"
    result, after_failure = _fail(run_dir, f"1:{FAIL_STEP}:target_forward:raise")
    assert result.returncode == 1, result.stderr[-6000:]
    assert after_failure < BOUND_S
    message = _message(result)
    assert message.startswith(f"batchlab-train: rank 1 failed in stage 'target_forward' of step {FAIL_STEP}: "
                              f"it exited with code 1: RuntimeError: {TEST_FAIL_ENV}: simulated failure"), message
    traceback_file = run_dir / "status" / "rank1.traceback"
    assert str(traceback_file) in message
    text = traceback_file.read_text()
    assert 'tests/support/rank_hook.py", line' in text  # the rank's own traceback, with the stage noted on the exception
    assert f"batchlab: rank 1 failed in stage 'target_forward' of step {FAIL_STEP}" in text
    _assert_checkpoint_survives(run_dir, FAIL_STEP - 1)


def test_out_of_memory_in_rank_0_names_the_fix(tmp_path, batchlab_cache):
    run_dir = tmp_path / "run"
    result, _ = _fail(run_dir, f"0:{FAIL_STEP}:drafter_forward:oom")
    assert result.returncode == 1, result.stderr[-6000:]
    message = _message(result)
    assert message.startswith(f"batchlab-train: rank 0 failed in stage 'drafter_forward' of step {FAIL_STEP}"), message
    assert "OutOfMemoryError" in message and "lower trainer.max_tokens" in message
    _assert_checkpoint_survives(run_dir, FAIL_STEP - 1)


def test_hung_rank_ends_the_job_at_the_collective_timeout(tmp_path, batchlab_cache):
    """A rank alive but stuck: the other rank's collective times out (gloo honours trainer.collective_timeout_s)."""
    run_dir = tmp_path / "run"
    started = time.time()
    result = train_cli([*ARGS, "trainer.collective_timeout_s=4", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                       env_extra={TEST_FAIL_ENV: f"1:{FAIL_STEP}:data_wait:hang"}, timeout=240)
    assert result.returncode == 1, result.stderr[-6000:]
    hung_at = read_statuses(run_dir)[1]["time"]
    # the 4 s timeout, then the agent stops the stuck rank (the test hook lets SIGTERM end it)
    assert time.time() - hung_at < 4 + BOUND_S and hung_at > started
    message = _message(result)
    assert message.startswith("batchlab-train: rank 0 failed in stage "), message
    assert f"of step {FAIL_STEP}" in message and "trainer.collective_timeout_s=4" in message
    assert f"rank 1 in stage 'data_wait' of step {FAIL_STEP}" in message  # the one that stopped answering


def test_exception_on_one_rank_with_dataloader_workers_exits(tmp_path, batchlab_cache):
    """One process: Python's own error, then exit; its DataLoader worker (which ignores SIGTERM) must not
    keep it waiting at interpreter exit."""
    run_dir = tmp_path / "run"
    result = train_cli([*ARGS, "trainer.nproc=1", "trainer.num_workers=1", "trainer.stop_tokens=6000",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120,
                       env_extra={TEST_FAIL_ENV: "0:3:drafter_forward:raise"})
    assert result.returncode == 1, failure_text(result)
    assert f"RuntimeError: {TEST_FAIL_ENV}: simulated failure of rank 0" in result.stderr
    assert "batchlab: rank 0 failed in stage 'drafter_forward' of step 3" in result.stderr  # the note on the error
    assert (run_dir / "status" / "rank0.traceback").exists()


# ---------------------------------------------------------------- the status files themselves
def test_status_records_the_last_stage_of_each_rank(tmp_path):
    first, second = RankStatus(tmp_path, 0), RankStatus(tmp_path, 3, role="target")
    first.stage("target_forward", 7)
    second.stage("a_stage_name_longer_than_the_record_keeps_" * 3, 2)
    first.stage("optimizer", 7)
    statuses = read_statuses(tmp_path)
    assert sorted(statuses) == [0, 3]
    assert statuses[0]["stage"] == "optimizer" and statuses[0]["step"] == 7 and statuses[0]["role"] == "train"
    assert statuses[0]["pid"] == os.getpid() and abs(statuses[0]["time"] - time.time()) < 5
    assert statuses[3]["role"] == "target" and statuses[3]["stage"].startswith("a_stage_name")
    assert describe(statuses[0]) == "in stage 'optimizer' of step 7"  # the role only when not "train"
    assert describe(statuses[3]).endswith(" of step 2 (role target)")
    assert status_path(tmp_path, 3).stat().st_size == RECORD_SIZE  # rewritten in place, never appended
    later = time.time() + 1
    assert read_statuses(tmp_path, since=later) == {}  # an earlier run's files are not this run's
    first.close()
    second.close()
    first.stage("after_close", 8)  # a no-op, not an error
    assert read_statuses(tmp_path)[0]["stage"] == "optimizer"


def test_status_survives_sigkill_of_its_writer(tmp_path):
    code = ("import os, signal, sys; from harness.train.status import RankStatus; "
            "s = RankStatus(sys.argv[1], 1); s.stage('drafter_backward', 12); os.kill(os.getpid(), signal.SIGKILL)")
    process = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=dict(os.environ), timeout=60, check=False)
    assert process.returncode == -signal.SIGKILL
    status = read_statuses(tmp_path)[1]
    assert status["stage"] == "drafter_backward" and status["step"] == 12


def test_torn_or_foreign_status_files_are_ignored(tmp_path):
    status = RankStatus(tmp_path, 0)
    status.stage("eval", 3)
    status.close()
    data = bytearray(status_path(tmp_path, 0).read_bytes())
    data[-1] ^= 0xFF  # the trailing sequence number no longer matches: a write caught half done
    status_path(tmp_path, 0).write_bytes(bytes(data))
    (tmp_path / "status" / "rank1.status").write_bytes(b"not a status record")
    assert read_statuses(tmp_path) == {}
    assert read_statuses(tmp_path / "missing") == {}


def test_status_cli_prints_every_rank(tmp_path):
    with RankStatus(tmp_path, 1) as status:
        status.stage("checkpoint", 40)
    out = subprocess.run([sys.executable, "-m", "harness.train.status", str(tmp_path)], capture_output=True,
                         text=True, check=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))).stdout
    assert re.match(r"rank 1 \(pid \d+\) in stage 'checkpoint' of step 40, [\d.]+ s ago", out), out


def test_status_says_how_a_run_ended(tmp_path):
    """A rank whose process is gone reads as failed (with its one-line error) when it left an error record,
    as stopped otherwise; a live one reads as where it is; a finished run as finished."""
    import json

    from harness.train.status import rank_lines

    code = ("import sys; from harness.train.status import RankStatus; "
            "s = RankStatus(sys.argv[1], int(sys.argv[2])); s.stage('setup', 0); s.close()")
    for rank in (0, 1):
        subprocess.run([sys.executable, "-c", code, str(tmp_path), str(rank)], check=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])))
    with RankStatus(tmp_path, 2) as status:  # this process: alive
        status.stage("drafter_forward", 7)
    (tmp_path / "status" / "rank0.error.json").write_text(json.dumps(
        {"error": "ValueError: data.source 'nope.jsonl' does not exist", "time": time.time() + 1, "status": None}))
    lines = rank_lines(tmp_path)
    assert re.match(r"rank 0 \(pid \d+\) failed in stage 'setup' of step 0: ValueError: data.source 'nope.jsonl' "
                    r"does not exist \(traceback: .*rank0.traceback\)", lines[0]), lines
    assert re.match(r"rank 1 \(pid \d+\) stopped in stage 'setup' of step 0, [\d.]+ s ago; its process is gone",
                    lines[1]), lines
    assert re.match(r"rank 2 \(pid \d+\) in stage 'drafter_forward' of step 7, [\d.]+ s ago$", lines[2]), lines
    (tmp_path / "status" / "rank0.error.json").unlink()
    (tmp_path / "summary.json").write_text(json.dumps({"status": "complete"}))
    assert all(" finished (complete) " in line for line in rank_lines(tmp_path)), rank_lines(tmp_path)


def test_malformed_test_failure_spec_is_refused(monkeypatch):
    from support.rank_hook import failure_spec as _test_failure

    monkeypatch.setenv(TEST_FAIL_ENV, "1:five:target_forward:kill")
    with pytest.raises(ValueError, match="RANK:STEP:STAGE:MODE"):
        _test_failure(1)
    monkeypatch.setenv(TEST_FAIL_ENV, "1:5:target_forward:explode")
    with pytest.raises(ValueError, match="MODE must be one of"):
        _test_failure(1)
    monkeypatch.setenv(TEST_FAIL_ENV, "1:5:target_forward:kill")
    assert _test_failure(0) is None and _test_failure(1) == (5, "target_forward", "kill")


def test_under_an_external_torchrun_the_root_cause_carries_stage_and_step(tmp_path, batchlab_cache):
    run_dir = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{TEST_FAIL_ENV: "1:3:target_forward:raise"})
    result = run_process(
        [str(torchrun), "--nproc_per_node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "-m",
         "harness.cli.train", *ARGS, "trainer.nproc=1", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, timeout=240)
    assert result.returncode == 1, failure_text(result)
    root_cause = result.stderr.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", root_cause), root_cause
    assert "batchlab: rank 1 failed in stage 'target_forward' of step 3" in root_cause
    statuses = read_statuses(run_dir)  # the same status files as under batchlab's own launch
    assert sorted(statuses) == [0, 1] and statuses[1]["stage"] == "target_forward" and statuses[1]["step"] == 3
