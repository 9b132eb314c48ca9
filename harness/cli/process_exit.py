"""A command's process ends once its work is done, without the interpreter's teardown.

Freeing every module of torch, transformers and datasets one object at a time takes a process 1-2 s
after its last line (measured in ``benchmarks/RESULTS.md``, "Ending a command's process"), and a sweep or the
test suite starts hundreds of them. :func:`exits_fast` does what teardown does that anyone can see:
it waits for the threads that are not daemons, runs the exit hooks (W&B, logging, multiprocessing's
children) and flushes stdout and stderr; then it ends the process with ``os._exit``. An uncaught
exception other than ``SystemExit`` takes Python's own way out, so its traceback prints as usual.
Only for a process's entry point: a function called in-process (a test, a notebook) keeps its caller.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any


def exit_code(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives: ``None`` is 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def end_process(code: int) -> None:
    """Wait for non-daemon threads, run the exit hooks, flush stdout and stderr, then ``os._exit(code)``."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon and thread.is_alive():
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say on it
            pass
    os._exit(code)


def exits_fast(entry: Callable[[], Any]) -> Callable[[], None]:
    """``entry`` as a process's entry point: its return value or ``SystemExit`` becomes the exit status."""

    @functools.wraps(entry)
    def run() -> None:
        try:
            returned = entry()
        except SystemExit as stop:
            end_process(exit_code(stop.code))
        else:
            end_process(exit_code(returned))

    return run
