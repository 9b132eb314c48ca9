"""Bucket edges for the ``bucketed`` strategy: optimal (``dp``), ``quantile`` and ``equal_tokens``.

Edges are the inclusive upper bounds of the buckets, strictly increasing, the last one at least the
longest sample (computed edges end exactly at it): bucket ``b`` holds the lengths in ``(edges[b-1], edges[b]]`` (``edges[-1]`` taken as
0), so ``np.searchsorted(edges, lengths, side="left")`` gives each sample's bucket.

Methods:

- ``"dp"`` with a budget — a dynamic program that minimises the padded slots the bucketed
  strategy's greedy fill is expected to compute at that budget (:func:`expected_budget_slots`).
  A micro-batch of bucket ``[lo, hi]`` is padded to the longest of its rows, and how many rows it
  holds depends on what it drew: the greedy fill keeps adding samples while
  ``rows * running max <= max_tokens``, so in a wide bucket a micro-batch that starts short takes
  many rows and one that meets a long sample few. The model follows that process exactly on
  independent draws from the bucket's length histogram: a micro-batch is still open after n draws
  when all of them are ``<= max_tokens // n`` (the running max never falls), which gives in closed
  form the distribution of its rows, its expected padded slots and its expected real tokens; the
  bucket costs its tokens times their ratio (renewal-reward), and its samples have
  ``E[rows (rows - 1)] / E[rows]`` micro-batch partners each (the formulas are in
  ``strategies.kernels``; a brute-force enumeration of the draws checks them in the tests). The
  rows are modelled draw by draw, not as one row count per bucket, because a wide bucket (which a
  ``max_recurrence`` bound forces on small datasets) mixes micro-batches of very different row
  counts: one row count calls it unpadded and lets the DP spend edges on one-sample buckets. The
  model ignores that the sample which overflows a micro-batch opens the next one (a bias towards
  long first rows) and each bucket's last, partial micro-batch; how close it comes to real plans,
  and what it gains over ``dp_upper``, is in docs/design/bucket-edges.md.
  Samples longer than half the budget get one row each, no padding, so they cost their own length
  in any bucket.
  The DP is exact over a set of candidate edges: every distinct length when there are at most
  ``2 * DP_CANDIDATES_PER_GRID`` of them, otherwise the union of 256 equal-count and 256
  equal-token quantiles plus the ``quantile``, ``equal_tokens`` and ``dp_upper`` edges for the same
  number of buckets. So it is never worse, under its objective, than those three; the grid costs
  little (a finer one barely lowers the objective: docs/design/bucket-edges.md) and bounds the O(K * C^2) DP
  and its O(C^2) bucket costs (:func:`strategies.kernels.budget_bucket_costs`) by the grid, not by
  the number of distinct lengths; they are paid once per dataset. It may use fewer than
  ``num_buckets`` buckets when more would not lower the cost (e.g. lengths above half the budget).
  With ``max_recurrence`` (the ``bucketed`` option, default 0.1) a bucket whose modelled
  composition recurrence (the chance that a pair of one epoch shares a micro-batch again in the next:
  ``partners / (samples - 1)``, over the samples at most half the budget long when a bucket straddles
  it) exceeds the bound costs ``inf`` (:func:`strategies.kernels.bucket_recurrence`; a one-sample
  bucket that could share a micro-batch is alone in the same one every epoch and counts as 1): a minimum
  population per bucket, inside the DP, so the optimum is taken over the feasible splits only (the
  number of buckets then follows the dataset). With no feasible split the DP returns one bucket.
- ``"dp"`` without a budget, or ``"dp_upper"`` — the budget-free objective
  ``sum(count(v) * upper_edge(bucket of v))`` (:func:`expected_padded_slots`): every sample padded
  to its bucket's upper edge, the limit of micro-batches with very many rows. Exact: the cost is
  Monge, so divide-and-conquer optimisation solves each of the K layers in O(V log V) over V
  distinct lengths; never worse under that
  objective than any other edges with the same number of buckets, and always uses
  ``min(num_buckets, V)`` buckets. Kept by name so earlier results stay reproducible.
- ``"quantile"`` — equal-count percentiles (fairseq's choice).
- ``"equal_tokens"`` — equal total length per bucket (lhotse's choice).

Edges depend only on the histogram (and the budget, for ``dp``), so :func:`bucket_edges` caches
them per (histogram, method, number of buckets, budget): a dataset pays for them once, not every
epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from .kernels import (
    bucket_fill_model,
    bucket_recurrence,
    pairable_count,
    budget_bucket_costs,
    dp_bucket_edges,
    dp_over_bucket_costs,
)
from .epoch_plan import Budget
from .validate import LengthsError, as_length_array, check_positive_int

EDGE_METHODS = ("dp", "quantile", "equal_tokens", "dp_upper")
#: size of each of the two quantile grids of candidate edges of the budget-aware DP
DP_CANDIDATES_PER_GRID = 256


def length_histogram(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct lengths (ascending, int64) and their counts (int64)."""
    lengths = np.asarray(lengths)
    if lengths.size and lengths.min() >= 0 and lengths.max() <= 4 * lengths.size + 65536:
        # bincount is O(n + max) and much faster than np.unique's sort for token lengths
        counts = np.bincount(lengths)
        values = np.flatnonzero(counts)
        return values.astype(np.int64), counts[values].astype(np.int64)
    values, counts = np.unique(lengths, return_counts=True)
    return values.astype(np.int64), counts.astype(np.int64)


