"""The batching strategies: ``sorted``, ``shuffle``, ``bucketed``, ``packed`` and ``length_grouped``.

Each strategy is a small frozen dataclass whose fields are its options and whose :meth:`plan` maps
``(lengths, budget, seed, epoch, world_size, grad_accum)`` to a :class:`Plan`; see the package
docstring for the semantics of each. All randomness comes from ``(seed, epoch, purpose)``
generators (:mod:`strategies._random`); the sequential loops are compiled (:mod:`strategies.kernels`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, Optional

import numpy as np

from ._assemble import MicroBatches
from .kernels import BEST_FIT_MAX_CAPACITY, best_fit_packed, first_fit_packed, greedy_fill_padded
from ._random import STATIC_EPOCH, Purpose, generator
from .base import CliOption, Strategy, cut_token_steps, micro_batch_real_tokens
from .edges import EDGE_METHODS, _edges_from_histogram, explicit_edges, length_histogram, parse_edges
from .epoch_plan import Budget, Layout
from .registry import register_strategy
from .validate import check_positive_int

#: default (most) buckets of ``bucketed``. With the default ``max_recurrence`` the budget-aware dp
#: uses as many of them as lower the expected padding while every bucket keeps enough samples, so
#: the number used follows the dataset; the cap is high so that a large dataset is never held to
#: fewer buckets than its padding calls for, and a small one is held back by the bound, not by it
#: (numbers per dataset: docs/design/strategies.md, benchmarks/RESULTS.md).
DEFAULT_NUM_BUCKETS = 64
#: default ``max_recurrence`` of ``bucketed``
DEFAULT_MAX_RECURRENCE = 0.1


def parse_max_recurrence(text: str) -> float | None:
    """``max_recurrence`` from text: a number in (0, 1], or ``none`` for no bound."""
    if text.strip().lower() in ("none", "null", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a number in (0, 1] nor 'none'") from None
    if not 0 < value <= 1:
        raise ValueError(f"{text!r} must be in (0, 1] (or 'none' for no bound)")
    return value


def _compact(values: np.ndarray) -> np.ndarray:
    """Lengths or bucket ids as the narrowest unsigned dtype, so numpy's stable sort is a radix sort."""
    top = int(values.max()) if values.size else 0
    for dtype in (np.uint8, np.uint16):
        if top <= np.iinfo(dtype).max:
            return values.astype(dtype)
    return values


def _max_samples(budget: Budget, n: int) -> int:
    return budget.max_samples if budget.max_samples is not None else n + 1


def padded_fill(
    order: np.ndarray, lengths: np.ndarray, budget: Budget, group_offsets: np.ndarray | None = None
) -> np.ndarray:
    """Greedy fill of the padded strategies: micro-batch offsets into ``order``, a micro-batch growing
    while ``rows * longest <= max_tokens`` (and ``rows <= max_samples``), never across ``group_offsets``."""
    if group_offsets is None:
        group_offsets = np.array([0, order.size], dtype=np.int64)
    return greedy_fill_padded(
        lengths[order], group_offsets, budget.max_tokens, _max_samples(budget, order.size)
    )


@register_strategy
@dataclass(frozen=True)
class SortedStrategy(Strategy):
    """Sort by length (ties by a seeded permutation), greedy fill, shuffle micro-batch order per epoch.

    The micro-batches' composition depends on ``seed`` only, never on ``epoch`` (the defect under
    study); only their order changes between epochs.
    """

    name: ClassVar[str] = "sorted"
    epoch_composition: ClassVar[str] = "fixed"
    report_rank: ClassVar[int] = 0

    def micro_batches(self, prepared, budget, seed, epoch, per_step):
        ties = generator(seed, STATIC_EPOCH, Purpose.SORTED_TIES).permutation(prepared.kept)
        order = ties[np.argsort(_compact(prepared.lengths[ties]), kind="stable")]
        offsets = padded_fill(order, prepared.lengths, budget)
        sequence = generator(seed, epoch, Purpose.MICRO_BATCH_ORDER).permutation(offsets.size - 1)
        return MicroBatches(order, offsets, sequence)


