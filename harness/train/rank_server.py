"""The rank forkserver's first import: it outlives a stop signal, so that the ranks' exit statuses reach the agent.

The ranks of a multi-rank job fork from a ``forkserver`` (:func:`harness.train.distributed.launch`). A job stopped
through its process group (SIGTERM, or SLURM's warning signals) signals the server too; a server that died of it
would take the ranks' exit statuses with it, and torch elastic would report a failure instead of a rank that
checkpointed and stopped. So the server ignores these signals, and every rank puts their default actions back
before anything else (:func:`restore_signals`), as a freshly spawned rank would have them.

Only the server ignores them: the launcher sets :data:`SERVER_FLAG` around the launch that may start it, and the
import takes the flag out of the server's environment (its ranks do not inherit it). Imported anywhere else, this
module changes nothing.
"""

from __future__ import annotations

import os
import signal

#: the signals the server ignores and each rank restores
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                     if hasattr(signal, name))
#: set to "1" by the launcher while it launches: the process importing this module is the rank server
SERVER_FLAG = "BATCHLAB_RANK_SERVER"


def restore_signals() -> None:
    """A rank forked from the server: the default action of every stop signal, as in a freshly started process."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


if os.environ.pop(SERVER_FLAG, None) == "1":
    for _signum in STOP_SIGNALS:
        signal.signal(_signum, signal.SIG_IGN)