def expected_padded_slots(lengths: np.ndarray, edges: Sequence[int] | np.ndarray) -> int:
    """Padded slots if every sample were padded to its bucket's upper edge (``dp_upper``'s objective)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    edges = np.asarray(edges, dtype=np.int64)
    if lengths.size and lengths.max() > edges[-1]:
        raise ValueError(f"edges end at {edges[-1]} but the longest sample is {lengths.max()}")
    return int(edges[np.searchsorted(edges, lengths, side="left")].sum())


def budget_max_rows(budget: Budget) -> int:
    """Most rows of a micro-batch: ``max_samples``, or ``max_tokens`` (every length is >= 1)."""
    return budget.max_tokens if budget.max_samples is None else min(budget.max_samples, budget.max_tokens)


def expected_budget_slots(lengths: np.ndarray, edges: Sequence[int] | np.ndarray, budget: Budget) -> float:
    """Padded slots the budget-aware DP assigns to these edges (its objective; module docstring).

    Sum over buckets of the bucket's tokens x E[padded slots] / E[real tokens] of one of its
    micro-batches under the greedy fill (module docstring).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    edges = np.asarray(edges, dtype=np.int64)
    if lengths.size and lengths.max() > edges[-1]:
        raise ValueError(f"edges end at {edges[-1]} but the longest sample is {lengths.max()}")
    values, counts = length_histogram(lengths)
    prefix = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    bucket_ends = np.searchsorted(values, edges, side="right") - 1  # largest value <= each edge
    total = 0.0
    start = 0
    for end in bucket_ends:
        if end < start:  # an empty bucket
            continue
        slots, _ = bucket_fill_model(values, prefix, start, int(end), budget.max_tokens, budget_max_rows(budget))
        total += slots
        start = int(end) + 1
    return total


