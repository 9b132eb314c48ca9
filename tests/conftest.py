"""Shared test settings."""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (a failure seen once is seen again, and CI does not
# fail by chance); HYPOTHESIS_PROFILE=explore draws new ones each run, to look for more.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

# Two pytest-xdist workers on 2 cores each start runs whose ranks take their share of the cores as torch threads, so
# the suite runs more OpenMP threads than cores. OpenMP's default lets idle threads spin, taking the cores from the
# other worker's threads: beside the real-model study's smoke test, test_feature_cache's run against the online
# target took 95 s instead of 9.5 s alone. Passive idle threads (sleeping, as the processes started by a test
# inherit) brought it to 5.2 s and the study's test from 128 s to 79 s (2026-12-06). Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Every rank a test starts, in this process or a fresh one (which inherits the environment), works inside
# tests/support/rank_hook.py: the faults a test asks for, a slowed drafter, every rank's consumed samples logged
# (harness.train.rank_hook reads the variable; the package's own runs never set it).
os.environ["BATCHLAB_RANK_HOOK"] = str(Path(__file__).with_name("support") / "rank_hook.py")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The model tests use tiny tensors: one intra-op thread avoids oversubscribing a small CPU
    (several times slower otherwise). Tests that never import torch do not pay for importing it."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- training runs


@pytest.fixture(scope="session")
def batchlab_cache(tmp_path_factory):
    """One corpus/tokenizer cache for the whole session (the stdlib parse is built once), shared by the workers of
    a pytest-xdist session (the cache's entries are built under a file lock, atomically)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        cache = tmp_path_factory.getbasetemp().parent / "batchlab-cache"
        cache.mkdir(exist_ok=True)
    else:
        cache = tmp_path_factory.mktemp("batchlab-cache")
    previous = os.environ.get("BATCHLAB_CACHE")
    os.environ["BATCHLAB_CACHE"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("BATCHLAB_CACHE", None)
    else:
        os.environ["BATCHLAB_CACHE"] = previous


# ---------------------------------------------------------------- scheduling

#: the modules that take longest on 2 cores (`make test`'s --durations on 2026-12-07's machine, summed per module),
#: longest first: collected first, so that pytest-xdist (`make test` runs --dist loadscope --no-loadscope-reorder:
#: modules handed out in collection order, not xdist's default of most tests first) starts them early and the suite
#: does not end on one of them while the other worker idles (longest-processing-time-first scheduling)
SLOWEST_MODULES = (
    "test_train_disaggregated.py", "test_train_failures.py", "test_train_launch.py", "test_train_resume.py",
    "test_study_real.py", "test_train_runs.py", "test_train_elastic_resume.py", "test_train_steps_across_ranks.py",
    "test_train_step.py",
    "test_hf_trainer.py", "test_advise.py", "test_report.py", "test_gpu_check.py", "test_causal_lm_target.py",
    "test_advise_schedule.py", "test_replay.py", "test_readme_block.py", "test_drafter_packing.py",
    "test_collectives.py", "test_pretrain_target.py", "test_analysis_load.py", "test_ablation.py", "test_recipes.py",
    "test_integrity.py", "test_epoch_draws.py", "test_eval_samples.py", "test_fingerprint_fields.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order is kept
