"""End-to-end runs of batchlab-train: the smoke experiment per strategy on 2 gloo ranks, and a sweep."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from support.process import failure_text, run_process
from support.train import read_jsonl, train_cli

from analysis.wandb_offline import read_offline_run
from harness.train.loop.checkpoint import checkpoint_paths
from strategies import available_strategies

STEP_KEYS = {
    "tokens_seen", "loss", "loss_max_rank", "tokens_per_second", "rank_tokens_per_second", "padding_ratio", "tau",
    "grad_diversity", "grad_noise_scale", "accuracy", "accuracy_per_position", "real_tokens", "computed_slots",
    "drafter_block_efficiency", "time_data", "time_target", "time_drafter", "time_optimizer_comm", "lr",
    "grad_norm", "step_mean_length", "step_length_std", "samples_per_step", "rank_imbalance", "peak_memory_mb",
    "step", "epoch", "grad_sample_diversity", "loss_divisor", "step_weight_sum",
}
SUMMARY_KEYS = {"strategy", "seed", "tokens_seen", "tokens_per_second", "padding_ratio", "eval_loss", "eval_tau",
                "samples_seen_once", "grad_diversity", "grad_sample_diversity", "status"}


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory, batchlab_cache):
    """``batchlab-train -m experiment=smoke strategy=<every registered one>``: one job after another, each on
    2 gloo ranks (the sweep the tests below share; a job's directory is its strategy's name)."""
    root = tmp_path_factory.mktemp("smoke")
    sweep = root / "sweep"
    # 24,000 tokens: the smoke data's 21,948-token epoch whole, then a few steps of the next (1.1 epochs)
    result = train_cli(["-m", "experiment=smoke", f"strategy={','.join(available_strategies())}",
                        "trainer.stop_tokens=24000", "trainer.progress=false", f"hydra.sweep.dir={sweep}",
                        "hydra.sweep.subdir=${strategy.name}"], cwd=root, timeout=500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return sweep


@pytest.mark.parametrize("strategy", available_strategies())
def test_smoke_experiment_on_two_ranks(strategy, smoke_sweep):
    run_dir = smoke_sweep / strategy
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert records, "no step logged"
    for record in records:
        missing = STEP_KEYS - set(record)
        assert not missing, f"step {record.get('step')} lacks {sorted(missing)}"
        assert len(record["rank_tokens_per_second"]) == 2
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert any(r["grad_diversity"] is not None and r["grad_diversity"] > 0 for r in records)
    assert any("eval_loss" in r for r in records[:-1]), "no eval before the end (eval_every_tokens)"
    assert "plan_acf" in records[0] and "plan_recurrence" in records[0]

    summary = read_jsonl_one(run_dir / "summary.json")
    assert SUMMARY_KEYS <= set(summary)
    assert summary["strategy"] == strategy and summary["status"] == "complete"
    assert summary["tokens_seen"] >= 24000 and summary["world_size"] == 2
    assert summary["samples_seen_once"] is True and summary["epochs_exactly_once"] == [True]
    assert math.isfinite(summary["eval_loss"]) and summary["eval_tau"] >= 1.0
    # real acceptance by speculative decoding of the held-out prompts, shared over both ranks
    assert 1.0 <= summary["eval_tau_real"] <= 8 and summary["eval_real_prompts"] > 0
    assert sum(summary["eval_tau_real_hist"]) > 0 and summary["eval_speedup_bound"] >= 1.0
    assert (run_dir / "config.json").is_file()
    assert checkpoint_paths(run_dir)[-1].name == f"step-{len(records):08d}.pt"

    # every training sample exactly once in the complete epoch, across both ranks (what the ranks consumed)
    consumed = read_jsonl(run_dir / "consumed" / "rank0.jsonl") + read_jsonl(run_dir / "consumed" / "rank1.jsonl")
    epoch0 = Counter(row for entry in consumed if entry["epoch"] == 0 for row in entry["rows"])
    assert set(epoch0.values()) == {1}
    assert len(epoch0) == summary["train_samples"]
    epoch1 = Counter(row for entry in consumed if entry["epoch"] == 1 for row in entry["rows"])
    assert max(epoch1.values()) == 1

    # the offline W&B run holds the same config and history
    wandb_run = read_offline_run(run_dir)
    assert wandb_run.config["strategy"]["name"] == strategy
    assert wandb_run.config["seed"] == 0 and wandb_run.config["group"] == "smoke"
    logged = [h for h in wandb_run.history if "loss" in h]
    assert [h["tokens_seen"] for h in logged] == [r["tokens_seen"] for r in records]
    assert [h["loss"] for h in logged] == pytest.approx([r["loss"] for r in records], rel=1e-12)


def read_jsonl_one(path):
    import json

    return json.loads(path.read_text())


def test_multirun_runs_its_jobs_one_after_another(smoke_sweep):
    """Hydra outside, each job starting its own ranks: the second job does not block on the first one's group."""
    summaries = sorted(smoke_sweep.glob("*/summary.json"))
    assert sorted(p.parent.name for p in summaries) == sorted(available_strategies())
    finished = []
    for path in summaries:
        summary = read_jsonl_one(path)
        assert summary["status"] == "complete" and summary["world_size"] == 2
        assert summary["strategy"] == path.parent.name
        finished.append((path.stat().st_mtime, summary["wall_time_s"]))
    finished.sort()
    for (before, _), (after, took) in zip(finished, finished[1:]):
        assert after - took >= before - 1.0  # a job started once the one before it had finished


def test_runs_unchanged_under_an_external_torchrun(tmp_path, batchlab_cache):
    import os
    import sys
    from pathlib import Path

    run_dir = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = run_process(
        [str(torchrun), "--nproc_per_node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "-m",
         "harness.cli.train", "experiment=smoke", "trainer.nproc=1", "trainer.stop_tokens=6000", "logger=none",
         "trainer.progress=false", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, failure_text(result)
    summary = read_jsonl_one(run_dir / "summary.json")
    # trainer.nproc is ignored under an external launcher: the job has torchrun's 2 ranks
    assert summary["world_size"] == 2 and summary["status"] == "complete" and summary["samples_seen_once"]
