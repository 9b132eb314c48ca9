"""Where every rank is: one small fixed-size record per rank, rewritten at each stage boundary.

A rank that dies (an exception, SIGKILL, the out-of-memory killer) cannot say where it was; its status
file can. Each rank owns ``run_dir/status/rank{r}.status`` and rewrites one fixed-size record in place
(``os.pwrite`` at offset 0 into a file opened once, no fsync): a stage name, the optimizer step, the
time, the pid and its role. The page cache keeps what a killed process wrote, so the job's launcher
(:func:`harness.train.launch.run.run`) reads the last stage and step of the rank that failed with
:func:`read_statuses` and names them. Cheap enough for several calls per step (one syscall, no
allocation beyond packing ~100 bytes).

A record is ``MAGIC | version | rank | step | time | pid | role | stage`` (little-endian, fixed
size); a torn read (the writer mid-pwrite) is detected by a sequence number written at both ends and
retried.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Self

STATUS_DIR = "status"
_MAGIC = b"BLST"
_VERSION = 1
_NAME = 48  # bytes for the stage name
_ROLE = 16  # bytes for the role
# magic, version, seq, rank, step, time, pid, role, stage, seq again
_FORMAT = struct.Struct(f"<4sHQiqdi{_ROLE}s{_NAME}sQ")
RECORD_SIZE = _FORMAT.size


def status_path(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / STATUS_DIR / f"rank{int(rank)}.status"


class RankStatus:
    """This rank's status record: :meth:`stage` says what it is doing now, at which optimizer step."""

    def __init__(self, run_dir: Path | str, rank: int, role: str = "train") -> None:
        self.rank = int(rank)
        self.role = role
        self.path = status_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._role = role.encode()[:_ROLE]
        self._pid = os.getpid()
        self._seq = 0
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.stage("start", 0)

    def stage(self, name: str, step: int) -> None:
        """Record that this rank is now in stage ``name`` of optimizer step ``step`` (one pwrite).

        ``step`` is the optimizer step being worked on, counted as ``metrics.jsonl``'s ``step`` (the first
        step is 1; 0 before training starts)."""
        if self._fd is None:
            return
        self._seq += 1
        record = _FORMAT.pack(_MAGIC, _VERSION, self._seq, self.rank, int(step), time.time(), self._pid,
                              self._role, name.encode()[:_NAME], self._seq)
        os.pwrite(self._fd, record, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _read_one(path: Path) -> dict | None:
    for _ in range(5):
        try:
            data = path.read_bytes()[:RECORD_SIZE]
        except OSError:
            return None
        if len(data) < RECORD_SIZE:
            return None
        magic, version, seq, rank, step, at, pid, role, stage, seq_end = _FORMAT.unpack(data)
        if magic != _MAGIC or version != _VERSION:
            return None
        if seq == seq_end:
            return {"rank": rank, "role": role.rstrip(b"\0").decode(errors="replace"),
                    "stage": stage.rstrip(b"\0").decode(errors="replace"), "step": step, "time": at, "pid": pid}
    return None


def read_statuses(run_dir: Path | str, since: float | None = None) -> dict[int, dict]:
    """rank → ``{role, stage, step, time, pid}`` for every rank that has written a status under ``run_dir``
    (only those written at or after ``since``, a ``time.time()``, when given: not an earlier run's)."""
    directory = Path(run_dir) / STATUS_DIR
    statuses: dict[int, dict] = {}
    if not directory.is_dir():
        return statuses
    for path in sorted(directory.glob("rank*.status")):
        record = _read_one(path)
        if record is not None and (since is None or record["time"] >= since):
            statuses[record.pop("rank")] = record
    return statuses


def describe(status: dict | None) -> str:
    """``in stage 'drafter_backward' of step 3`` (and the role unless ``train``): where a rank was, for messages."""
    if status is None:
        return "while starting (before its trainer recorded a stage)"
    role = f" (role {status['role']})" if status["role"] != "train" else ""
    return f"in stage {status['stage']!r} of step {status['step']}{role}"


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (a rank on another node reads as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def rank_lines(run_dir: Path | str, now: float | None = None) -> list[str]:
    """One line per rank: failed (with its one-line error, from ``rank{r}.error.json``), finished (the run's
    ``summary.json``), stopped (its process is gone without a word) or where it is now."""
    import json

    directory = Path(run_dir)
    now = time.time() if now is None else now
    summary_path = directory / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    lines = []
    for rank, status in sorted(read_statuses(directory).items()):
        head = f"rank {rank} (pid {status['pid']})"
        error_path = directory / STATUS_DIR / f"rank{rank}.error.json"
        error = json.loads(error_path.read_text()) if error_path.exists() else None
        if error is not None and error["time"] >= status["time"]:  # this run's failure, not an earlier one's
            lines.append(f"{head} failed {describe(status)}: {error['error']} "
                         f"(traceback: {directory / STATUS_DIR / f'rank{rank}.traceback'})")
        elif summary is not None and summary.get("status") and summary_path.stat().st_mtime >= status["time"]:
            lines.append(f"{head} finished ({summary['status']}) {describe(status)}")
        elif not _alive(status["pid"]):
            lines.append(f"{head} stopped {describe(status)}, {now - status['time']:.1f} s ago; its process is gone "
                         "without an error record (killed by a signal or the out-of-memory killer?)")
        else:
            lines.append(f"{head} {describe(status)}, {now - status['time']:.1f} s ago")
    return lines


def main(argv: list[str] | None = None) -> None:
    """``python -m harness.train.status RUN_DIR``: where every rank of a run is, or how it ended."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m harness.train.status", description=main.__doc__)
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    lines = rank_lines(args.run_dir)
    if not lines:
        raise SystemExit(f"no rank status under {Path(args.run_dir) / STATUS_DIR}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
