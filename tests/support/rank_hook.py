"""The tests' side of a rank: faults, a slowed drafter and the log of consumed samples, around every rank's work.

``conftest.py`` names this file in ``BATCHLAB_RANK_HOOK`` for the whole session, so every rank a test starts
(in the test's process, or a fresh process under torch elastic, torchrun or submitit, which inherit the
environment) runs its work inside :func:`installed` (:mod:`harness.train.rank_hook`). What it does is read
from the environment, as the ranks start fresh:

* ``BATCHLAB_TEST_FAIL=RANK:STEP:STAGE:MODE`` — rank ``RANK`` fails on entering stage ``STAGE`` of optimizer
  step ``STEP``, MODE being ``kill`` (SIGKILL, as the kernel's out-of-memory killer does), ``raise`` (a Python
  exception), ``oom`` (``torch.OutOfMemoryError``, as CUDA raises it) or ``hang`` (stop answering the
  collectives). The failure comes just after the rank's status file records the stage, where a real one
  would be recorded.
* ``BATCHLAB_TEST_KILL=RANK:N`` — ``topology=disaggregated``: rank ``RANK`` is SIGKILLed when it is about to
  send its ``N``-th micro-batch (a target rank, stage ``send``) or to start its ``N``-th step (a drafter rank,
  stage ``wait_features``).
* ``BATCHLAB_TEST_DRAFTER_DELAY_S=S`` — a drafter rank of ``topology=disaggregated`` sleeps ``S`` seconds
  after each step (before waiting for the next one's features): a slow drafter, however fast the machine.
* always: every rank writes ``run_dir/consumed/rank{r}.jsonl``, one line per micro-batch it trained on (its
  step, epoch, step in the epoch and dataset rows, in order); a resumed run rewrites what came after its
  checkpoint (and rank 0 the files of ranks a resume on fewer ranks no longer has). The tests compare them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

TEST_FAIL_ENV = "BATCHLAB_TEST_FAIL"
TEST_KILL_ENV = "BATCHLAB_TEST_KILL"
DRAFTER_DELAY_ENV = "BATCHLAB_TEST_DRAFTER_DELAY_S"
MODES = ("kill", "raise", "oom", "hang")
#: the stages ``BATCHLAB_TEST_KILL`` counts: a target rank's sends, a drafter rank's steps
COUNTED_STAGES = ("send", "wait_features")
CONSUMED_DIR = "consumed"


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
    """What runs after rank ``rank`` records a stage: None unless a test variable asks for something."""
    failure, kill_at = failure_spec(rank), kill_spec(rank)
    delay = float(os.environ.get(DRAFTER_DELAY_ENV) or 0.0)
    if failure is None and kill_at is None and not delay:
        return None
    counts = dict.fromkeys(COUNTED_STAGES, 0)

    def on_stage(stage: str, step: int) -> None:
        if failure is not None and failure[:2] == (step, stage):
            fail(failure[2], rank, stage, step)
        if stage in counts:
            counts[stage] += 1
            if kill_at is not None and counts[stage] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if delay and stage == "wait_features" and counts[stage] > 1:  # after the drafter's previous step
                time.sleep(delay)

    return on_stage


class ConsumedLog:
    """``consumed/rank{r}.jsonl`` of one rank: opened at its first step (a resumed run cuts what came after its
    checkpoint first), one line per micro-batch, flushed every step (a killed run keeps what it consumed)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int) -> None:
        self.path = Path(run_dir) / CONSUMED_DIR / f"rank{rank}.jsonl"
        self.rank, self.world_size = rank, world_size
        self.opened = False

    def write(self, batches: list, step: int, epoch: int, step_in_epoch: int, resumed: bool) -> None:
        if not self.opened:
            self._open(step - 1, resumed)
        with self.path.open("a") as log:
            for batch in batches:
                log.write(json.dumps({"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                                      "rows": batch.sample_indices.tolist()}) + "\n")

    def _open(self, global_step: int, resumed: bool) -> None:
        from harness.train.loop.metrics import truncate_metrics

        self.opened = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resumed:
            self.path.unlink(missing_ok=True)
            return
        truncate_metrics(self.path, global_step)
        if self.rank == 0:
            for rank_file in self.path.parent.glob("rank*.jsonl"):
                other = rank_file.stem[len("rank"):]
                if other.isdigit() and int(other) >= self.world_size:
                    truncate_metrics(rank_file, global_step)


@contextlib.contextmanager
def installed(rank: int, run_dir: Path) -> Iterator[None]:
    """Rank ``rank`` of the run in ``run_dir`` works inside this (:mod:`harness.train.rank_hook`); what it changes
    is undone after (a one-rank run works in the test's own process)."""
    from harness.train.loop.consumed import ConsumedSamples
    from harness.train.status import RankStatus

    on_stage = stage_hook(rank)
    logs: dict[int, ConsumedLog] = {}
    record_stage, count = RankStatus.stage, ConsumedSamples.add

    def stage(self, name: str, step: int) -> None:
        record_stage(self, name, step)
        if on_stage is not None:
            on_stage(name, step)

    def add(self, batches: list, step: int, epoch: int, step_in_epoch: int) -> None:
        count(self, batches, step, epoch, step_in_epoch)
        log = logs.setdefault(id(self), ConsumedLog(run_dir, self.env.rank, self.env.world_size))
        log.write(batches, step, epoch, step_in_epoch, resumed=self.resumed_total is not None)

    RankStatus.stage, ConsumedSamples.add = stage, add
    try:
        yield
    finally:
        RankStatus.stage, ConsumedSamples.add = record_stage, count
