"""Compiled sequential loops of the planners: greedy padded fill, first/best-fit packing, DP edges,
the cuts of equal-token optimizer steps.

These are hand-written (and compiled with numba, ``cache=True``) because each is a sequential
decision procedure with no vectorised numpy form: whether sample i opens a new micro-batch depends on
every decision before it (greedy fill), which row a sample lands in depends on the fill level of
every row (first-fit / best-fit), each DP layer depends on the previous one, and where a step
closes depends on where the one before it closed (step cuts). A Python loop over
902K samples takes about a second; compiled, these take milliseconds.

All kernels take and return int64 arrays and never allocate per sample beyond O(n) arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit


#: largest row capacity best-fit accepts (its index over free-space values costs ~16 B per token)
BEST_FIT_MAX_CAPACITY = 1 << 22


@njit(cache=True)
def greedy_fill_padded(
    lengths_in_order: np.ndarray, group_offsets: np.ndarray, max_tokens: int, max_samples: int
) -> np.ndarray:
    """Cut samples (in the given order) into padded micro-batches; return micro-batch offsets.

    A micro-batch grows while ``rows * max_len <= max_tokens`` and ``rows <= max_samples``.
    ``group_offsets`` splits the order into groups (buckets) that never share a micro-batch; pass
    ``[0, n]`` for one group. Every sample must be ``<= max_tokens``.
    """
    n = lengths_in_order.shape[0]
    offsets = np.empty(n + 1, dtype=np.int64)
    offsets[0] = 0
    count = 0
    for g in range(group_offsets.shape[0] - 1):
        start = group_offsets[g]
        stop = group_offsets[g + 1]
        if start == stop:
            continue
        rows = 0
        current_max = 0
        for i in range(start, stop):
            length = lengths_in_order[i]
            new_max = current_max if current_max > length else length
            if rows > 0 and ((rows + 1) * new_max > max_tokens or rows + 1 > max_samples):
                count += 1
                offsets[count] = i
                rows = 0
                new_max = length
            rows += 1
            current_max = new_max
        count += 1
        offsets[count] = stop
    return offsets[: count + 1].copy()


@njit(cache=True)
def token_step_cuts(tokens_in_order: np.ndarray, group_offsets: np.ndarray, step_tokens: int) -> np.ndarray:
    """Cut micro-batches (in the given order) into optimizer steps of about ``step_tokens`` tokens.

    Returns step offsets into the order. A step grows while its tokens stay ``<= step_tokens``. At
    the micro-batch that would take it past ``step_tokens`` it closes either before that micro-batch
    or after it, whichever brings the running total of the steps closed so far closer to their number
    times ``step_tokens`` (a tie closes before). A micro-batch of more than ``step_tokens`` tokens is a
    step alone (the step before it closes early) and the running total restarts after it. The last
    step of a group holds what is left. ``group_offsets`` splits the order into groups that never
    share a step, each with its own running total; pass ``[0, n]`` for one group. Every token count
    must be >= 1.
    """
    n = tokens_in_order.shape[0]
    cuts = np.empty(n + 1, dtype=np.int64)
    cuts[0] = 0
    count = 0
    for g in range(group_offsets.shape[0] - 1):
        start = group_offsets[g]
        stop = group_offsets[g + 1]
        if start == stop:
            continue
        total = 0  # tokens of the open step
        error = 0  # tokens of the closed steps minus their number times step_tokens
        for i in range(start, stop):
            tokens = tokens_in_order[i]
            if total > 0 and (total > step_tokens or tokens > step_tokens):
                count += 1
                cuts[count] = i  # a micro-batch over step_tokens is a step alone
                error = 0
                total = tokens
            elif total > 0 and total + tokens > step_tokens:
                under = error + total - step_tokens
                over = under + tokens
                count += 1
                if abs(under) <= abs(over):
                    cuts[count] = i  # close before i; i opens the next step
                    error = under
                    total = tokens
                else:
                    cuts[count] = i + 1  # close after i
                    error = over
                    total = 0
            else:
                total += tokens
        if total > 0:
            count += 1
            cuts[count] = stop
    return cuts[: count + 1].copy()


@njit(cache=True)
def _group_by_bin(bin_of: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Counting sort of positions by bin (stable): returns (positions grouped by bin, bin offsets)."""
    n = bin_of.shape[0]
    offsets = np.zeros(num_bins + 1, dtype=np.int64)
    for i in range(n):
        offsets[bin_of[i] + 1] += 1
    for b in range(num_bins):
        offsets[b + 1] += offsets[b]
    cursor = offsets[:-1].copy()
    grouped = np.empty(n, dtype=np.int64)
    for i in range(n):
        b = bin_of[i]
        grouped[cursor[b]] = i
        cursor[b] += 1
    return grouped, offsets


