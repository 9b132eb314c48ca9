"""The ranks of a multi-rank job fork from a server (harness/train/rank_server.py), forked from the launcher on CPU:
each takes the launcher's environment of its own launch, and the stop signals the server ignores are the rank's
defaults again."""

from __future__ import annotations

import os
import signal

import pytest

from harness.train.distributed import RANK_PRELOAD, in_launch_environment, prepare_ranks
from harness.train.rank_server import FORK_SWITCH, STOP_SIGNALS, restore_signals


def test_a_forked_rank_takes_the_launchers_environment_of_this_launch():
    saved = dict(os.environ)
    try:
        # the server's environment (from an earlier launch) with what torch elastic set for this rank
        os.environ.update({"BATCHLAB_TEST_KEPT": "stale", "RANK": "1", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "3"})
        launcher_now = {**saved, "BATCHLAB_TEST_KEPT": "fresh", "BATCHLAB_TEST_ADDED": "x",
                        "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
        seen = in_launch_environment(launcher_now, lambda: dict(os.environ))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert seen["BATCHLAB_TEST_KEPT"] == "fresh" and seen["BATCHLAB_TEST_ADDED"] == "x"  # this launch's values
    assert (seen["RANK"], seen["LOCAL_RANK"]) == ("1", "1")  # the rank's own, which the launcher does not hold
    assert seen["CUDA_VISIBLE_DEVICES"] == "3"  # torch elastic's per-rank value wins over the launcher's


def test_the_server_ignores_stop_signals_and_a_rank_restores_them():
    assert RANK_PRELOAD[0] == "harness.train.rank_server"  # imported first: the server ignores them from its start
    assert signal.SIGTERM in STOP_SIGNALS and signal.SIGUSR2 in STOP_SIGNALS
    saved = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)  # what a rank inherits from the server
        restore_signals()
        assert all(signal.getsignal(signum) == signal.SIG_DFL for signum in STOP_SIGNALS)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_only_the_server_ignores_the_stop_signals():
    """Imported with the launcher's flag (the server), the module ignores the stop signals and takes the flag out of
    the environment its ranks inherit; imported anywhere else it changes nothing."""
    import subprocess
    import sys

    probe = ("import os, signal; import harness.train.rank_server as r; "
             "print(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, r.SERVER_FLAG in os.environ)")
    env = {**os.environ, "BATCHLAB_RANK_SERVER": "1"}
    server = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    env.pop("BATCHLAB_RANK_SERVER")
    other = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert server.stdout.split() == ["True", "False"] and other.stdout.split() == ["False", "False"]


def _probe(switch: str) -> tuple[dict, str]:
    """tests/support/rank_server_probe.py under ``BATCHLAB_FORK_RANK_SERVER=switch``: (its report, its stdout)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).resolve().parents[2] / "support" / "rank_server_probe.py"
    env = {**os.environ, FORK_SWITCH: switch}
    env.pop("PYTHONUNBUFFERED", None)  # its stdout buffered, as a launcher's piped to a file is
    done = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.rsplit("|", 1)[1]), done.stdout


def _gone(pid: int, within_s: float = 10) -> bool:
    import time

    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_forked_server_starts_ranks_with_the_launchers_memory_and_a_clean_slate():
    found, stdout = _probe("1")
    assert found["started"] is True and found["again"] is False  # one server a launcher: the second call starts none
    assert found["exitcode"] == 0 and found["parent"] == found["server"]  # the rank forked from that server
    assert found["marks"] == ["set before the server started"]  # this process's state, not re-imported
    assert found["log_handlers"] == 0  # the launcher's (Hydra's) handlers are not the ranks'
    assert found["sigterm_ignored"] is True  # the server's, which a rank restores (in_launch_environment)
    assert found["server_lock_free"] is True  # a rank can start a server of its own
    assert stdout.count("buffered before the fork") == 1
    assert _gone(found["server"])  # it ends with its launcher


def test_the_switch_leaves_the_ranks_to_multiprocessings_own_server():
    found, _ = _probe("0")
    assert found["started"] is False and found["exitcode"] == 0
    assert found["marks"] == []  # a fresh interpreter: nothing of the launcher's memory


@pytest.mark.parametrize("nproc, device, environment, forks", [
    (2, "cpu", {}, True), (1, "cpu", {}, False), (2, "cuda", {}, False), (2, "tpu", {}, False),
    (2, "cpu", {"WORLD_SIZE": "2", "RANK": "0"}, False)])
def test_a_server_is_forked_for_cpu_ranks_only_never_for_one_rank_cuda_a_bad_device_or_an_external_launcher(
        monkeypatch, nproc, device, environment, forks):
    from harness.train import distributed

    for key in ("WORLD_SIZE", "RANK", "SUBMITIT_EXECUTOR", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    asked = []  # what prepare_ranks would fork a server with (none is forked here)
    monkeypatch.setattr(distributed, "fork_server", lambda preload: asked.append(preload) or True)
    assert prepare_ranks(nproc, device) is forks
    assert asked == ([RANK_PRELOAD] if forks else [])
