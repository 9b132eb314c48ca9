"""Exactly once: which samples this rank consumed in the current epoch, the checks over all ranks, and the log.

Every rank counts the dataset rows of the micro-batches it trained on since the epoch began; at the end of
an epoch the counts summed over ranks must be one for every sample the plan kept and zero elsewhere. A
checkpoint stores the counts summed over ranks; a resumed run gives them to rank 0 (so the sum over ranks is
the same again, on any world size). With ``trainer.record_consumed`` every rank also writes
``consumed/rank{r}.jsonl``: one line per micro-batch, its dataset rows in order (the tests compare them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from harness.train.loop.metrics import truncate_metrics

CONSUMED_DIR = "consumed"


class ConsumedSamples:
    state_version = 1

    def __init__(self, num_samples: int, comm: Any, run_dir: Path, record: bool) -> None:
        self.comm = comm
        self.env = comm.env
        self.counts = np.zeros(num_samples, dtype=np.int64)
        self.resumed_total: np.ndarray | None = None  # the checkpoint's counts (every rank), after a resume
        self.log_path = Path(run_dir) / CONSUMED_DIR / f"rank{self.env.rank}.jsonl" if record else None
        self._log: IO[str] | None = None

    # ---------------------------------------------------------------- the log
    def open_log(self, global_step: int) -> None:
        """Start ``consumed/rank{r}.jsonl``: a resumed run rewrites what came after its checkpoint (and, on rank 0,
        the files of ranks a resume on fewer ranks no longer has); a fresh run starts a new file."""
        if self.log_path is None or self._log is not None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.resumed_total is not None:
            truncate_metrics(self.log_path, global_step)
            if self.env.is_main:
                for rank_file in self.log_path.parent.glob("rank*.jsonl"):
                    rank = rank_file.stem[len("rank"):]
                    if rank.isdigit() and int(rank) >= self.env.world_size:
                        truncate_metrics(rank_file, global_step)
        elif self.log_path.exists():
            self.log_path.unlink()
        self._log = self.log_path.open("a")

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # ---------------------------------------------------------------- counting
    def add(self, batches: list[Any], step: int, epoch: int, step_in_epoch: int) -> None:
        """The micro-batches of optimizer step ``step`` (counted from 1) were trained on."""
        for batch in batches:
            rows = batch.sample_indices.numpy()
            np.add.at(self.counts, rows, 1)
            if self._log is not None:
                self._log.write(json.dumps({"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                                            "rows": rows.tolist()}) + "\n")
        if self._log is not None:
            self._log.flush()  # a killed run keeps what it consumed up to its last step

    def total(self) -> np.ndarray:
        """The counts summed over ranks (a collective)."""
        return self.comm.all_reduce_sum(torch.from_numpy(self.counts.copy())).numpy()

    def end_epoch(self, kept_rows: np.ndarray) -> bool:
        """At the end of an epoch whose plan kept dataset rows ``kept_rows``: was each consumed exactly once?
        The counts start again from zero."""
        expected = np.zeros_like(self.counts)
        expected[kept_rows] = 1
        once = bool(np.array_equal(self.total(), expected))
        self.counts[:] = 0
        return once

    def at_most_once(self) -> bool:
        """No sample consumed more than once so far in the current epoch (a collective)."""
        return bool((self.total() <= 1).all())

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.total()}  # a collective: every rank saves

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resumed_total = np.asarray(state["counts"])
        self.counts = self.resumed_total.copy() if self.env.is_main else np.zeros_like(self.resumed_total)
