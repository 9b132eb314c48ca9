"""topology=disaggregated on CPU (gloo): target ranks feed a drafter rank over point-to-point.

The same loss sequence as a colocated run, bounded in-flight micro-batches under a slow drafter, and a
killed target or drafter rank ending the job with its rank named; the 8-GPU experiments compose.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support.process import failure_text, stop_group
from support.rank_hook import DRAFTER_DELAY_ENV
from support.train import assert_same_records, assert_same_summary, compose_config, read_jsonl, train_cli

from harness.train.config import run_config_from_dict
from harness.train.launch.run import run
from harness.train.status import read_statuses

# small enough for a few seconds of training on 2 cores (most of a run is starting 3 processes)
SMALL = ["experiment=smoke", "strategy=bucketed", "logger=none", "trainer.progress=false", "trainer.num_workers=0",
         "trainer.threads_per_rank=1", "trainer.max_tokens=512", "trainer.grad_accum=2", "trainer.stop_tokens=6000",
         "trainer.eval_every_tokens=3000", "trainer.eval_real_prompts=2", "trainer.eval_real_new_tokens=4",
         "trainer.checkpoint_every_steps=1000"]
DISAGGREGATED = ["topology=disaggregated", "topology.target_ranks=2", "topology.drafter_ranks=1", "trainer.nproc=3"]
SAME = ("loss", "grad_norm", "tau", "accuracy", "lr", "tokens_seen", "real_tokens", "computed_slots", "eval_loss",
        "eval_tau", "eval_tau_real")
REL = 1e-5  # fp32 on CPU; the features travel bit for bit, so the runs agree far closer than this


def _close(a, b):
    return a == b or (a is not None and b is not None and abs(a - b) <= REL * max(abs(a), abs(b)))


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, batchlab_cache):
    """The same run colocated on 1 rank (the plan a 1-drafter-rank disaggregated run makes)."""
    run_dir = tmp_path_factory.mktemp("colocated") / "run"
    run(compose_config([*SMALL, "trainer.nproc=1"]), run_dir)
    return run_dir


@pytest.mark.parametrize("dispatch", ["dynamic", "round_robin"])
def test_disaggregated_gives_the_colocated_loss_sequence(dispatch, tmp_path, colocated):
    run_dir = tmp_path / "run"
    result = train_cli([*SMALL, *DISAGGREGATED, f"topology.dispatch={dispatch}", "topology.max_in_flight=2",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, failure_text(result)
    expected, got = read_jsonl(colocated / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl")
    assert len(expected) >= 6 and [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got):
        for key in SAME:
            assert _close(have.get(key), want.get(key)), f"step {want['step']}: {key} {have.get(key)} != {want.get(key)}"
    assert any("eval_loss" in r for r in got[:-1])  # eval ran mid-run too, on the drafter rank
    # the drafter rank consumed the same micro-batches in the same order as the colocated rank
    assert read_jsonl(run_dir / "consumed" / "rank0.jsonl") == read_jsonl(colocated / "consumed" / "rank0.jsonl")
    # the stage metrics, every step
    for record in got:
        assert len(record["topology_target_busy_fraction"]) == 2 and len(record["topology_in_flight"]) == 2
        assert all(0 <= v <= 2 for v in record["topology_in_flight"])
        assert 1 <= record["topology_in_flight_max"] <= 2
        assert record["topology_drafter_idle_s"] >= 0 and record["topology_bytes_per_second"] >= 0
    assert sum(r["topology_bytes_per_second"] for r in got) > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["samples_seen_once"] is True
    assert summary["topology"] == "disaggregated" and summary["dispatch"] == dispatch
    busy = summary["topology_target_busy_fraction"]
    assert len(busy) == 2, busy
    if dispatch == "round_robin":  # each target rank owns every other micro-batch, so both produced
        assert all(b is not None and 0 < b < 1 for b in busy), busy
    else:  # the next free rank claims each micro-batch: a rank that starts late on a busy machine may claim none,
        # and one the drafter never heard from has no busy fraction (null, not a made-up 0)
        assert any(b is not None for b in busy) and all(b is None or 0 < b < 1 for b in busy), busy
    statuses = read_statuses(run_dir)
    assert {r: s["role"] for r, s in statuses.items()} == {0: "drafter", 1: "target", 2: "target"}
    assert all(s["stage"] == "done" for s in statuses.values()), statuses  # every link ended cleanly


def test_two_drafter_ranks_train_as_two_colocated_ranks(tmp_path, batchlab_cache):
    """2 target + 2 drafter ranks (DDP over the drafter group) against colocated on 2 ranks."""
    colocated = tmp_path / "colocated"
    result = train_cli([*SMALL, "trainer.nproc=2", f"hydra.run.dir={colocated}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, failure_text(result)
    run_dir = tmp_path / "run"
    result = train_cli([*SMALL, "topology=disaggregated", "topology.target_ranks=2", "topology.drafter_ranks=2",
                        "trainer.nproc=4", "trainer.grad_stats_every=1", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path, timeout=150)
    assert result.returncode == 0, failure_text(result)
    expected, got = read_jsonl(colocated / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl")
    assert len(expected) >= 4 and [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got):
        for key in SAME:
            assert _close(have.get(key), want.get(key)), f"step {want['step']}: {key} {have.get(key)} != {want.get(key)}"
        assert len(have["rank_tokens_per_second"]) == 2  # the drafter ranks' own gathers, not the job's
        assert len(have["topology_in_flight"]) == 4 and all(0 <= v <= 2 for v in have["topology_in_flight"])
        assert len(have["topology_target_busy_fraction"]) == 2
    for rank in (0, 1):
        assert read_jsonl(run_dir / "consumed" / f"rank{rank}.jsonl") == read_jsonl(
            colocated / "consumed" / f"rank{rank}.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["drafter_ranks"] == 2 and summary["samples_seen_once"] is True


def test_a_slow_drafter_blocks_the_targets_at_the_bound(tmp_path, batchlab_cache):
    """Also: with no thread count given, the drafter rank takes its share of the cores beside the target ranks
    (the job's 3 processes), not all of them (it did: its Trainer's rank env counts the drafter ranks only)."""
    run_dir = tmp_path / "run"
    own_threads = [o for o in SMALL if not o.startswith("trainer.threads_per_rank=")]
    result = train_cli([*own_threads, *DISAGGREGATED, "topology.max_in_flight=2",
                        "trainer.eval_every_tokens=100000", "trainer.eval_real_prompts=0",
                        "trainer.stop_tokens=3000", f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120,
                       env_extra={DRAFTER_DELAY_ENV: "0.4"})
    assert result.returncode == 0, failure_text(result)
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert len(records) >= 4
    # never more than max_in_flight unacknowledged on a link, and the producers did run ahead up to it
    assert max(r["topology_in_flight_max"] for r in records) == 2
    assert all(v <= 2 for r in records for v in r["topology_in_flight"])
    assert all(r["topology_buffered"] <= 2 * 2 for r in records)  # the reorder buffer: links x bound
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["torch_threads"] == max(1, (os.cpu_count() or 1) // 3), summary["torch_threads"]
    # (how long the drafter waits and how busy the targets are is speed, not correctness: benchmarks/placement.py)


@pytest.mark.parametrize(("rank", "role", "at"), [(2, "target", 4), (0, "drafter", 3)])
def test_a_killed_rank_ends_the_job_naming_it(rank, role, at, tmp_path, batchlab_cache):
    """``BATCHLAB_TEST_KILL=RANK:N`` SIGKILLs a target rank as it sends its N-th micro-batch, a drafter rank as it
    starts waiting for the features of step N."""
    run_dir = tmp_path / "run"
    result = train_cli([*SMALL, *DISAGGREGATED, "topology.peer_timeout_s=5", "trainer.stop_tokens=60000",
                        "trainer.eval_every_tokens=100000", f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120,
                       env_extra={"BATCHLAB_TEST_KILL": f"{rank}:{at}"})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    # the job's message names the rank, its role, stage and step, and how it died
    assert re.search(rf"rank {rank} failed in stage '\w+' of step \d+ \(role {role}\): it was killed by signal 9 "
                     r"\(SIGKILL\)", output), output[-3000:]
    statuses = read_statuses(run_dir)
    dead = statuses[rank]
    # a target rank dies as it sends its micro-batch; a drafter rank as it waits for step at's features
    assert dead["role"] == role, dead
    assert dead["stage"] == "send" if role == "target" else (dead["stage"], dead["step"]) == ("wait_features", at), dead
    # the job ended after the kill instead of hanging (peer_timeout_s=5; measured 3-15 s on a loaded machine),
    # long before the run would have (60000 tokens)
    assert time.time() - dead["time"] < 90, f"the job hung: it took {time.time() - dead['time']:.0f} s to end after the kill"
    # The surviving ranks train on until the launcher sees the death (its 0.5 s poll, then their SIGTERM): a few
    # steps on an idle machine, 13 seen on a loaded one. How many is timing; that the run ended far from its end
    # (and never as complete) is not.
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert steps and steps[-1]["tokens_seen"] < 30000, steps[-1]["tokens_seen"] if steps else "no step"
    assert not (run_dir / "summary.json").exists() or json.loads((run_dir / "summary.json").read_text())[
        "status"] != "complete"


def test_disaggregated_rank_counts_must_match_nproc():
    config = compose_config(["topology=disaggregated", "topology.target_ranks=3", "topology.drafter_ranks=2",
                             "trainer.nproc=4"])
    with pytest.raises(ValueError, match=r"topology.target_ranks \+ topology.drafter_ranks = 3 \+ 2 = 5.*trainer.nproc=5"):
        run_config_from_dict(config)
    with pytest.raises(ValueError, match=r"topology.dispatch='fifo' is not one of"):
        run_config_from_dict(compose_config(["topology=disaggregated", "trainer.nproc=3", "topology.dispatch=fifo"]))
    with pytest.raises(ValueError, match=r"topology.max_in_flight=0 must be >= 1"):
        run_config_from_dict(compose_config(["topology=disaggregated", "trainer.nproc=3", "topology.max_in_flight=0"]))


def test_the_8gpu_experiments_compose():
    reference = run_config_from_dict(compose_config(["experiment=reference_8gpu"]))
    colocated = run_config_from_dict(compose_config(["experiment=colocated_8gpu"]))
    assert reference.topology.name == "disaggregated" and colocated.topology.name == "colocated"
    assert (reference.topology.target_ranks, reference.topology.drafter_ranks) == (7, 1)
    for config in (reference, colocated):
        assert config.trainer.nproc == 8 and config.trainer.precision == "bf16" and config.trainer.device == "cuda"
        assert config.trainer.gdn_backend == "fla" and config.drafter.block_size == 16
        assert config.target_kwargs["hidden_size"] == 5120 and config.target_kwargs["num_hidden_layers"] == 64
        assert config.target_kwargs["vocab_size"] == 248320
    assert reference.trainer.max_tokens == colocated.trainer.max_tokens  # the same budget
    assert colocated.drafter_config.num_hidden_layers == reference.drafter_config.num_hidden_layers


def test_empty_micro_batches_cross_the_link(tmp_path, batchlab_cache):
    """10 samples of 8 tokens at budget 8, accumulation 4: steps of 4, 4 and 2 samples, so the last step has two
    empty micro-batches, sent as a header and a batch without features."""
    rng = np.random.default_rng(3)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": rng.integers(2, 300, size=8).tolist(), "loss_mask": [1] * 8})
                            + "\n" for _ in range(10)))
    overrides = [f"data.source={data}", "data.max_documents=null", "data.vocab_size=300", "data.heldout_fraction=0.0",
                 "logger=none", "trainer.progress=false", "trainer.num_workers=0", "trainer.threads_per_rank=1",
                 "strategy=sorted", "trainer.max_tokens=8", "trainer.grad_accum=4", "trainer.stop_epochs=1",
                 "trainer.stop_tokens=null"]
    run(compose_config([*overrides, "trainer.nproc=1"]), tmp_path / "colocated")
    result = train_cli([*overrides, *DISAGGREGATED, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, failure_text(result)
    expected, got = read_jsonl(tmp_path / "colocated" / "metrics.jsonl"), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["samples_per_step"] for r in got] == [4, 4, 2]
    for want, have in zip(expected, got, strict=True):
        assert _close(have["loss"], want["loss"]) and _close(have["grad_norm"], want["grad_norm"]), (want, have)


# 1.2 epochs; the stopped run's drafter steps are slowed down (the tests' rank hook: the run's settings are
# the same) so that the stop lands mid-run however loaded the machine is
RESUME = [*SMALL, *DISAGGREGATED, "trainer.stop_tokens=20000", "trainer.eval_every_tokens=8000",
          "trainer.eval_real_prompts=0", "trainer.checkpoint_every_steps=3"]
SLOWED = {DRAFTER_DELAY_ENV: "0.15"}


def test_stopped_and_resumed_disaggregated_run_repeats_the_uninterrupted_one(tmp_path, batchlab_cache):
    """SIGTERM to the whole job: the drafter rank finishes its step and checkpoints, the target ranks end their
    links; the rerun's target ranks start where the checkpoint is, across the epoch boundary."""
    reference = tmp_path / "reference"
    result = train_cli([*RESUME, f"hydra.run.dir={reference}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, failure_text(result)
    stopped = tmp_path / "stopped"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **SLOWED)
    log = tmp_path / "stopped.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "harness.cli.train", *RESUME,
                                    f"hydra.run.dir={stopped}"],
                                   cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 90
        while time.time() < deadline and process.poll() is None:
            metrics = stopped / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 8:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be stopped: " + log.read_text()[-3000:]
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:  # the test failed or the run did not stop: it must not outlive the test
            stop_group(process)
    assert (stopped / "summary.json").exists(), log.read_text()[-4000:]
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["status"] == "interrupted", log.read_text()[-4000:]
    steps_before = len(read_jsonl(stopped / "metrics.jsonl"))
    assert 8 <= steps_before < len(read_jsonl(reference / "metrics.jsonl"))
    result = train_cli([*RESUME, f"hydra.run.dir={stopped}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, failure_text(result)
    assert max(r["epoch"] for r in read_jsonl(stopped / "metrics.jsonl")) == 1  # across the epoch boundary
    assert_same_records(reference, stopped)
    assert_same_summary(reference, stopped)
    assert read_jsonl(stopped / "consumed" / "rank0.jsonl") == read_jsonl(reference / "consumed" / "rank0.jsonl")
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["samples_seen_once"] is True
