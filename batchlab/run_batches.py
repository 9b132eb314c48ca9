"""Every epoch of a run as one sequence of this rank's micro-batches, for trainers that count steps, not epochs.

Epochs of a budgeted plan differ in length (packing, buckets and shuffles fill differently each epoch), while the
Hugging Face ``Trainer`` assumes each epoch as long as the first and maps a checkpoint's step count back to an epoch and
position with that assumption. :class:`RunBatches` plans the run's epochs before it starts, so the run's steps are
known, and the sampler state after any optimizer step is computed from the step count alone: a checkpoint is exact
whatever the loader had prefetched, and resumes on any world size.
"""

from __future__ import annotations

import math
from itertools import islice
from typing import Any, Iterator

from torch.utils.data import Sampler

from .sampler import StrategyBatchSampler


class RunBatches(Sampler[list[int]]):
    """The micro-batches of ``epochs`` epochs (or of ``max_steps`` optimizer steps) of ``sampler``, in order.

    Args:
        sampler: this rank's sampler (its epoch and position are driven from here).
        epochs: how many epochs; a fraction runs the first ``ceil(f * steps)`` steps of the last one.
        max_steps: or a number of optimizer steps (as many epochs as they take); wins over ``epochs``.
        resume: ``{"global_step": g, "sampler": state}`` written by :meth:`checkpoint` after step ``g``: the run
            continues after it. The sequence then opens with ``g * grad_accum`` empty placeholders for the steps
            done, which a step-counting trainer skips (the ``Trainer`` skips ``global_step * grad_accum`` batches of
            its loader's batch sampler on resume, never collating them); the real micro-batches follow.
    """

    def __init__(self, sampler: StrategyBatchSampler, epochs: float = 1.0, max_steps: int | None = None,
                 resume: dict[str, Any] | None = None) -> None:
        if max_steps is None and not epochs > 0:
            raise ValueError(f"epochs={epochs!r} must be > 0 (or give max_steps)")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps={max_steps!r} must be >= 1")
        self.sampler = sampler
        self.resume = resume
        self.done_steps = int(resume["global_step"]) if resume else 0
        self._establish_start()
        start = sampler.state_dict()
        self._first_consumed = start["consumed_before"]
        #: (epoch, first step, end step, the epoch plan's steps) of every epoch this run still runs
        self.segments: list[tuple[int, int, int, int]] = []
        self._lengths: list[int] = []  # this rank's micro-batches of each segment
        budget = None if max_steps is None else max_steps - self.done_steps
        last_epoch = math.ceil(epochs) - 1
        epoch, first = start["epoch"], start["steps_done"]
        while budget is None or budget > 0:
            if epoch != start["epoch"]:
                sampler.restart(epoch)
            steps = sampler.num_steps
            end = steps
            if budget is None and epoch == last_epoch and epochs != math.ceil(epochs):
                end = min(steps, max(first, math.ceil((epochs - math.floor(epochs)) * steps)))
            if budget is not None:
                end = min(end, first + budget)
                budget -= end - first
            self.segments.append((epoch, first, end, steps))
            boundaries = sampler.step_boundaries()
            self._lengths.append(int(boundaries[end] - boundaries[first]))
            if budget is None and epoch >= last_epoch:
                break
            epoch, first = epoch + 1, 0
        self._establish_start()

    @property
    def steps(self) -> int:
        """Optimizer steps of the whole run, those done before a resume included."""
        return self.done_steps + sum(end - first for _, first, end, _ in self.segments)

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the run's epochs are driven from here (a ``Trainer`` sees the whole run as one epoch)."""

    @property
    def skipped(self) -> int:
        """The placeholders the sequence opens with: ``grad_accum`` for each step done before a resume."""
        return self.done_steps * self.sampler.grad_accum

    def __len__(self) -> int:
        """The placeholders of the steps done, then this rank's micro-batches still to run."""
        return self.skipped + sum(self._lengths)

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.skipped):
            yield []
        for index, ((epoch, _, _, _), count) in enumerate(zip(self.segments, self._lengths)):
            if index == 0:
                self._establish_start()
            else:
                self.sampler.restart(epoch)
            yield from islice(iter(self.sampler), count)

    def checkpoint(self, global_step: int) -> dict[str, Any]:
        """What :class:`RunBatches` resumes from after ``global_step`` optimizer steps of the run (every rank
        computes the same: the state of the step, not of the loader's read-ahead)."""
        epoch, steps_done, index = self._locate(global_step)
        state = self.sampler.state_for(epoch, steps_done, self._first_consumed if index == 0 else None)
        return {"global_step": int(global_step), "sampler": state}

    def epoch_progress(self, global_step: int) -> float:
        """The run's epoch after ``global_step`` steps, with the fraction of its plan done (``1.5``: half of epoch 1)."""
        epoch, steps_done, index = self._locate(global_step)
        return epoch + steps_done / max(self.segments[index][3], 1)

    def _locate(self, global_step: int) -> tuple[int, int, int]:
        left = global_step - self.done_steps
        if left < 0:
            raise ValueError(f"global_step={global_step} is before this run's start (step {self.done_steps})")
        last = len(self.segments) - 1
        for index, (epoch, first, end, _) in enumerate(self.segments):  # a step that ends an epoch starts the next
            if left < end - first or (left == end - first and index == last):
                return epoch, first + left, index
            left -= end - first
        raise ValueError(f"global_step={global_step} is past the run's last step ({self.steps})")

    def _establish_start(self) -> None:
        """Put the sampler where this run starts: the resumed state, or the first epoch's beginning."""
        if self.resume:
            self.sampler.load_state_dict(self.resume["sampler"])
        else:
            self.sampler.restart(0)