@register_strategy
@dataclass(frozen=True)
class ShuffleStrategy(Strategy):
    """Random permutation of the samples each epoch, then the same greedy fill as ``sorted``."""

    name: ClassVar[str] = "shuffle"
    epoch_composition: ClassVar[str] = "reshuffled"
    report_rank: ClassVar[int] = 4

    def micro_batches(self, prepared, budget, seed, epoch, per_step):
        order = generator(seed, epoch, Purpose.SAMPLE_ORDER).permutation(prepared.kept)
        offsets = padded_fill(order, prepared.lengths, budget)
        return MicroBatches(order, offsets, np.arange(offsets.size - 1, dtype=np.int64))


@register_strategy
@dataclass(frozen=True)
class BucketedStrategy(Strategy):
    """Length buckets; shuffle inside buckets, fill inside a bucket, shuffle the micro-batch order."""

    name: ClassVar[str] = "bucketed"
    epoch_composition: ClassVar[str] = "bounded"
    report_rank: ClassVar[int] = 2
    cli_options: ClassVar[tuple[CliOption, ...]] = (
        CliOption("--num-buckets", "num_buckets", "buckets of the bucketed strategy", type=int),
        CliOption(
            "--edges",
            "edges",
            "bucket edges of the bucketed strategy: dp, quantile, equal_tokens, or a comma list of lengths",
            parse=parse_edges,
        ),
        CliOption(
            "--max-recurrence",
            "max_recurrence",
            "bucketed: bound on each bucket's composition recurrence, a number in (0, 1] or 'none' (default 0.1)",
            parse=parse_max_recurrence,
        ),
    )
    num_buckets: int = DEFAULT_NUM_BUCKETS
    """The most buckets; the dp edges use fewer when more would not lower the padding or would break the bound.

    The bound is ``max_recurrence``; default :data:`DEFAULT_NUM_BUCKETS`.
    """
    edges: str | Sequence[int] = "dp"
    """Bucket edges: ``dp`` (default), ``quantile``, ``equal_tokens``, or increasing upper edges."""
    same_bucket_steps: bool = True
    """Keep the ``world_size * grad_accum`` micro-batches of a step in one bucket (ranks then do similar work).

    Each bucket's micro-batches are cut into whole steps; the few left over per bucket (fewer than one step's
    worth) are shuffled together into mixed steps, so no step is padded with empty micro-batches except the last.
    A bucket forms its own steps only when it holds at least ``1 / max_recurrence`` steps' worth of micro-batches:
    a pure step of a bucket with ``s`` steps meets again with probability about ``1 / s`` in the next epoch, so
    smaller buckets (most of them on small datasets) go to the mixed pool whole, keeping the step recurrence under
    the same bound. Step order is shuffled each epoch. True: lower rank imbalance (for the target and the
    drafter), at the price of length-homogeneous steps (higher length-mix excess and step recurrence; micro-batch
    recurrence and padding are unchanged; numbers in docs/design/strategies.md). False mixes buckets inside a step. With
    ``step_tokens`` (equal-token steps) each bucket's micro-batches are cut into steps by the cut rule and the same
    rules apply to those steps (:func:`same_bucket_token_steps`).
    """
    max_recurrence: Optional[float] = DEFAULT_MAX_RECURRENCE
    """Bound on every bucket's composition recurrence between epochs, honoured by the dp edges (null: no bound).

    Honoured as a minimum bucket population inside the dynamic program: a bucket of ``n`` samples whose samples
    have ``partners`` micro-batch partners each (modelled from the bucket's length histogram) repeats a fraction
    ``partners / (n - 1)`` of its pairs in the next epoch, so it needs ``n >= 1 + partners / max_recurrence``
    samples (a bucket that fits in one micro-batch repeats all of them; a one-sample bucket is alone in the same
    micro-batch every epoch). Only samples at most half the budget long can pair; a bucket that straddles half the
    budget counts its pairs among those (:func:`strategies.edges.modelled_bucket_recurrence`). Buckets whose
    samples get one row each (longer than half the budget) have no pairs and no bound. Without any feasible split
    the edges fall back to one bucket. Other edge methods and explicit edges ignore it (the plan reports the
    recurrence it gets; ``batchlab-plan`` warns above the bound). Default 0.1.
    """

    def __post_init__(self) -> None:
        check_positive_int("bucketed num_buckets", self.num_buckets, "use at least one bucket")
        if self.max_recurrence is not None and (
            isinstance(self.max_recurrence, (bool, np.bool_))
            or not isinstance(self.max_recurrence, (int, float, np.integer, np.floating))
            or not 0 < self.max_recurrence <= 1
        ):
            raise ValueError(
                f"bucketed max_recurrence={self.max_recurrence!r} must be a number in (0, 1] or None (no bound)"
            )
        if isinstance(self.edges, str):
            if self.edges not in EDGE_METHODS:
                raise ValueError(
                    f"bucketed edges={self.edges!r} is unknown; use one of {list(EDGE_METHODS)} "
                    "or a list of increasing integer upper edges"
                )
        else:
            try:
                edges = tuple(self.edges)
            except TypeError as err:
                raise ValueError(
                    f"bucketed edges={self.edges!r} must be a method name or a list of integers"
                ) from err
            explicit_edges(edges, longest=1)  # validates the values
            object.__setattr__(self, "edges", edges)
        if not isinstance(self.same_bucket_steps, (bool, np.bool_)):
            raise ValueError(f"bucketed same_bucket_steps={self.same_bucket_steps!r} must be true or false")

    def edges_for(self, lengths: np.ndarray, budget: Budget | None = None) -> np.ndarray:
        """Upper edges for these (kept, validated) lengths; cached per histogram for computed edges."""
        if isinstance(self.edges, str):
            values, counts = length_histogram(lengths)
            return _edges_from_histogram(values, counts, self.num_buckets, self.edges, budget, self.max_recurrence)
        return explicit_edges(self.edges, longest=int(lengths.max()))

    def micro_batches(self, prepared, budget, seed, epoch, per_step):
        kept_lengths = prepared.lengths[prepared.kept]
        edges = self.edges_for(kept_lengths, budget)
        shuffled = generator(seed, epoch, Purpose.BUCKET_ORDER).permutation(prepared.kept)
        bucket_of = _compact(np.searchsorted(edges, prepared.lengths[shuffled], side="left"))
        by_bucket = np.argsort(bucket_of, kind="stable")  # radix sort on small ints; keeps the shuffle
        order = shuffled[by_bucket]
        bucket_sizes = np.bincount(bucket_of, minlength=edges.size)
        group_offsets = np.zeros(edges.size + 1, dtype=np.int64)
        np.cumsum(bucket_sizes, out=group_offsets[1:])
        offsets = padded_fill(order, prepared.lengths, budget, group_offsets)
        micro_bucket = bucket_of[by_bucket][offsets[:-1]].astype(np.int64)
        rng = generator(seed, epoch, Purpose.MICRO_BATCH_ORDER)
        if self.same_bucket_steps and per_step > 1:
            sequence = _same_bucket_sequence(micro_bucket, per_step, rng, self.max_recurrence)
        else:
            sequence = rng.permutation(offsets.size - 1)
        return MicroBatches(order, offsets, sequence, {"edges": edges.tolist()})

    def token_steps(self, micro, prepared, step_tokens, seed, epoch):
        """Equal-token steps; with ``same_bucket_steps``, steps of one bucket (:func:`same_bucket_token_steps`)."""
        if not self.same_bucket_steps:
            return super().token_steps(micro, prepared, step_tokens, seed, epoch)
        edges = np.asarray(micro.info["edges"], dtype=np.int64)
        micro_bucket = np.searchsorted(edges, prepared.lengths[micro.order[micro.offsets[:-1]]], side="left")
        sequence, step_offsets = same_bucket_token_steps(
            micro_bucket, micro_batch_real_tokens(prepared.lengths, micro), step_tokens,
            generator(seed, epoch, Purpose.STEP_ORDER), self.max_recurrence,
        )
        return replace(micro, sequence=sequence, step_offsets=step_offsets)


