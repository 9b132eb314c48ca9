"""Test-only fault injection: a rank fails on entering a chosen stage (switched on by the tests' environment).

Production code holds one hook: :class:`harness.train.status.RankStatus` calls :func:`stage_hook`'s result
each time its rank enters a stage, so a failure lands exactly where a real one would be recorded. With
neither variable set the hook is ``None`` and nothing here runs.

* ``BATCHLAB_TEST_FAIL=RANK:STEP:STAGE:MODE`` — rank ``RANK`` fails on entering stage ``STAGE`` of
  optimizer step ``STEP``, MODE being ``kill`` (SIGKILL, as the kernel's out-of-memory killer does),
  ``raise`` (a Python exception), ``oom`` (``torch.OutOfMemoryError``, as CUDA raises it) or ``hang``
  (stop answering the collectives).
* ``BATCHLAB_TEST_KILL=RANK:N`` — ``topology=disaggregated``: rank ``RANK`` is SIGKILLed when it is about to
  send its ``N``-th micro-batch (a target rank, stage ``send``) or to start its ``N``-th step (a drafter
  rank, stage ``wait_features``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

TEST_FAIL_ENV = "BATCHLAB_TEST_FAIL"
TEST_KILL_ENV = "BATCHLAB_TEST_KILL"
MODES = ("kill", "raise", "oom", "hang")
#: the stages ``BATCHLAB_TEST_KILL`` counts: a target rank's sends, a drafter rank's steps
COUNTED_STAGES = ("send", "wait_features")


def failure_spec(rank: int) -> tuple[int, str, str] | None:
    """``(step, stage, mode)`` of ``BATCHLAB_TEST_FAIL`` when it names this rank, else None."""
    value = os.environ.get(TEST_FAIL_ENV)
    if not value:
        return None
    try:
        fail_rank, step, stage, mode = value.split(":")
        fail_rank, step = int(fail_rank), int(step)
    except ValueError:
        raise ValueError(
            f"{TEST_FAIL_ENV}={value!r}: expected RANK:STEP:STAGE:MODE, e.g. 1:3:drafter_backward:kill") from None
    if mode not in MODES:
        raise ValueError(f"{TEST_FAIL_ENV}={value!r}: MODE must be one of {', '.join(MODES)}")
    return (step, stage, mode) if fail_rank == rank else None


def kill_spec(rank: int) -> int | None:
    """``N`` of ``BATCHLAB_TEST_KILL`` when it names this rank, else None."""
    value = os.environ.get(TEST_KILL_ENV)
    if not value:
        return None
    try:
        kill_rank, count = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"{TEST_KILL_ENV}={value!r}: expected RANK:N, e.g. 2:4") from None
    return count if kill_rank == rank else None


def fail(mode: str, rank: int, stage: str, step: int) -> None:
    """Fail now, the way ``mode`` says."""
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "oom":
        import torch

        raise torch.OutOfMemoryError(f"{TEST_FAIL_ENV}: simulated out of memory on rank {rank}")
    if mode == "hang":
        # stuck outside any collective: the others' collective timeout ends the job. (A rank stuck in C code
        # outlives the agent's SIGTERM and is SIGKILLed 30 s later; this one dies of it, to keep tests short.)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(1.0)
    raise RuntimeError(f"{TEST_FAIL_ENV}: simulated failure of rank {rank} in stage {stage!r} of step {step}")


def stage_hook(rank: int) -> Callable[[str, int], None] | None:
    """What :class:`~harness.train.status.RankStatus` calls on every stage of ``rank``: None unless a test
    variable names this rank."""
    failure, kill_at = failure_spec(rank), kill_spec(rank)
    if failure is None and kill_at is None:
        return None
    counts = dict.fromkeys(COUNTED_STAGES, 0)

    def on_stage(stage: str, step: int) -> None:
        if failure is not None and failure[:2] == (step, stage):
            fail(failure[2], rank, stage, step)
        if kill_at is not None and stage in counts:
            counts[stage] += 1
            if counts[stage] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    return on_stage
