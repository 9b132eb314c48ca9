"""A launcher in miniature for tests/harness/train/test_rank_launch.py: starts the ranks' server, then one process
through it, and prints what that process found as json."""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys

from harness.train.rank_server import fork_server

#: set by this process before the server starts: a forked server's processes have it, a spawned one's do not
MARKS: list[str] = []


def report(queue) -> None:
    """What a rank started through the server finds."""
    queue.put({
        "marks": list(MARKS),
        "parent": os.getppid(),
        "log_handlers": len(logging.root.handlers),
        "sigterm_ignored": signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,
        "server_lock_free": multiprocessing.forkserver._forkserver._lock.acquire(timeout=1),
    })


if __name__ == "__main__":
    MARKS.append("set before the server started")
    logging.root.addHandler(logging.StreamHandler(sys.stderr))
    print("buffered before the fork, printed once", end="|")  # unflushed: the server's children must not repeat it
    started = fork_server(["json"])
    again = fork_server(["json"])
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    process = context.Process(target=report, args=(queue,))
    process.start()
    found = queue.get(timeout=60)
    process.join(timeout=60)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    print(json.dumps({"started": started, "again": again, "server": server, "exitcode": process.exitcode, **found}))
