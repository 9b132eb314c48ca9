"""benchmarks/gpu_check.sh and device_run.sh, the GPU checks a short lease runs: their budget, steps and packing.

Nothing here needs a GPU: on this machine the GPU tests only skip, which is enough to run a step through the
script's limits, summary and packing."""

from __future__ import annotations

import json
import os
import re
import sys
import tarfile
from pathlib import Path

import pytest

from support.process import run_process
from support.train import read_jsonl

REPO = Path(__file__).resolve().parents[2]


def gpu_check(out: Path, timeout: float = 120, **env: str):
    environment = {**os.environ, "PYTHON": sys.executable, **env}
    return run_process(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out)], cwd=REPO, env=environment,
                       timeout=timeout)


def test_a_step_runs_within_the_budget_and_what_it_left_is_packed(tmp_path):
    out, packed = tmp_path / "check", tmp_path / "check.tar.gz"
    result = gpu_check(out, STEPS="tests", BUDGET="200", PACK_TO=str(packed))
    summary = (out / "summary.txt").read_text()
    assert result.returncode == 0, summary + result.stdout[-2000:] + result.stderr[-2000:]
    assert "tests (limit 150 s)" in summary  # its own limit: the budget leaves more
    assert "tests: exit 0 after" in summary and "done, status 0" in summary
    assert "skipped" in (out / "gpu_tests.log").read_text()  # the GPU tests ran, and skipped on this machine
    assert (out / "RESULTS.md").read_text() == (REPO / "benchmarks" / "RESULTS.md").read_text()
    with tarfile.open(packed) as archive:
        names = set(archive.getnames())
    assert {"check/summary.txt", "check/gpu_tests.log", "check/RESULTS.md", "check/env.txt"} <= names


def test_steps_past_the_budget_and_unknown_steps_are_named_and_fail_the_check(tmp_path):
    out = tmp_path / "check"
    result = gpu_check(out, STEPS="drafter bogus advise", BUDGET="45")
    summary = (out / "summary.txt").read_text()
    assert result.returncode == 1
    assert 'drafter: skipped, the budget of 45 s is spent (run it again with STEPS="drafter")' in summary
    assert "unknown step 'bogus'" in summary
    assert "advise: skipped" in summary and "done, status 1" in summary
    assert not (out / "drafter_step_cuda.md").exists()  # nothing was started


def test_device_run_without_a_kit_says_how_to_make_one(tmp_path):
    result = run_process(["bash", str(REPO / "benchmarks" / "device_run.sh")], cwd=REPO, timeout=30,
                         env=dict(os.environ, KIT=str(tmp_path / "none"), OUT=str(tmp_path / "out")))
    assert result.returncode == 2
    assert "run python benchmarks/device_kit.py here first, and carry .device" in result.stderr


# the smoke experiment's data and a few held-out prompts: each of two_rank's runs is a few steps (~10 s on 2 cores)
SMALL_RUNS = ("data.max_documents=120 data.vocab_size=512 data.max_heldout=16 trainer.max_tokens=1024 "
              "trainer.eval_real_prompts=2 trainer.eval_real_new_tokens=4")


