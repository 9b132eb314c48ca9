"""The ranks of a multi-rank job fork from a preloaded forkserver (harness/train/distributed.py): each takes the
launcher's environment of its own launch, and the stop signals the server ignores are the rank's defaults again."""

from __future__ import annotations

import os
import signal

from harness.train.distributed import RANK_PRELOAD, in_launch_environment
from harness.train.rank_server import STOP_SIGNALS, restore_signals


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