@njit(cache=True)
def first_fit_packed(
    lengths_in_order: np.ndarray, capacity: int, max_samples: int, max_bins: int
) -> tuple[np.ndarray, np.ndarray]:
    """First-fit of whole samples (in the given order) into rows of ``capacity`` tokens.

    Each sample goes to the lowest-numbered row with room (and fewer than ``max_samples``
    samples); a segment tree over rows holding the largest free space of each subtree finds that
    row in O(log rows). ``max_bins`` must bound the number of rows used. Returns the positions
    grouped by row (in arrival order inside a row) and the row offsets.
    """
    n = lengths_in_order.shape[0]
    size = 1
    while size < max_bins:
        size *= 2
    tree = np.empty(2 * size, dtype=np.int64)
    tree[size:] = capacity  # every row starts empty; unused rows are simply never reached
    for node in range(size - 1, 0, -1):
        tree[node] = capacity
    samples_in_row = np.zeros(size, dtype=np.int64)
    bin_of = np.empty(n, dtype=np.int64)
    used = 0
    for i in range(n):
        length = lengths_in_order[i]
        if tree[1] < length:
            raise ValueError("first_fit_packed: max_bins is smaller than the rows needed")
        node = 1
        while node < size:
            if tree[2 * node] >= length:
                node = 2 * node
            else:
                node = 2 * node + 1
        row = node - size
        bin_of[i] = row
        if row + 1 > used:
            used = row + 1
        samples_in_row[row] += 1
        if samples_in_row[row] >= max_samples:
            tree[node] = -1  # full by count
        else:
            tree[node] -= length
        node //= 2
        while node >= 1:
            left = tree[2 * node]
            right = tree[2 * node + 1]
            tree[node] = left if left > right else right
            node //= 2
    return _group_by_bin(bin_of, used)


@njit(cache=True)
def _first_nonempty_at_or_after(tree: np.ndarray, size: int, start: int) -> int:
    """Smallest leaf index >= start whose count is > 0 in a count segment tree, or -1."""
    node = start + size
    if tree[node] > 0:
        return start
    while node > 1:
        if node % 2 == 0 and tree[node + 1] > 0:
            node += 1
            while node < size:
                node = 2 * node if tree[2 * node] > 0 else 2 * node + 1
            return node - size
        node //= 2
    return -1


@njit(cache=True)
def _tree_add(tree: np.ndarray, size: int, leaf: int, delta: int) -> None:
    node = leaf + size
    while node >= 1:
        tree[node] += delta
        node //= 2


