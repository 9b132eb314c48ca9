"""benchmarks/gpu_check.sh and device_run.sh, the GPU checks a short lease runs: their budget, steps and packing.

Nothing here needs a GPU: on this machine the GPU tests only skip, which is enough to run a step through the
script's limits, summary and packing."""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

from process_support import run_process

REPO = Path(__file__).resolve().parents[1]


def gpu_check(out: Path, **env: str):
    environment = dict(os.environ, PYTHON=sys.executable, **env)
    return run_process(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out)], cwd=REPO, env=environment,
                       timeout=120)


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