def test_two_rank_trains_colocated_and_disaggregated_on_two_gloo_ranks(tmp_path, batchlab_cache):
    """The step a machine with two GPUs runs, rehearsed on the CPU (DEVICE=cpu): the same commands, gloo ranks."""
    out = tmp_path / "check"
    result = gpu_check(out, timeout=240, DEVICE="cpu", STEPS="two_rank", TWO_RANK_TOKENS="8000", RUN_SET=SMALL_RUNS)
    summary = (out / "summary.txt").read_text()
    logs = "".join((out / f"two_rank_{name}.log").read_text()[-3000:] for name in ("colocated", "disaggregated")
                   if (out / f"two_rank_{name}.log").exists())
    assert result.returncode == 0, summary + result.stderr[-2000:] + logs
    assert "two_rank (limit 150 s)" in summary and "two_rank: exit 0 after" in summary and "done, status 0" in summary
    for label in ("two ranks colocated", "two ranks disaggregated 1+1"):
        assert re.search(rf"^{re.escape(label)}, complete: [1-9]\d* steps, [1-9]\d* real tok/s, .*held-out loss",
                         summary, re.MULTILINE), summary

    colocated, disaggregated = out / "two-rank-colocated", out / "two-rank-disaggregated"
    for run_dir, grad_accum in ((colocated, 1), (disaggregated, 2)):
        config = json.loads((run_dir / "config.json").read_text())
        assert config["trainer"]["nproc"] == 2 and config["trainer"]["device"] == "cpu"
        assert config["trainer"]["precision"] == "fp32" and config["trainer"]["stop_tokens"] == 8000
        assert config["trainer"]["grad_accum"] == grad_accum and config["strategy"]["name"] == "packed"
        run_summary = json.loads((run_dir / "summary.json").read_text())
        assert run_summary["status"] == "complete" and run_summary["samples_seen_once"] is True
        assert run_summary["tokens_seen"] >= 8000 and run_summary["grad_accum"] == grad_accum
        records = read_jsonl(run_dir / "metrics.jsonl")
        assert any(r.get("grad_stats_measured") for r in records)  # gradient statistics on some steps
        assert "eval_loss" in records[-1]  # the eval at the end
    # colocated: both ranks train the drafter (DDP over 2); disaggregated: 1 target rank feeds 1 drafter rank
    summary_colocated = json.loads((colocated / "summary.json").read_text())
    assert summary_colocated["world_size"] == 2 and "topology" not in summary_colocated
    summary_split = json.loads((disaggregated / "summary.json").read_text())
    assert summary_split["topology"] == "disaggregated"
    assert (summary_split["target_ranks"], summary_split["drafter_ranks"], summary_split["world_size"]) == (1, 1, 1)


@pytest.mark.parametrize(("count", "said"), [("1", "1 GPU"), ("0", "0 GPUs"), ("oops", "0 GPUs")])
def test_two_rank_on_fewer_than_two_gpus_is_skipped_and_said_so(count, said, tmp_path):
    """One H200 gives one rank (NCCL refuses two ranks on one device): the step is skipped, named, and the check
    passes. A python that answers the GPU count with COUNT stands in for the GPU machine's."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\ncase "$*" in *device_count*) echo "{count}"; exit 0;; esac\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "check"
    result = gpu_check(out, PYTHON=str(python), DEVICE="cuda", STEPS="two_rank")
    summary = (out / "summary.txt").read_text()
    assert result.returncode == 0, summary + result.stderr[-2000:]
    assert f"two_rank: skipped, {said} here (needs 2)" in summary and "done, status 0" in summary
    assert "two_rank (limit" not in summary and not (out / "two_rank_colocated.log").exists()


def test_two_rank_on_two_gpus_runs_bf16_with_the_nccl_warnings(tmp_path):
    """What the step starts where two GPUs are seen: a python that reports 2 GPUs and records each training
    command (with its NCCL_DEBUG) instead of running it stands in for the GPU machine's."""
    python, calls = tmp_path / "python", tmp_path / "calls"
    python.write_text('#!/bin/sh\ncase "$*" in\n  *device_count*) echo 2; exit 0;;\n'
                      f'  *harness.cli.train*) echo "NCCL_DEBUG=${{NCCL_DEBUG:-}} $*" >> "{calls}"; exit 0;;\nesac\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "check"
    result = gpu_check(out, PYTHON=str(python), DEVICE="cuda", STEPS="two_rank", TWO_RANK_TOKENS="1234",
                       RUN_SET="data.source=kit/data")
    summary = (out / "summary.txt").read_text()
    assert result.returncode == 0, summary + result.stderr[-2000:]
    assert "two_rank (limit 150 s)" in summary
    colocated, disaggregated = (line.split() for line in calls.read_text().splitlines())
    for command in (colocated, disaggregated):
        assert command[0] == "NCCL_DEBUG=WARN" and command[1:3] == ["-m", "harness.cli.train"]
        assert {"strategy=packed", "trainer.device=cuda", "trainer.precision=bf16", "trainer.nproc=2",
                "trainer.stop_tokens=1234", "eval.every_tokens=1234", "grad_stats.every=2",
                "logger=none", "trainer.progress=false"} <= set(command)
        assert command[-2] == "data.source=kit/data"  # the caller's RUN_SET, after the step's own settings
    assert "topology=colocated" in colocated and f"hydra.run.dir={out}/two-rank-colocated" in colocated
    assert {"topology=disaggregated", "topology.target_ranks=1", "topology.drafter_ranks=1",
            "trainer.grad_accum=2", f"hydra.run.dir={out}/two-rank-disaggregated"} <= set(disaggregated)
    # no run wrote a summary here: each says so and where to look
    assert "two ranks colocated: did not finish" in summary and "see two_rank_disaggregated.log" in summary
