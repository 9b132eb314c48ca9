"""The plan of one epoch: its optimizer steps, their micro-batches and their layout.

A plan stores every micro-batch of the epoch in two flat arrays (no Python lists of lists, so a
902K-sample epoch costs a few MB): ``sample_indices`` is the concatenation of all micro-batches and
``micro_batch_offsets[m]:micro_batch_offsets[m + 1]`` slices micro-batch ``m`` out of it.

Micro-batches are ordered step-major, then rank, then accumulation micro-step::

    m = (step * world_size + rank) * grad_accum + accum

so a step always owns exactly ``world_size * grad_accum`` consecutive micro-batches. A short final
step is filled with empty micro-batches (they still join the collective ops); nothing is dropped.

A plan of *equal-token steps* (``step_tokens`` set, docs/design/data-flow.md) keeps the same grid: its
steps hold different numbers of micro-batches, ``grad_accum`` is the most any rank holds in any
step, and a rank with fewer has empty *padding* slots after its real micro-batches.
:meth:`Plan.rank_step_counts` says how many slots of each rank in each step are real; a consumer
runs those, or one empty micro-batch where a rank has none (it must still join the step's
synchronised backward).

A plan of *the rest of an epoch* (:func:`strategies.plan_remainder`, for resuming on another world
size) also records ``consumed``: the samples the epoch visited before it; they must not appear again,
and the plan visits every other kept sample once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Layout = Literal["padded", "packed"]

#: largest ``Budget.max_tokens`` (and ``max_samples``): 2**40 tokens keeps every slot count, token sum and
#: ``len**2`` term of a micro-batch far inside int64 (and float64's exact integers) for any realistic dataset
MAX_BUDGET_TOKENS = 1 << 40


@dataclass(frozen=True)
class Budget:
    """Token budget of one micro-batch, shared by every strategy.

    ``max_tokens`` counts computed token slots: ``rows * padded_len`` for a padded layout, the
    capacity of the one flat row for a packed layout. ``max_samples`` optionally caps the number of
    samples (rows, or documents in a packed row).
    """

    max_tokens: int
    max_samples: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)):
            raise ValueError(f"Budget.max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(
                f"Budget.max_tokens={self.max_tokens} is smaller than one token; "
                "set max_tokens to at least the longest sample length"
            )
        if self.max_tokens > MAX_BUDGET_TOKENS:
            raise ValueError(
                f"Budget.max_tokens={self.max_tokens} is larger than {MAX_BUDGET_TOKENS} (2**40), far beyond any "
                "micro-batch; token counts and costs would overflow 64-bit integers — use a realistic budget"
            )
        if self.max_samples is not None and (
            isinstance(self.max_samples, bool)
            or not isinstance(self.max_samples, (int, np.integer))
            or not 1 <= self.max_samples <= MAX_BUDGET_TOKENS
        ):
            raise ValueError(
                f"Budget.max_samples={self.max_samples!r} must be a positive integer (at most 2**40) or None"
            )


@dataclass(frozen=True)
class Plan:
    """One epoch of optimizer steps under one strategy.

    Attributes:
        strategy: registry name of the strategy that made the plan.
        layout: ``"padded"`` (each micro-batch is ``rows x max_len``) or ``"packed"`` (each
            micro-batch is one flat row of whole samples; cu_seqlens from ``lengths``).
        lengths: int64 length of every sample as the plan uses it (after truncation), indexed by
            sample index; dropped samples keep their original length here.
        sample_indices: int64, all micro-batches concatenated (see module docstring for order).
        micro_batch_offsets: int64, ``num_steps * world_size * grad_accum + 1`` offsets.
        dropped: int64 indices removed by the ``drop`` oversize policy (empty otherwise).
        truncated: int64 indices shortened by the ``truncate`` oversize policy.
        consumed: int64 indices, ascending, that the epoch visited before this plan (a rest-of-epoch
            plan, :func:`strategies.plan_remainder`); empty for a whole epoch's plan.
        info: strategy-specific facts about the plan (e.g. ``edges`` of a bucketed plan, the
            ``oversize`` policy, the ``balance`` settings); plain data, for reports.
        step_tokens: None for fixed accumulation (every step ``world_size * grad_accum``
            micro-batches, the last one possibly short); else the real tokens each optimizer step
            aims at (equal-token steps): steps then hold varying numbers of micro-batches and
            ``grad_accum`` is the most any rank holds in a step (see :meth:`rank_step_counts`).
    """

    strategy: str
    layout: Layout
    lengths: np.ndarray
    sample_indices: np.ndarray
    micro_batch_offsets: np.ndarray
    budget: Budget
    seed: int
    epoch: int
    world_size: int
    grad_accum: int
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    truncated: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    consumed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    info: Mapping[str, object] = field(default_factory=dict)
    step_tokens: int | None = None

    def __post_init__(self) -> None:
        per_step = self.world_size * self.grad_accum
        n_micro = len(self.micro_batch_offsets) - 1
        if n_micro % per_step:
            raise ValueError(
                f"plan has {n_micro} micro-batches, not a multiple of world_size*grad_accum={per_step}"
            )
        if self.step_tokens is not None and (
            isinstance(self.step_tokens, (bool, np.bool_))
            or not isinstance(self.step_tokens, (int, np.integer))
            or self.step_tokens < 1
        ):
            raise ValueError(f"Plan.step_tokens={self.step_tokens!r} must be None or a positive integer")

    # -- shape ---------------------------------------------------------------------------------
    @property
    def micro_batches_per_step(self) -> int:
        return self.world_size * self.grad_accum

    @property
    def num_micro_batches(self) -> int:
        """All micro-batch slots, empty ones included."""
        return len(self.micro_batch_offsets) - 1

    @property
    def num_steps(self) -> int:
        return self.num_micro_batches // self.micro_batches_per_step

    def micro_batch_index(self, step: int, rank: int, accum: int) -> int:
        if not (0 <= step < self.num_steps and 0 <= rank < self.world_size and 0 <= accum < self.grad_accum):
            raise IndexError(
                f"(step={step}, rank={rank}, accum={accum}) outside plan of {self.num_steps} steps, "
                f"world_size={self.world_size}, grad_accum={self.grad_accum}"
            )
        return (step * self.world_size + rank) * self.grad_accum + accum

    # -- access --------------------------------------------------------------------------------
    def micro_batch(self, step: int, rank: int, accum: int) -> np.ndarray:
        """Sample indices of one micro-batch (possibly empty)."""
        m = self.micro_batch_index(step, rank, accum)
        return self.sample_indices[self.micro_batch_offsets[m] : self.micro_batch_offsets[m + 1]]

    def step_micro_batches(self, step: int) -> list[list[np.ndarray]]:
        """``[rank][accum]`` sample-index arrays of one optimizer step."""
        return [
            [self.micro_batch(step, r, a) for a in range(self.grad_accum)] for r in range(self.world_size)
        ]

    def rank_steps(
        self, rank: int, start_step: int = 0, skip_padding: bool = False
    ) -> Iterator[tuple[int, list[np.ndarray]]]:
        """One rank's view: ``(step, [grad_accum micro-batches])`` from ``start_step`` on (resume).

        With ``skip_padding`` each step lists only the rank's real micro-batches
        (:meth:`rank_step_counts`), or one empty micro-batch where it has none in that step.
        """
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank={rank} outside world_size={self.world_size}")
        if not 0 <= start_step <= self.num_steps:
            raise IndexError(f"start_step={start_step} outside plan of {self.num_steps} steps")
        counts = self.rank_step_counts()[:, rank] if skip_padding else None
        for step in range(start_step, self.num_steps):
            used = self.grad_accum if counts is None else max(int(counts[step]), 1)
            yield step, [self.micro_batch(step, rank, a) for a in range(used)]

    def rank_step_counts(self) -> np.ndarray:
        """``[num_steps, world_size]``: the real micro-batches of each rank in each step.

        A rank's real micro-batches fill its first slots of a step (``accum < count``) and every
        slot after them is an empty padding slot, so a consumer runs ``max(count, 1)`` slots: its
        real micro-batches, or one empty micro-batch where the rank has nothing in the step (it
        still joins the step's collectives). Counted as the slots up to the rank's last non-empty
        one, so skipping the slots after it never skips a sample. Fixed accumulation:
        ``grad_accum`` everywhere but in a short final step.
        """
        filled = self.micro_batch_sizes().reshape(self.num_steps, self.world_size, self.grad_accum) > 0
        last = self.grad_accum - np.argmax(filled[:, :, ::-1], axis=2)
        return np.where(filled.any(axis=2), last, 0).astype(np.int64)

    def rank_step_slots(self) -> np.ndarray:
        """``[num_steps, world_size]``: the micro-batch slots a rank runs in each step. Fixed accumulation: all
        ``grad_accum`` of them (a short final step's empty ones too); equal-token steps: its real micro-batches,
        or one empty slot where it has none (:meth:`rank_step_counts`)."""
        if self.step_tokens is None:
            return np.full((self.num_steps, self.world_size), self.grad_accum, dtype=np.int64)
        return np.maximum(self.rank_step_counts(), 1)

    def tokens_per_step(self) -> np.ndarray:
        """Real (non-pad) tokens of every optimizer step, all ranks and micro-batches together."""
        return self.micro_batch_tokens().reshape(self.num_steps, self.micro_batches_per_step).sum(axis=1)

    # -- vectorised per-micro-batch quantities ------------------------------------------------
    def micro_batch_sizes(self) -> np.ndarray:
        """Number of samples in every micro-batch slot."""
        return np.diff(self.micro_batch_offsets)

    def micro_batch_tokens(self) -> np.ndarray:
        """Real (non-pad) tokens of every micro-batch slot."""
        return segment_reduce(np.add, self.lengths[self.sample_indices], self.micro_batch_offsets)

    def micro_batch_max_length(self) -> np.ndarray:
        return segment_reduce(np.maximum, self.lengths[self.sample_indices], self.micro_batch_offsets)

    def micro_batch_slots(self) -> np.ndarray:
        """Computed token slots of every micro-batch slot.

        Padded: ``rows * max_len``. Packed: the row's capacity ``max_tokens`` (what a static-shape
        kernel computes; a varlen kernel computes only the real tokens, so for packed plans this
        is an upper bound on cost and the padding efficiency a lower bound). Empty slots cost 0.
        """
        sizes = self.micro_batch_sizes()
        if self.layout == "packed":
            return np.where(sizes > 0, self.budget.max_tokens, 0).astype(np.int64)
        return sizes * self.micro_batch_max_length()

    # -- checks --------------------------------------------------------------------------------
    def kept_indices(self) -> np.ndarray:
        """Indices the epoch must visit: every sample but the dropped ones, ascending."""
        keep = np.ones(len(self.lengths), dtype=bool)
        keep[self.dropped] = False
        return np.flatnonzero(keep).astype(np.int64)

    def remaining_indices(self) -> np.ndarray:
        """Indices this plan must visit: the kept ones the epoch has not consumed before it, ascending."""
        keep = np.ones(len(self.lengths), dtype=bool)
        keep[self.dropped] = False
        keep[self.consumed] = False
        return np.flatnonzero(keep).astype(np.int64)

    def exactly_once_violations(self) -> tuple[int, int]:
        """``(missing, repeated)``: kept indices the plan never visits, and visits beyond one.

        A dropped index, or one the epoch consumed before this plan, must not appear at all (each
        appearance counts as repeated), and indices outside ``[0, len(lengths))`` are never valid
        (each counts as repeated).
        """
        size = len(self.lengths)
        indices = self.sample_indices
        in_range = (indices >= 0) & (indices < size)
        counts = np.bincount(indices[in_range], minlength=size)
        expected = np.ones(size, dtype=np.int64)
        expected[self.dropped] = 0
        expected[self.consumed] = 0
        missing = int(np.maximum(expected - counts, 0).sum())
        repeated = int(np.maximum(counts - expected, 0).sum()) + int((~in_range).sum())
        return missing, repeated

    def exactly_once(self) -> bool:
        """True when every kept index appears exactly once and no dropped index appears.

        For a rest-of-epoch plan: every kept index not consumed before it appears once, and no
        consumed one appears (with the consumed ones, the epoch visits every kept index once).
        """
        return self.exactly_once_violations() == (0, 0)

    def budget_violations(self) -> np.ndarray:
        """Micro-batch slots that break the budget (empty when the plan is within budget).

        Padded: ``rows * max_len > max_tokens``; packed: ``sum(len) > max_tokens``; both:
        ``rows > max_samples`` when ``max_samples`` is set.
        """
        if self.layout == "packed":
            over = self.micro_batch_tokens() > self.budget.max_tokens
        else:
            over = self.micro_batch_slots() > self.budget.max_tokens
        if self.budget.max_samples is not None:
            over |= self.micro_batch_sizes() > self.budget.max_samples
        return np.flatnonzero(over)


def segment_reduce(
    ufunc: np.ufunc, values: np.ndarray, offsets: np.ndarray, dtype: type = np.int64
) -> np.ndarray:
    """``ufunc.reduce`` of each ``values[offsets[i]:offsets[i+1]]`` in ``dtype``; empty segments give 0."""
    out = np.zeros(len(offsets) - 1, dtype=dtype)
    nonempty = offsets[1:] > offsets[:-1]
    if values.size and nonempty.any():
        out[nonempty] = ufunc.reduceat(values.astype(dtype), offsets[:-1][nonempty])
    return out
