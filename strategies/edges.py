"""Bucket edges for the ``bucketed`` strategy: optimal (``dp``), ``quantile`` and ``equal_tokens``.

Edges are the inclusive upper bounds of the buckets, strictly increasing, the last one at least the
longest sample (computed edges end exactly at it): bucket ``b`` holds the lengths in ``(edges[b-1], edges[b]]`` (``edges[-1]`` taken as
0), so ``np.searchsorted(edges, lengths, side="left")`` gives each sample's bucket.

Methods:

- ``"dp"`` — a dynamic program over the length histogram that minimises the expected padded slots
  ``sum(count(v) * upper_edge(bucket of v))``: every sample is modelled as padded to its bucket's
  upper edge, which is what a micro-batch of many rows costs (the maximum of many draws from a
  bucket is close to its edge). Exact: the cost is Monge, so divide-and-conquer optimisation solves
  each of the K layers in O(V log V) over V distinct lengths (8192 lengths x 64 buckets in a few
  milliseconds). Being exact for this objective, it is never worse than any other edges with the
  same number of buckets, quantile and equal-tokens included (:func:`expected_padded_slots`).
- ``"quantile"`` — equal-count percentiles (fairseq's choice).
- ``"equal_tokens"`` — equal total length per bucket (lhotse's choice).

Edges depend only on the histogram, so :func:`bucket_edges` caches them per (histogram, method,
number of buckets): a dataset pays for them once, not every epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from ._kernels import dp_bucket_edges
from .epoch_plan import Budget
from .validate import LengthsError, as_length_array, check_positive_int

EDGE_METHODS = ("dp", "quantile", "equal_tokens")


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
    """Padded slots if every sample were padded to its bucket's upper edge (the DP's objective)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    edges = np.asarray(edges, dtype=np.int64)
    if lengths.size and lengths.max() > edges[-1]:
        raise ValueError(f"edges end at {edges[-1]} but the longest sample is {lengths.max()}")
    return int(edges[np.searchsorted(edges, lengths, side="left")].sum())


def _quantile_edges(values: np.ndarray, weights: np.ndarray, num_buckets: int) -> np.ndarray:
    """Edges at equal shares of ``weights`` (counts: quantile; tokens: equal_tokens)."""
    cumulative = np.cumsum(weights)
    targets = cumulative[-1] * np.arange(1, num_buckets + 1) / num_buckets
    # first value whose cumulative share reaches each target ("inverted CDF" percentiles)
    positions = np.searchsorted(cumulative, targets - 1e-9 * cumulative[-1], side="left")
    positions = np.minimum(positions, values.size - 1)
    return np.unique(values[positions])


@lru_cache(maxsize=64)
def _cached_edges(values_bytes: bytes, counts_bytes: bytes, num_buckets: int, method: str) -> tuple[int, ...]:
    values = np.frombuffer(values_bytes, dtype=np.int64)
    counts = np.frombuffer(counts_bytes, dtype=np.int64)
    if method == "dp":
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
) -> np.ndarray:
    """Upper bucket edges (int64, strictly increasing, last = longest sample).

    Args:
        lengths: sample lengths (validated like any planner input).
        num_buckets: the most buckets to use (fewer when there are fewer distinct lengths).
        method: ``"dp"`` (default), ``"quantile"`` or ``"equal_tokens"``; see the module docstring.
        budget: accepted for a uniform signature; the DP's objective (padded slots) does not depend
            on it, but a sample longer than ``budget.max_tokens`` is rejected here too.
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
    return _edges_from_histogram(values, counts, num_buckets, method)


def _edges_from_histogram(values: np.ndarray, counts: np.ndarray, num_buckets: int, method: str) -> np.ndarray:
    values_bytes = np.ascontiguousarray(values, dtype=np.int64).tobytes()
    counts_bytes = np.ascontiguousarray(counts, dtype=np.int64).tobytes()
    return np.array(_cached_edges(values_bytes, counts_bytes, num_buckets, method), dtype=np.int64)


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
