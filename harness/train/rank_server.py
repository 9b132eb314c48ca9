"""The ranks' server: multiprocessing's forkserver, which outlives stop signals, forked from the launcher on CPU.

A job stopped through its process group signals the server too; it ignores the stop signals, so that the ranks'
exit statuses reach torch elastic's agent, and every rank restores their default actions first. Why the server is
forked (and when it is not): ``docs/design/training-runs.md``, "The ranks' server".
"""

from __future__ import annotations

import logging
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterable
from multiprocessing import connection, resource_tracker, util

#: the signals the server ignores and each rank restores
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, name))
#: set to "1" by the launcher while it launches: the process importing this module is the rank server
SERVER_FLAG = "BATCHLAB_RANK_SERVER"
#: "0" turns :func:`fork_server` off: the ranks fork from multiprocessing's own server (a fresh interpreter)
FORK_SWITCH = "BATCHLAB_FORK_RANK_SERVER"
#: the private state of multiprocessing's forkserver that :func:`fork_server` sets (CPython 3.11's, checked before
#: use); on another layout it starts nothing and the launch starts multiprocessing's own server
_SERVER_STATE = {"_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds", "_lock",
                 "_preload_modules"}


def restore_signals() -> None:
    """A rank forked from the server: the default action of every stop signal, as in a freshly started process."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def fork_server(preload: Iterable[str]) -> bool:
    """Start multiprocessing's forkserver as a fork of this process; True when it started one.

    Call it before this process starts threads of its own or runs any parallel computation (OpenMP's pool
    does not survive a fork), after importing what the ranks run: the server imports only what of ``preload``
    is not in memory yet. Nothing is started when a server runs already, when ``BATCHLAB_FORK_RANK_SERVER=0``, or
    when this Python's forkserver is not the one this function knows (then the launch starts its own).
    """
    server = multiprocessing.forkserver._forkserver
    if os.environ.get(FORK_SWITCH, "1") == "0" or set(vars(server)) != _SERVER_STATE:
        return False
    preload = list(preload)
    with server._lock:
        if server._forkserver_pid is not None:
            return False
        resource_tracker.ensure_running()  # its descriptor is inherited by every rank, as from a spawned server
        sys.stdout.flush()  # nothing buffered here is printed again by the server's children
        sys.stderr.flush()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # the server ends when this process (the only writer) does
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(alive_w)
                    _serve(listener.fileno(), alive_r, preload)
                finally:
                    os._exit(0)  # never this process's exit hooks (Hydra's, W&B's) in a copy of it
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def _serve(listener_fd: int, alive_r: int, preload: list[str]) -> None:
    """The forked server: a clean slate where a fresh one would have it, then multiprocessing's server loop."""
    multiprocessing.forkserver._forkserver._lock = threading.Lock()  # held by the parent at the fork
    for handler in logging.root.handlers[:]:  # the launcher's (Hydra's) log files are not the ranks'
        logging.root.removeHandler(handler)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    multiprocessing.forkserver.main(listener_fd, alive_r, preload)


if os.environ.pop(SERVER_FLAG, None) == "1":
    for _signum in STOP_SIGNALS:
        signal.signal(_signum, signal.SIG_IGN)
