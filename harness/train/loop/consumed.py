"""Exactly once: which samples this rank consumed in the current epoch, and the checks over all ranks.

Every rank counts the dataset rows of the micro-batches it trained on since the epoch began; at the end of
an epoch the counts summed over ranks must be one for every sample the plan kept and zero elsewhere. A
checkpoint stores the counts summed over ranks; a resumed run gives them to rank 0 (so the sum over ranks is
the same again, on any world size).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class ConsumedSamples:
    state_version = 1

    def __init__(self, num_samples: int, comm: Any) -> None:
        self.comm = comm
        self.env = comm.env
        self.counts = np.zeros(num_samples, dtype=np.int64)
        self.resumed_total: np.ndarray | None = None  # the checkpoint's counts (every rank), after a resume

    # ---------------------------------------------------------------- counting
    def add(self, batches: list[Any], step: int, epoch: int, step_in_epoch: int) -> None:  # noqa: ARG002
        """The micro-batches of optimizer step ``step`` (counted from 1; step ``step_in_epoch`` of epoch ``epoch``)
        were trained on. (Where is for a rank hook's log: ``tests/support/rank_hook.py`` writes every rank's rows.)"""
        for batch in batches:
            np.add.at(self.counts, batch.sample_indices.numpy(), 1)

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