def same_bucket_token_steps(
    micro_bucket: np.ndarray,
    tokens: np.ndarray,
    step_tokens: int,
    rng: np.random.Generator,
    max_recurrence: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(sequence, step_offsets)`` of equal-token steps that stay inside one bucket where they can.

    The token counterpart of :func:`_same_bucket_sequence`: each bucket's micro-batches (ids are
    consecutive inside a bucket, in fill order) are cut into steps by the cut rule; every step but a
    bucket's last is a pure step of its bucket when the bucket has at least ``1 / max_recurrence`` of
    them. The rest (small buckets whole, every bucket's last step) is shuffled into a pool cut into
    mixed steps. Pure and mixed steps are shuffled together; the pool's last step, holding what is
    left, ends the epoch.
    """
    counts = np.bincount(micro_bucket)
    bucket_offsets = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=bucket_offsets[1:])
    cuts = cut_token_steps(tokens, step_tokens, bucket_offsets)
    step_bucket = micro_bucket[cuts[:-1]]
    whole_steps = np.bincount(step_bucket, minlength=counts.size) - 1  # all but each bucket's last step
    if max_recurrence is not None:
        whole_steps = np.where(whole_steps * max_recurrence >= 1.0 - 1e-9, whole_steps, 0)
    position = np.arange(step_bucket.size) - np.searchsorted(step_bucket, step_bucket, side="left")
    pure = position < whole_steps[step_bucket]
    pure_sizes = np.diff(cuts)[pure]
    in_pure = np.repeat(pure, np.diff(cuts))
    pool = np.flatnonzero(~in_pure)
    pool = pool[rng.permutation(pool.size)]
    pool_cuts = cut_token_steps(tokens[pool], step_tokens)
    # every step as a run of `candidates`: pure steps (ids in order), then the pool's steps
    candidates = np.concatenate([np.flatnonzero(in_pure), pool])
    starts = np.concatenate([np.cumsum(pure_sizes) - pure_sizes, pure_sizes.sum() + pool_cuts[:-1]])
    sizes = np.concatenate([pure_sizes, np.diff(pool_cuts)])
    shuffled = np.append(rng.permutation(sizes.size - 1), sizes.size - 1)  # the pool's last step stays last
    starts, sizes = starts[shuffled], sizes[shuffled]
    step_offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=step_offsets[1:])
    within = np.arange(candidates.size, dtype=np.int64) - np.repeat(step_offsets[:-1], sizes)
    return candidates[np.repeat(starts, sizes) + within], step_offsets


def _same_bucket_sequence(
    micro_bucket: np.ndarray, per_step: int, rng: np.random.Generator, max_recurrence: float | None = None
) -> np.ndarray:
    """Micro-batch order whose whole steps stay inside one bucket (see ``BucketedStrategy``).

    ``micro_bucket`` is non-decreasing (micro-batches are made bucket by bucket). Only buckets with
    at least ``1 / max_recurrence`` steps' worth of micro-batches form their own steps; the others,
    and every bucket's last partial step, go to a shuffled pool cut into mixed steps.
    """
    num_micro = micro_bucket.size
    bucket_start = np.searchsorted(micro_bucket, micro_bucket, side="left")
    bucket_count = np.bincount(micro_bucket)[micro_bucket]
    position = np.arange(num_micro) - bucket_start
    whole_steps = bucket_count // per_step
    if max_recurrence is not None:
        # a pure step holds per_step / count of its bucket: its pairs meet again in the next epoch
        # with probability ~ 1 / (steps of the bucket), so small buckets would repeat their steps
        whole_steps = np.where(whole_steps * max_recurrence >= 1.0 - 1e-9, whole_steps, 0)
    whole = position < whole_steps * per_step
    pure_steps = np.flatnonzero(whole).reshape(-1, per_step)  # ids are consecutive inside a bucket
    leftover = np.flatnonzero(~whole)
    leftover = leftover[rng.permutation(leftover.size)]
    num_mixed_full = leftover.size // per_step
    mixed_steps = leftover[: num_mixed_full * per_step].reshape(-1, per_step)
    steps = np.concatenate([pure_steps, mixed_steps])
    steps = steps[rng.permutation(len(steps))]
    return np.concatenate([steps.reshape(-1), leftover[num_mixed_full * per_step :]])


@register_strategy
@dataclass(frozen=True)
class PackedStrategy(Strategy):
    """Random order each epoch, then first-fit (or best-fit) of whole samples into rows.

    A row (one micro-batch, layout ``packed``) holds at most ``max_tokens`` tokens and
    ``max_samples`` documents; samples are never split. Rows are put in random order.
    """

    name: ClassVar[str] = "packed"
    epoch_composition: ClassVar[str] = "reshuffled"
    layout: ClassVar[Layout] = "packed"
    report_rank: ClassVar[int] = 3
    fit: str = "first"
    """How a sample finds its row: ``first`` fit (default) or ``best`` fit."""

    def __post_init__(self) -> None:
        if self.fit not in ("first", "best"):
            raise ValueError(f"packed fit={self.fit!r} is unknown; use 'first' or 'best'")

    def check_budget(self, budget: Budget) -> None:
        """Best-fit's index over free-space values bounds the row capacity."""
        if self.fit == "best" and budget.max_tokens > BEST_FIT_MAX_CAPACITY:
            raise ValueError(
                f"packed fit='best' supports max_tokens up to {BEST_FIT_MAX_CAPACITY}, got {budget.max_tokens}; "
                "use fit='first' for larger rows"
            )

    def micro_batches(self, prepared, budget, seed, epoch, per_step):
        shuffled = generator(seed, epoch, Purpose.SAMPLE_ORDER).permutation(prepared.kept)
        lengths = prepared.lengths[shuffled]
        capacity = budget.max_tokens
        if budget.max_samples is None:
            # any-fit packing leaves at most one row at most half full: rows <= 2 * tokens / C + 1
            max_rows = min(shuffled.size, 2 * (-(-int(lengths.sum()) // capacity)) + 2)
        else:
            max_rows = shuffled.size
        fill = first_fit_packed if self.fit == "first" else best_fit_packed
        grouped, offsets = fill(lengths, capacity, _max_samples(budget, shuffled.size), max_rows)
        sequence = generator(seed, epoch, Purpose.MICRO_BATCH_ORDER).permutation(offsets.size - 1)
        return MicroBatches(shuffled[grouped], offsets, sequence)


#: Hugging Face's default megabatch multiplier (``get_length_grouped_indices(mega_batch_mult=None)``)
HF_MEGA_BATCH_MULT = 50


@register_strategy
@dataclass(frozen=True)
class LengthGroupedStrategy(Strategy):
    """Hugging Face's ``LengthGroupedSampler`` rule under a token budget (``group_by_length=True``).

    Each epoch: a random permutation of the samples, cut into megabatches of
    ``mega_batch_mult * batch_size`` samples; each megabatch sorted by length, longest first (ties
    keep the permutation's order), and the longest sample of the epoch swapped to the front of the
    first megabatch, exactly as ``transformers.trainer_pt_utils.get_length_grouped_indices`` does;
    then each megabatch is split greedily into micro-batches under the budget (a micro-batch never
    spans two megabatches). As in Hugging Face, the multiplier is lowered to
    ``samples // (4 * batch_size)`` (at least 1) on small datasets.
    """

    name: ClassVar[str] = "length_grouped"
    epoch_composition: ClassVar[str] = "reshuffled"
    report_rank: ClassVar[int] = 1
    cli_options: ClassVar[tuple[CliOption, ...]] = (
        CliOption("--mega-batch-mult", "mega_batch_mult", "length_grouped: megabatch size in batches (default 50)",
                  type=int),
        CliOption("--hf-order", "shuffle_order",
                  "length_grouped: keep Hugging Face's unshuffled order (shows the step-length oscillation)",
                  const=False),
    )
    mega_batch_mult: int = HF_MEGA_BATCH_MULT
    """Megabatch size in batches (default 50, Hugging Face's)."""
    batch_size: Optional[int] = None
    """Samples per batch for the megabatch size; null: ``max_tokens // median length`` (at least 1).

    Null takes the rows of a micro-batch of median-length samples, capped by ``max_samples`` (27 on ``chat-902k``
    at 16384 tokens).
    """
    shuffle_order: bool = True
    """Shuffle the micro-batch order each epoch; false keeps Hugging Face's order, longest first per megabatch.

    True: ranks and steps then see unrelated lengths. False: megabatch after megabatch, longest first inside each,
    the order whose step mean length oscillates (large lag-1 ACF), kept so reports can show it.
    """

    def __post_init__(self) -> None:
        check_positive_int("length_grouped mega_batch_mult", self.mega_batch_mult, "use at least 1 (50 is Hugging Face's)")
        if self.batch_size is not None:
            check_positive_int("length_grouped batch_size", self.batch_size, "use None to derive it from the budget")
        if not isinstance(self.shuffle_order, (bool, np.bool_)):
            raise ValueError(f"length_grouped shuffle_order={self.shuffle_order!r} must be true or false")

    def megabatch_size(self, lengths: np.ndarray, budget: Budget) -> int:
        """Samples per megabatch for these (kept) lengths."""
        if self.batch_size is not None:
            batch_size = self.batch_size
        else:
            batch_size = max(1, int(budget.max_tokens // max(float(np.median(lengths)), 1.0)))
            if budget.max_samples is not None:
                batch_size = min(batch_size, budget.max_samples)
        mult = min(self.mega_batch_mult, lengths.size // (4 * batch_size))
        return max(mult, 1) * batch_size

    def micro_batches(self, prepared, budget, seed, epoch, per_step):
        order = generator(seed, epoch, Purpose.SAMPLE_ORDER).permutation(prepared.kept)
        lengths = prepared.lengths[order]
        size = self.megabatch_size(lengths, budget)
        megabatch = np.arange(order.size, dtype=np.int64) // size
        # sort by (megabatch, length descending), stable: ties keep the permutation's order
        order = order[np.lexsort((-lengths, megabatch))]
        # Hugging Face puts the longest sample first: swap the heads of megabatch 0 and of the
        # megabatch holding the longest sample
        heads = np.arange(0, order.size, size)
        longest = heads[int(np.argmax(prepared.lengths[order[heads]]))]
        order[[0, longest]] = order[[longest, 0]]
        group_offsets = np.append(heads, order.size).astype(np.int64)
        offsets = padded_fill(order, prepared.lengths, budget, group_offsets)
        if self.shuffle_order:
            sequence = generator(seed, epoch, Purpose.MICRO_BATCH_ORDER).permutation(offsets.size - 1)
        else:
            sequence = np.arange(offsets.size - 1, dtype=np.int64)
        return MicroBatches(order, offsets, sequence, {"megabatch_size": int(size)})