@njit(cache=True)
def best_fit_packed(
    lengths_in_order: np.ndarray, capacity: int, max_samples: int, max_bins: int
) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit of whole samples (in the given order) into rows of ``capacity`` tokens.

    Each sample goes to the open row with the least free space that still holds it. Rows are kept
    in one stack per free-space value; a count segment tree over free-space values (0..capacity)
    finds the smallest value >= the sample's length in O(log capacity). Memory grows with the
    capacity (about 16 bytes per token of capacity), hence ``BEST_FIT_MAX_CAPACITY``. Returns the positions
    grouped by row and the row offsets, like :func:`first_fit_packed`.
    """
    n = lengths_in_order.shape[0]
    size = 1
    while size < capacity + 1:
        size *= 2
    tree = np.zeros(2 * size, dtype=np.int32)  # counts of rows per free-space value
    head = np.full(capacity + 1, -1, dtype=np.int64)  # top row of the stack for each free space
    next_row = np.empty(max_bins, dtype=np.int64)
    free = np.empty(max_bins, dtype=np.int64)
    samples_in_row = np.zeros(max_bins, dtype=np.int64)
    bin_of = np.empty(n, dtype=np.int64)
    used = 0
    for i in range(n):
        length = lengths_in_order[i]
        space = _first_nonempty_at_or_after(tree, size, length)
        if space < 0:
            if used >= max_bins:
                raise ValueError("best_fit_packed: max_bins is smaller than the rows needed")
            row = used
            used += 1
            free[row] = capacity
        else:
            row = head[space]
            head[space] = next_row[row]
            _tree_add(tree, size, space, -1)
        bin_of[i] = row
        free[row] -= length
        samples_in_row[row] += 1
        if free[row] > 0 and samples_in_row[row] < max_samples:
            next_row[row] = head[free[row]]
            head[free[row]] = row
            _tree_add(tree, size, free[row], 1)
    return _group_by_bin(bin_of, used)


@njit(cache=True)
def _dp_layer(
    previous: np.ndarray,
    current: np.ndarray,
    choice: np.ndarray,
    values: np.ndarray,
    cumulative: np.ndarray,
    lo: int,
    hi: int,
    opt_lo: int,
    opt_hi: int,
) -> None:
    """Divide-and-conquer optimisation of one DP layer over ends ``lo..hi`` (iterative stack).

    ``current[j] = min_{i < j} previous[i] + values[j - 1] * (cumulative[j] - cumulative[i])``.
    The cost is Monge (``(v_d - v_c)(N_b - N_a) >= 0``), so the best split is monotone in ``j``
    and each level of the recursion scans O(V) candidates: O(V log V) per layer, exact in int64.
    """
    stack = np.empty((64, 4), dtype=np.int64)
    top = 0
    stack[0, 0] = lo
    stack[0, 1] = hi
    stack[0, 2] = opt_lo
    stack[0, 3] = opt_hi
    top = 1
    big = np.iinfo(np.int64).max
    while top > 0:
        top -= 1
        a = stack[top, 0]
        b = stack[top, 1]
        oa = stack[top, 2]
        ob = stack[top, 3]
        if a > b:
            continue
        mid = (a + b) // 2
        best = big
        best_i = oa
        last = ob if ob < mid - 1 else mid - 1
        upper = values[mid - 1]
        for i in range(oa, last + 1):
            if previous[i] == big:
                continue
            cost = previous[i] + upper * (cumulative[mid] - cumulative[i])
            if cost < best:
                best = cost
                best_i = i
        current[mid] = best
        choice[mid] = best_i
        stack[top, 0] = a
        stack[top, 1] = mid - 1
        stack[top, 2] = oa
        stack[top, 3] = best_i
        top += 1
        stack[top, 0] = mid + 1
        stack[top, 1] = b
        stack[top, 2] = best_i
        stack[top, 3] = ob
        top += 1


@njit(cache=True)
def dp_bucket_edges(values: np.ndarray, counts: np.ndarray, num_buckets: int) -> tuple[np.ndarray, int]:
    """Upper edges (indices into ``values``) minimising ``sum(count * bucket upper edge)``.

    ``values`` are the distinct lengths (ascending), ``counts`` their multiplicities. Uses exactly
    ``min(num_buckets, len(values))`` buckets (splitting a bucket never costs more). Returns the
    index of each bucket's largest value and the optimal cost.
    """
    num_values = values.shape[0]
    buckets = num_buckets if num_buckets < num_values else num_values
    cumulative = np.zeros(num_values + 1, dtype=np.int64)
    for j in range(num_values):
        cumulative[j + 1] = cumulative[j] + counts[j]
    big = np.iinfo(np.int64).max
    choice = np.zeros((buckets + 1, num_values + 1), dtype=np.int64)
    previous = np.full(num_values + 1, big, dtype=np.int64)
    previous[0] = 0
    current = np.full(num_values + 1, big, dtype=np.int64)
    for k in range(1, buckets + 1):
        current[:] = big
        # with k buckets the end j ranges over k..num_values, the previous end over k-1..j-1
        _dp_layer(previous, current, choice[k], values, cumulative, k, num_values, k - 1, num_values - 1)
        previous, current = current, previous
    edges = np.empty(buckets, dtype=np.int64)
    j = num_values
    for k in range(buckets, 0, -1):
        edges[k - 1] = j - 1
        j = choice[k, j]
    return edges, previous[num_values]


# ---------------------------------------------------------------------------------------------------
# Budget-aware DP edges (``bucket_edges(..., method="dp", budget=...)``).
#
# Hand-written and compiled for the same reason as the kernels above: the cost of every candidate
# bucket (a few hundred thousand of them on a 902K-sample histogram) is a sum whose terms depend on
# the bucket's own count and row number, and the DP over those costs is a sequential recurrence; in
# numpy the bucket costs alone take tens of seconds, compiled a few tenths of a second.
#
# Model of one bucket holding the distinct lengths ``values[start..end]`` (N samples, F its CDF),
# filled greedily in random order under ``max_tokens`` T and ``max_rows`` S (see ``strategies.edges``
# for how well it matches real plans): a micro-batch is cut from a stream of independent draws from
# the bucket's histogram; it keeps its n-th draw while ``n * (running max) <= T`` and ``n <= S``. The
# running max M_n never falls, so the micro-batch is still open after n draws exactly when all n are
# <= t_n = T // n: P(open at n) = F(t_n)**n, and it closes at n when M_n <= t_n and M_{n+1} > t_{n+1}.
# With G_n(t) = E[M_n ; M_n <= t] = v_j F_j**n - sum_{k<j} F_k**n (values[k+1] - values[k])
# (v_j the largest length <= t, summed by parts), per micro-batch:
#     E[rows]           = sum_n F(t_n)**n
#     E[slots]          = sum_n n * (G_n(t_n) - F(t_{n+1}) * G_n(t_{n+1}))    (the last term at n = S: n * G_S(t_S))
#     E[accepted tokens] = sum_n F(t_n)**(n-1) * E[x ; x <= t_n]
#     E[rows (rows-1)]  = 2 * sum_n (n - 1) * F(t_n)**n
# and the bucket costs its tokens x E[slots] / E[accepted tokens] padded slots (renewal-reward), its
# samples have E[rows (rows-1)] / E[rows] micro-batch partners each. For n + 1 <= T // hi every term
# but the rows' is zero, so the sums start at n = T // hi and stop once F(t_n)**n < OPEN_TOLERANCE.

#: relative accuracy of the truncated tail sums (G_n is exact to this fraction of the upper edge)
TAIL_TOLERANCE = 1e-12
#: the sums over row counts stop once a micro-batch is this unlikely to be still open
OPEN_TOLERANCE = 1e-12
#: row counts up to this are served from running power sums in ``budget_bucket_costs``
POWER_SUM_ROWS = 32


@njit(cache=True)
def _sum_below(
    values: np.ndarray, prefix: np.ndarray, start: int, j: int, n: int, inverse: float,
    table: np.ndarray, powers: int, share: float,
) -> float:
    """``sum_{k=start}^{j-1} F_k**n * (values[k+1] - values[k])``, ``F_k`` = count up to values[k] * inverse.

    From the running power sums ``table`` when they hold it (``table[n, i]`` sums ``x_k**n * gap_k`` for
    the first i lengths from the start, ``x_k = F_k * share``); otherwise summed from the top down,
    stopping once everything below is bounded by ``TAIL_TOLERANCE * values[j]``.
    """
    if n <= powers:
        scale = share**n
        if scale > 1e-250:
            return table[n, j - start] / scale
    tolerance = TAIL_TOLERANCE * values[j]
    total = 0.0
    for k in range(j - 1, start - 1, -1):
        power = ((prefix[k + 1] - prefix[start]) * inverse) ** n
        total += power * (values[k + 1] - values[k])
        if power * (values[k] - values[start]) <= tolerance:
            break
    return total


@njit(cache=True)
def _last_at_most(values: np.ndarray, start: int, end: int, limit: int) -> int:
    """The largest index k in ``start..end`` with ``values[k] <= limit`` (``start - 1`` if none)."""
    low = start
    high = end + 1
    while low < high:
        middle = (low + high) // 2
        if values[middle] <= limit:
            low = middle + 1
        else:
            high = middle
    return low - 1


@njit(cache=True)
def _fill_model(
    values: np.ndarray, prefix: np.ndarray, tokens: np.ndarray, start: int, end: int, max_tokens: int,
    max_rows: int, table: np.ndarray, powers: int, share: float,
) -> tuple[float, float]:
    """``(padded slots, partners per sample)`` of the bucket ``values[start..end]`` (model above)."""
    count = prefix[end + 1] - prefix[start]
    inverse = 1.0 / count
    bucket_tokens = float(tokens[end + 1] - tokens[start])
    hi = values[end]
    first = max_tokens // hi
    if first < 1:
        first = 1
    if first > max_rows:
        first = max_rows
    rows = first - 1.0  # every micro-batch takes its first `first - 1` draws
    pairs = (first - 1.0) * (first - 2.0)
    accepted = (first - 1.0) * bucket_tokens * inverse
    slots = 0.0
    j = end
    for n in range(first, max_rows + 1):
        j = _last_at_most(values, start, j, max_tokens // n)
        if j < start:
            break
        cdf = (prefix[j + 1] - prefix[start]) * inverse
        still_open = cdf**n
        if still_open < OPEN_TOLERANCE:
            break
        rows += still_open
        pairs += 2.0 * (n - 1) * still_open
        accepted += cdf ** (n - 1) * (tokens[j + 1] - tokens[start]) * inverse
        capped = values[j] * still_open - _sum_below(values, prefix, start, j, n, inverse, table, powers, share)
        below = start - 1  # the largest length that a further row would still fit
        if n < max_rows:
            below = _last_at_most(values, start, j, max_tokens // (n + 1))
        if below < start:
            slots += n * capped
        else:
            cdf_below = (prefix[below + 1] - prefix[start]) * inverse
            kept = values[below] * cdf_below**n - _sum_below(values, prefix, start, below, n, inverse, table, powers, share)
            slots += n * (capped - cdf_below * kept)
    return bucket_tokens * slots / accepted, pairs / rows


@njit(cache=True)
def bucket_fill_model(
    values: np.ndarray, prefix: np.ndarray, start: int, end: int, max_tokens: int, max_rows: int
) -> tuple[float, float]:
    """``(modelled padded slots, micro-batch partners per sample)`` of the bucket ``values[start..end]``.

    ``prefix`` is the running count (``prefix[0] = 0``, ``prefix[j + 1] = counts[:j + 1].sum()``).
    """
    tokens = np.zeros(values.shape[0] + 1, dtype=np.int64)
    for k in range(start, end + 1):
        tokens[k + 1] = tokens[k] + values[k] * (prefix[k + 1] - prefix[k])
    return _fill_model(values, prefix, tokens, start, end, max_tokens, max_rows, np.zeros((1, 1)), 0, 1.0)


@njit(cache=True)
def bucket_recurrence(partners: float, count: int, pairable: int) -> float:
    """Expected composition recurrence of a bucket of ``count`` samples with ``partners`` micro-batch partners each.

    Only the bucket's ``pairable`` samples (at most half the budget long) ever share a micro-batch, and
    they share with each other only. Shuffled anew each epoch, the bucket's expected pairs,
    ``count * partners / 2``, fall on any of the ``pairable * (pairable - 1) / 2`` possible pairs alike,
    so a pair of this epoch is a pair again with probability
    ``count * partners / (pairable * (pairable - 1))`` (at most 1); when every sample is pairable this is
    ``partners / (count - 1)``. Spreading the pairs over all ``count`` samples instead undercounts a
    bucket that straddles half the budget: real plans (tests) show it. A bucket whose samples never
    share a micro-batch (each longer than half the budget) has none (0.0); a bucket of one sample that
    could share, or one pairable sample among samples it cannot share with, is alone in the same
    micro-batch every epoch (1.0), so a bound below 1 rules it out.
    """
    if partners <= 0.0:
        return 0.0
    if count <= 1 or pairable <= 1:
        return 1.0
    recurrence = partners * count / (pairable * (pairable - 1.0))
    return recurrence if recurrence < 1.0 else 1.0


@njit(cache=True)
def pairable_count(values: np.ndarray, prefix: np.ndarray, start: int, end: int, max_tokens: int, max_rows: int) -> int:
    """Samples of the bucket ``values[start..end]`` short enough to share a micro-batch (2 x length <= budget)."""
    if max_rows < 2:
        return 0
    last = _last_at_most(values, start, end, max_tokens // 2)
    return prefix[last + 1] - prefix[start] if last >= start else 0


@njit(cache=True)
def budget_bucket_costs(
    values: np.ndarray,
    counts: np.ndarray,
    candidates: np.ndarray,
    max_tokens: int,
    max_rows: int,
    max_recurrence: float = 1.0,
) -> np.ndarray:
    """Modelled padded slots of every bucket between candidate edges.

    ``candidates`` are ascending indices into ``values`` (the last one ``len(values) - 1``);
    ``cost[a, b]`` (``a <= b``) is the cost of the bucket ``values[s_a .. candidates[b]]`` with
    ``s_0 = 0`` and ``s_a = candidates[a - 1] + 1``; entries with ``a > b`` are ``inf``.

    Same numbers as :func:`bucket_fill_model`, but for each start the sums
    ``sum_k x_k**m * gap_k`` (``x_k`` = count from the start up to ``values[k]``, scaled by the
    count above the start) are accumulated for ``m <= POWER_SUM_ROWS`` in one upward sweep, so a
    term with few rows — in a wide bucket, whose tail sum would scan thousands of lengths — costs
    O(1). Terms with more rows use the truncated scan, which stops after a few lengths.

    ``max_recurrence < 1`` makes a bucket whose modelled recurrence
    :func:`bucket_recurrence` exceeds it infeasible (cost ``inf``): the minimum bucket
    population of the ``bucketed`` strategy's ``max_recurrence`` option.
    """
    num_values = values.shape[0]
    num_candidates = candidates.shape[0]
    prefix = np.zeros(num_values + 1, dtype=np.int64)
    tokens = np.zeros(num_values + 1, dtype=np.int64)
    for j in range(num_values):
        prefix[j + 1] = prefix[j] + counts[j]
        tokens[j + 1] = tokens[j] + values[j] * counts[j]
    cost = np.full((num_candidates, num_candidates), np.inf)
    table = np.zeros((POWER_SUM_ROWS + 1, num_values + 1))
    for a in range(num_candidates):
        start = 0 if a == 0 else candidates[a - 1] + 1
        above = float(prefix[num_values] - prefix[start])
        # a micro-batch never holds more than max_tokens // (shortest length of the bucket) rows
        most_rows = max_tokens // values[start]
        if most_rows > max_rows:
            most_rows = max_rows
        powers = most_rows if most_rows < POWER_SUM_ROWS else POWER_SUM_ROWS
        for k in range(start, num_values - 1):
            x = (prefix[k + 1] - prefix[start]) / above
            term = x * (values[k + 1] - values[k])
            i = k - start
            for m in range(1, powers + 1):
                table[m, i + 1] = table[m, i] + term
                term *= x
        for b in range(a, num_candidates):
            end = candidates[b]
            count = prefix[end + 1] - prefix[start]
            slots, partners = _fill_model(values, prefix, tokens, start, end, max_tokens, max_rows, table, powers,
                                          count / above)
            if max_recurrence < 1.0 and bucket_recurrence(
                    partners, count, pairable_count(values, prefix, start, end, max_tokens, max_rows)) > max_recurrence:
                continue
            cost[a, b] = slots
    return cost


@njit(cache=True)
def dp_over_bucket_costs(cost: np.ndarray, num_buckets: int) -> tuple[np.ndarray, float]:
    """Cheapest split of the candidates into at most ``num_buckets`` buckets.

    ``cost`` is :func:`budget_bucket_costs`' matrix. O(num_buckets * C^2), exact for any costs (no
    Monge property is assumed: the modelled cost has none). Among splits within a relative 1e-12 of
    the cheapest, the one with the fewest buckets wins (fewer buckets mix more lengths). Returns the
    candidate index that ends each bucket and the total cost.
    """
    num_candidates = cost.shape[0]
    buckets = num_buckets if num_buckets < num_candidates else num_candidates
    best = np.full((buckets + 1, num_candidates), np.inf)
    choice = np.zeros((buckets + 1, num_candidates), dtype=np.int64)
    for b in range(num_candidates):
        best[1, b] = cost[0, b]
    for k in range(2, buckets + 1):
        for b in range(k - 1, num_candidates):
            lowest = np.inf
            lowest_a = -1
            for a in range(k - 1, b + 1):  # the bucket starts after candidate a - 1
                total = best[k - 1, a - 1] + cost[a, b]
                if total < lowest:
                    lowest = total
                    lowest_a = a
            best[k, b] = lowest
            choice[k, b] = lowest_a
    last = num_candidates - 1
    cheapest = np.inf
    for k in range(1, buckets + 1):
        if best[k, last] < cheapest:
            cheapest = best[k, last]
    used = 1
    while best[used, last] > cheapest * (1.0 + 1e-12):
        used += 1
    ends = np.empty(used, dtype=np.int64)
    b = last
    for k in range(used, 0, -1):
        ends[k - 1] = b
        if k > 1:
            b = choice[k, b] - 1
    return ends, best[used, last]
