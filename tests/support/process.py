"""Subprocesses of the tests that never outlive their test.

A training job is a process tree (the launcher, its ranks, submitit's tasks). ``subprocess.run(timeout=...)`` kills
only the launcher when the time is up: the ranks live on as orphans, take the CPU from the tests that follow and keep
the output pipes open. Here each job gets its own process group (a new session) and the whole group is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(process: subprocess.Popen, wait_s: float = 30) -> None:
    """Kill ``process``'s whole process group (started with ``start_new_session=True``) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group has already ended
        pass
    process.wait(timeout=wait_s)


def run_process(command, *, cwd, env=None, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` in a new session. Past ``timeout`` seconds the
    whole process group is killed and an AssertionError says so, with the end of what the job printed."""
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(process)
            try:
                stdout, stderr = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # something outside the group still holds the pipes
                stdout, stderr = "", "(its output could not be read)"
            raise AssertionError(f"{' '.join(map(str, command))} did not end within {timeout:.0f} s; its process "
                                 f"group was killed. The end of its output:\n{stdout[-2000:]}\n{stderr[-4000:]}")
        except BaseException:  # the test was interrupted (Ctrl-C, pytest-timeout): the job goes with it
            stop_group(process)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


# Where a rank's own account of its failure starts: the tail alone is torchrun's summary and the list of loaded
# extension modules that Python's fault handler prints after a fatal error.
_FAILURE_STARTS = ("Fatal Python error", "Traceback (most recent call last)", "terminate called", "RuntimeError",
                   "Error:", "[ERROR]")


def failure_text(result: subprocess.CompletedProcess, *, lines_each: int = 30, tail_chars: int = 3000) -> str:
    """What a failed job said about why: the first lines after each distinct place a failure starts in its stderr
    (a rank's fatal error, traceback or C++ abort), then the end of its stdout and stderr."""
    stderr_lines = (result.stderr or "").splitlines()
    excerpts, seen = [], set()
    for number, line in enumerate(stderr_lines):
        start = next((marker for marker in _FAILURE_STARTS if marker in line), None)
        if start is None or line in seen:
            continue
        seen.add(line)
        excerpts.append("\n".join(stderr_lines[number:number + lines_each]))
        if len(excerpts) == 4:
            break
    return ("\n--- where it failed ---\n" + "\n...\n".join(excerpts) if excerpts else "") + (
        f"\n--- the end of stdout ---\n{(result.stdout or '')[-1000:]}\n--- the end of stderr ---\n"
        f"{(result.stderr or '')[-tail_chars:]}")