def modelled_bucket_recurrence(lengths: np.ndarray, edges: Sequence[int] | np.ndarray, budget: Budget) -> np.ndarray:
    """Modelled composition recurrence of every non-empty bucket (what ``max_recurrence`` bounds).

    ``samples x partners / (pairable x (pairable - 1))`` (at most 1; ``partners / (samples - 1)`` when
    every sample is at most half the budget long) with ``partners`` the modelled micro-batch partners
    of a sample of the bucket and ``pairable`` its samples that can share a micro-batch
    (:func:`strategies.kernels.bucket_recurrence`), in bucket order.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    edges = np.asarray(edges, dtype=np.int64)
    values, counts = length_histogram(lengths)
    prefix = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    bucket_ends = np.searchsorted(values, edges, side="right") - 1
    result = []
    start = 0
    for end in bucket_ends:
        if end < start:
            continue
        _, partners = bucket_fill_model(values, prefix, start, int(end), budget.max_tokens, budget_max_rows(budget))
        pairable = pairable_count(values, prefix, start, int(end), budget.max_tokens, budget_max_rows(budget))
        result.append(bucket_recurrence(partners, int(prefix[end + 1] - prefix[start]), pairable))
        start = int(end) + 1
    return np.asarray(result, dtype=np.float64)


def dp_candidates(values: np.ndarray, counts: np.ndarray, num_buckets: int) -> np.ndarray:
    """Indices into ``values`` where the budget-aware DP may end a bucket (module docstring)."""
    if values.size <= 2 * DP_CANDIDATES_PER_GRID:
        return np.arange(values.size, dtype=np.int64)
    upper_positions, _ = dp_bucket_edges(values, counts, num_buckets)
    edges = np.concatenate(
        [
            _quantile_edges(values, counts, DP_CANDIDATES_PER_GRID),
            _quantile_edges(values, counts * values, DP_CANDIDATES_PER_GRID),
            _quantile_edges(values, counts, num_buckets),
            _quantile_edges(values, counts * values, num_buckets),
            values[upper_positions],
            values[-1:],
        ]
    )
    return np.searchsorted(values, np.unique(edges)).astype(np.int64)


def _budget_dp_edges(
    values: np.ndarray,
    counts: np.ndarray,
    num_buckets: int,
    max_tokens: int,
    max_rows: int,
    max_recurrence: float | None = None,
) -> np.ndarray:
    candidates = dp_candidates(values, counts, num_buckets)
    bound = 1.0 if max_recurrence is None else float(max_recurrence)
    costs = budget_bucket_costs(values, counts, candidates, max_tokens, max_rows, bound)
    ends, _ = dp_over_bucket_costs(costs, num_buckets)
    return values[candidates[ends]]


def _quantile_edges(values: np.ndarray, weights: np.ndarray, num_buckets: int) -> np.ndarray:
    """Edges at equal shares of ``weights`` (counts: quantile; tokens: equal_tokens)."""
    cumulative = np.cumsum(weights)
    targets = cumulative[-1] * np.arange(1, num_buckets + 1) / num_buckets
    # first value whose cumulative share reaches each target ("inverted CDF" percentiles)
    positions = np.searchsorted(cumulative, targets - 1e-9 * cumulative[-1], side="left")
    positions = np.minimum(positions, values.size - 1)
    return np.unique(values[positions])


@lru_cache(maxsize=64)
def cached_edges(
    values_bytes: bytes,
    counts_bytes: bytes,
    num_buckets: int,
    method: str,
    max_tokens: int | None,
    max_rows: int | None,
    max_recurrence: float | None = None,
) -> tuple[int, ...]:
    values = np.frombuffer(values_bytes, dtype=np.int64)
    counts = np.frombuffer(counts_bytes, dtype=np.int64)
    if method == "dp" and max_tokens is not None:
        edges = _budget_dp_edges(values, counts, num_buckets, max_tokens, max_rows, max_recurrence)
    elif method in ("dp", "dp_upper"):
        edge_positions, _ = dp_bucket_edges(values, counts, num_buckets)
        edges = values[edge_positions]
    elif method == "quantile":
        edges = _quantile_edges(values, counts, num_buckets)
    else:  # equal_tokens
        edges = _quantile_edges(values, counts * values, num_buckets)
    return tuple(int(e) for e in edges)


def bucket_edges(
    lengths: Any,
    num_buckets: int,
    method: str = "dp",
    budget: Budget | None = None,
    max_recurrence: float | None = None,
) -> np.ndarray:
    """Upper bucket edges (int64, strictly increasing, last = longest sample).

    Args:
        lengths: sample lengths (validated like any planner input).
        num_buckets: the most buckets to use (fewer when there are fewer distinct lengths).
        method: ``"dp"`` (default), ``"quantile"``, ``"equal_tokens"`` or ``"dp_upper"``; see the
            module docstring.
        budget: the micro-batch budget the edges are for. ``"dp"`` minimises the padded slots
            expected at this budget; without one it minimises ``sum(upper edge)`` (as
            ``"dp_upper"`` always does). Other methods ignore it. A sample longer than
            ``budget.max_tokens`` is rejected.
        max_recurrence: with ``"dp"`` and a budget, the largest modelled composition recurrence
            of any bucket (:func:`modelled_bucket_recurrence`):
            a minimum bucket population enforced inside the DP. None (default here) or >= 1: no
            bound. Other methods ignore it.
    """
    num_buckets = check_positive_int("num_buckets", num_buckets, "use at least one bucket")
    if method not in EDGE_METHODS:
        raise ValueError(f"edges method {method!r} is unknown; use one of {list(EDGE_METHODS)} or a list of ints")
    lengths = as_length_array(lengths)
    if budget is not None and lengths.max() > budget.max_tokens:
        index = int(np.argmax(lengths))
        raise LengthsError(
            f"lengths[{index}] = {lengths[index]} exceeds Budget.max_tokens={budget.max_tokens}; "
            "apply the oversize policy (truncate or drop) before computing edges"
        )
    values, counts = length_histogram(lengths)
    return _edges_from_histogram(values, counts, num_buckets, method, budget, max_recurrence)


def _edges_from_histogram(
    values: np.ndarray,
    counts: np.ndarray,
    num_buckets: int,
    method: str,
    budget: Budget | None = None,
    max_recurrence: float | None = None,
) -> np.ndarray:
    values_bytes = np.ascontiguousarray(values, dtype=np.int64).tobytes()
    counts_bytes = np.ascontiguousarray(counts, dtype=np.int64).tobytes()
    # only the budget-aware dp depends on the budget; other methods share one cache entry
    uses_budget = method == "dp" and budget is not None
    max_tokens = budget.max_tokens if uses_budget else None
    max_rows = budget_max_rows(budget) if uses_budget else None
    bound = None if not uses_budget or max_recurrence is None or max_recurrence >= 1 else float(max_recurrence)
    edges = cached_edges(values_bytes, counts_bytes, num_buckets, method, max_tokens, max_rows, bound)
    return np.array(edges, dtype=np.int64)


def explicit_edges(edges: Sequence[Any], longest: int) -> np.ndarray:
    """Validate user edges (positive, strictly increasing integers) and close them at ``longest``.

    Samples longer than the last given edge go to one extra final bucket ending at ``longest``.
    """
    values = list(edges)
    if not values:
        raise ValueError("edges is an empty list; give increasing integer upper edges, or 'dp'/'quantile'")
    for position, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"edges[{position}] = {value!r} must be a positive integer (an upper length bound)")
        if position and value <= values[position - 1]:
            raise ValueError(
                f"edges[{position}] = {value} is not greater than edges[{position - 1}] = {values[position - 1]}; "
                "edges must be strictly increasing"
            )
    array = np.asarray(values, dtype=np.int64)
    if array[-1] < longest:
        array = np.append(array, longest)
    return array


def parse_edges(text: str) -> str | list[int]:
    """Edges from text: a method name or a comma list of integer lengths (``batchlab-plan --edges``)."""
    text = text.strip()
    if text in EDGE_METHODS:
        return text
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"{text!r} is neither one of {', '.join(EDGE_METHODS)} nor a comma list of integer lengths"
        ) from None
    if not values:
        raise ValueError(f"{text!r} lists no lengths")
    return values
