"""Checkpoint and resume: a run killed mid-epoch continues exactly as the uninterrupted run; other plans are refused."""

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
from support.process import failure_text
from support.rank_hook import TEST_FAIL_ENV
from support.train import (
    assert_same_records,
    assert_same_summary,
    compose_config,
    read_jsonl,
    signal_after_steps,
    train_cli,
)

from harness.train.launch.run import RunDirectoryInUse, run
from harness.train.loop.checkpoint import FingerprintMismatch, checkpoint_paths

# 2 ranks, small enough to be quick, long enough to kill after a checkpoint but before the end
ARGS = ["experiment=smoke", "strategy=bucketed", "logger=none", "trainer.progress=false",
        "trainer.stop_tokens=30000", "trainer.checkpoint_every_steps=4", "trainer.eval_every_tokens=8000"]


def _launch(run_dir, cwd):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "harness.cli.train", *ARGS, f"hydra.run.dir={run_dir}"], cwd=cwd,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, batchlab_cache):
    """The uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = train_cli([*ARGS, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert result.returncode == 0, failure_text(result)
    assert len(read_jsonl(run_dir / "metrics.jsonl")) >= 16
    return run_dir


def _stop_mid_run(run_dir, cwd, sig, after_steps=10):
    """Start the run and send ``sig`` to its whole process group (launcher and ranks) after some steps."""
    return signal_after_steps(_launch(run_dir, cwd), run_dir, after_steps, sig)


def _assert_same_run(reference, run_dir):
    # bit-identical on CPU: same batches, anchors, states; every logged number but the timings
    assert_same_records(reference, run_dir)
    assert_same_summary(reference, run_dir)
    for rank in (0, 1):  # the same micro-batches, in the same order, nothing repeated
        assert read_jsonl(run_dir / "consumed" / f"rank{rank}.jsonl") == read_jsonl(
            reference / "consumed" / f"rank{rank}.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_seen_once"] is True and summary["status"] == "complete"
    # the per-sample evaluation too: the lines after the checkpoint were dropped and written again, once
    per_sample = read_jsonl(reference / "eval_samples.jsonl")
    assert per_sample and read_jsonl(run_dir / "eval_samples.jsonl") == per_sample


def test_killed_run_resumes_exactly(tmp_path, reference):
    killed = tmp_path / "killed"
    _stop_mid_run(killed, tmp_path, signal.SIGKILL)
    steps_before = len(read_jsonl(killed / "metrics.jsonl"))
    assert 10 <= steps_before < len(read_jsonl(reference / "metrics.jsonl")), "the kill did not land mid-run"
    assert checkpoint_paths(killed), "no checkpoint before the kill"
    assert not (killed / "summary.json").exists()
    resumed = train_cli([*ARGS, f"hydra.run.dir={killed}"], cwd=tmp_path)
    assert resumed.returncode == 0, failure_text(resumed)
    assert re.search(r"resuming from step \d+ \([\d,]+ tokens, epoch \d+\)", resumed.stdout), resumed.stdout[-2000:]
    _assert_same_run(reference, killed)


def test_sigterm_checkpoints_the_current_step_and_resumes_exactly(tmp_path, reference):
    stopped = tmp_path / "stopped"
    started = time.time()
    returncode = _stop_mid_run(stopped, tmp_path, signal.SIGTERM, after_steps=6)
    assert returncode == 130
    assert time.time() - started < 240, "the stopped run hung instead of finishing its step and checkpointing"
    summary = json.loads((stopped / "summary.json").read_text())
    steps = len(read_jsonl(stopped / "metrics.jsonl"))
    assert summary["status"] == "interrupted" and summary["steps"] == steps
    assert checkpoint_paths(stopped)[-1].name == f"step-{steps:08d}.pt"  # the step it stopped at, not an older one
    resumed = train_cli([*ARGS, f"hydra.run.dir={stopped}"], cwd=tmp_path)
    assert resumed.returncode == 0, failure_text(resumed)
    _assert_same_run(reference, stopped)


def test_a_run_directory_is_never_shared_by_two_runs(tmp_path, batchlab_cache):
    base = ["experiment=smoke", "trainer.nproc=1", "trainer.num_workers=0", "logger=none", "trainer.progress=false",
            "trainer.stop_tokens=3000", "strategy=packed"]
    run(compose_config(base), tmp_path)
    assert checkpoint_paths(tmp_path)
    for override, named in [("trainer.max_tokens=512", "trainer.max_tokens: 1024 -> 512"),
                            ("strategy=sorted", "strategy.name: 'packed' -> 'sorted'"),
                            ("seed=1", "seed: 0 -> 1"), ("optim.lr=0.001", "optim.lr: 0.0006 -> 0.001")]:
        with pytest.raises(RunDirectoryInUse) as refused:
            run(compose_config([*base, override]), tmp_path)
        assert named in str(refused.value)
    # the same run again: complete, so skipped, its files untouched (a rerun sweep resumes where it stopped)
    before = read_jsonl(tmp_path / "metrics.jsonl")
    summary = run(compose_config([*base, "trainer.progress=true"]), tmp_path)
    assert summary["status"] == "complete" and read_jsonl(tmp_path / "metrics.jsonl") == before


def test_resume_on_other_data_is_refused_by_the_plan_fingerprint(tmp_path, batchlab_cache):
    data = tmp_path / "data.jsonl"
    rows = [{"input_ids": list(range(2, 30 + i))} for i in range(30)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = compose_config(["trainer.nproc=1", "trainer.num_workers=0", "logger=none", "trainer.progress=false",
                             f"data.source={data}", "data.max_documents=null", "data.vocab_size=300",
                             "trainer.max_tokens=128", "trainer.stop_tokens=100000", "trainer.checkpoint_every_steps=2",
                             "strategy=packed"])
    run_dir = tmp_path / "run"
    summary = run({**config, "trainer": {**config["trainer"], "stop_tokens": 600}}, run_dir)
    assert summary["status"] == "complete"
    (run_dir / "summary.json").unlink()  # as if stopped before the end
    data.write_text("".join(json.dumps({"input_ids": r["input_ids"][:-1]}) + "\n" for r in rows))  # other lengths
    with pytest.raises(FingerprintMismatch) as refused:
        run({**config, "trainer": {**config["trainer"], "stop_tokens": 600}}, run_dir)
    assert "lengths_sha256" in str(refused.value) and "data_fingerprint" in str(refused.value)


def test_a_run_that_failed_before_its_first_checkpoint_claims_nothing(tmp_path, batchlab_cache):
    """A typo in data.source, or a sample over the budget under trainer.oversize=error, is bad input: exit status
    2, one line, the traceback in train.log, no config.json. A run that starts and fails before its first
    checkpoint claims nothing: the same command, corrected, runs in its place, and train.log holds the failed
    rank's traceback and the new run's own lines. A rerun with other settings over the finished run is refused
    with exit status 2 and one line, and leaves the directory as it was (.hydra/*.yaml put back, config.json and
    the metrics untouched); so does bad input found before the directory is claimed (its train.log untouched,
    the traceback in a file of its own)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(2, 40 + i))}) + "\n" for i in range(40)))
    run_dir = tmp_path / "run"
    base = ["experiment=smoke", "trainer.nproc=1", "trainer.num_workers=0", "logger=none", "trainer.progress=false",
            "data.max_documents=null", "data.vocab_size=300", "trainer.max_tokens=64", "trainer.stop_tokens=600",
            "trainer.eval_real_prompts=0", f"hydra.run.dir={run_dir}"]
    for bad, named in ((f"data.source={tmp_path / 'nope.jsonl'}", "does not exist"),
                       (f"data.source={data}", "more than trainer.max_tokens=64")):
        typo = train_cli([*base, bad, "trainer.oversize=error"], cwd=tmp_path)
        assert typo.returncode == 2, typo.stderr[-3000:]
        lines = [line for line in typo.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and named in lines[0] and "traceback in " in lines[0], typo.stderr
        assert not (run_dir / "config.json").exists() and "Traceback" in (run_dir / "train.log").read_text()
    assert "trainer.oversize=drop" in lines[0] and "sample " in lines[0]  # the sample, the setting and the fix
    failed = train_cli([*base, f"data.source={data}", "trainer.oversize=truncate"], cwd=tmp_path,
                       env_extra={TEST_FAIL_ENV: "0:1:drafter_forward:raise"})  # fails in the rank, at step 1
    assert failed.returncode == 1 and (run_dir / "config.json").exists(), failed.stderr[-3000:]
    assert "[rank 0] Traceback" in (run_dir / "train.log").read_text()
    corrected = train_cli([*base, f"data.source={data}", "trainer.oversize=drop"], cwd=tmp_path)
    assert corrected.returncode == 0, corrected.stderr[-3000:]
    assert "held a run that stopped before its first checkpoint (trainer.oversize: 'truncate' -> 'drop')" in \
        corrected.stdout, corrected.stdout
    assert re.search(r"^batchlab-train: data ✓ 40 samples: .*\(\d+\.\d s\)$", corrected.stdout, re.M), corrected.stdout
    closing = re.search(r"complete after (\d+) steps, ([\d,]+) tokens, \d+ s: held-out loss ([\d.]+), τ ([\d.]+), "
                        r"τ real n/a, ([\d,]+) real tokens/s\n  results: (\S+)\n  report: batchlab-report (\S+)\n",
                        corrected.stdout)
    assert closing, corrected.stdout[-2000:]
    assert closing[7] == str(run_dir)
    log = (run_dir / "train.log").read_text()  # the run's log holds everything the run printed
    assert "[rank 0] Traceback" in log and closing[0] in log and "data ✓ 40 samples" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (int(closing[1]), int(closing[2].replace(",", ""))) == (summary["steps"], summary["tokens_seen"])
    assert float(closing[3]) == pytest.approx(summary["eval_loss"], abs=5e-5) and closing[6] == str(run_dir / "summary.json")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "complete"
    kept = {path.name: path.read_text() for path in [run_dir / "config.json", run_dir / "metrics.jsonl",
                                                     *(run_dir / ".hydra").glob("*.yaml")]}
    refused = train_cli([*base, f"data.source={data}", "trainer.oversize=drop", "seed=1"], cwd=tmp_path)
    assert refused.returncode == 2, (refused.returncode, refused.stderr[-3000:])
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "holds a run with other settings (" in lines[0] and "seed: 0 -> 1" in lines[0], refused.stderr
    assert {name: (run_dir / ("" if name.endswith(".json") or name.endswith(".jsonl") else ".hydra") / name).read_text()
            for name in kept} == kept
    # bad input over the finished run, found before the directory is claimed: the run's files stay its own
    log_before = (run_dir / "train.log").read_bytes()
    typo = train_cli([*base, f"data.source={data}", "trainer.oversize=drop", "data.heldout_fraction=1.5"],
                     cwd=tmp_path)
    assert typo.returncode == 2, typo.stderr[-3000:]
    lines = [line for line in typo.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "data.heldout_fraction=1.5 is outside [0, 1)" in lines[0], typo.stderr
    elsewhere = Path(re.search(r"traceback in (\S+)\)$", lines[0])[1])
    assert run_dir not in elsewhere.parents and "Traceback" in elsewhere.read_text()
    elsewhere.unlink()
    assert (run_dir / "train.log").read_bytes() == log_before
    assert {name: (run_dir / ("" if name.endswith((".json", ".jsonl")) else ".hydra") / name).read_text()
            for name in kept} == kept


def test_a_refused_runs_directory_is_removed_only_when_it_holds_nothing_else(tmp_path, monkeypatch):
    """What bad input found before a run claims its directory removes: the directory Hydra made (only .hydra and the
    log in it) and the empty folders above it up to the working directory; never the working directory itself or a
    folder above it, never a directory holding anything else."""
    from harness.cli.train import remove_unclaimed

    monkeypatch.chdir(tmp_path)
    made = tmp_path / "outputs" / "train" / "day" / "run"
    (made / ".hydra").mkdir(parents=True)
    (made / "train.log").write_text("x")
    remove_unclaimed(made, made / ".hydra", made / "train.log")
    assert not (tmp_path / "outputs").exists() and tmp_path.is_dir()
    (tmp_path / ".hydra").mkdir()
    remove_unclaimed(tmp_path, tmp_path / ".hydra", tmp_path / "train.log")  # hydra.run.dir=. : the cwd stays
    assert (tmp_path / ".hydra").is_dir()
    kept = tmp_path / "mine"
    (kept / ".hydra").mkdir(parents=True)
    (kept / "notes.txt").write_text("a user's file")
    remove_unclaimed(kept, kept / ".hydra", kept / "train.log")
    assert (kept / "notes.txt").read_text() == "a user's file"
