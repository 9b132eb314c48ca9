"""Metrics of a plan (docs/design/metrics.md), computed from the plan alone — no training, no torch.

Everything is vectorised over the flat ``Plan`` arrays, so a 902K-sample epoch takes well under a
second. Definitions (``N`` samples, steps ``t``, ranks ``r``, micro-batches ``m``):

- **padding_efficiency** = real tokens / computed slots, summed over the epoch
  (``Plan.micro_batch_tokens`` / ``Plan.micro_batch_slots``: ``rows * max_len`` for a padded
  micro-batch, ``max_tokens`` for a packed row). ``padding_ratio`` = 1 - that.
- **micro_batches** = non-empty micro-batches; **empty_micro_batches** = the empty slots that fill
  a short final step (with ``step_tokens``, also the grid's padding slots); **steps** = optimizer
  steps. **budget_violations** = micro-batches over the budget (``Plan.budget_violations``);
  **max_micro_batch_slots** = the largest computed slots.
- **acf** (what it can and cannot show) = autocorrelation of ``x_t`` = mean sample length of optimizer step ``t`` (all ranks and
  accumulation micro-batches of the step together), at lags ``1..acf_lags``, with the usual
  estimator ``r_k = sum_t (x_t - mean)(x_{t+k} - mean) / sum_t (x_t - mean)^2``. NaN when the
  series is constant or shorter than ``k + 1``. ``lag1_acf`` = ``acf[0]``. It shows whether
  consecutive steps have related lengths (an order that walks through sorted lengths, as
  Hugging Face's length-grouped sampler does; values in docs/design/strategies.md). Every batchlab
  strategy but ``length_grouped(shuffle_order=False)`` permutes its micro-batch order, so it is
  ~0 for them by construction: it says nothing about how length-homogeneous each step is (see
  ``length_mix_excess``) or whether batches repeat (see ``recurrence``). With few steps its noise
  is about ``1.96 / sqrt(steps)``.
- **recurrence** (needs the plan of the next epoch) = among pairs of samples that share a
  micro-batch in epoch ``e``, the fraction that share one again in epoch ``e + 1``. Pairs are
  counted per group, never enumerated: ``sum_g C(n_g, 2)`` over groups of equal micro-batch in
  ``e`` (denominator) and of equal (micro-batch in ``e``, micro-batch in ``e + 1``) (numerator).
  Samples missing from either plan (dropped) are left out. NaN when no pair shares a
  micro-batch in ``e``. Sorted ~ 1, shuffle ~ 0.
- **step_recurrence** = the same with optimizer steps (all ranks and accumulation micro-batches
  of a step together) in place of micro-batches: with a loss normalised over the global step,
  step membership is what reaches the optimizer. Sorted recurs whole per micro-batch but far
  less per step, because its micro-batch order is shuffled each epoch (docs/design/metrics.md).
- **length_mix_kl** = mean over steps of ``KL(p_t || q) = sum_b p_t[b] log(p_t[b] / q[b])``, where
  ``q`` is the histogram of all planned lengths over ``mix_bins`` quantile bins of those lengths
  and ``p_t`` that of step ``t``'s samples. A step's samples are a subset of the dataset, so
  ``q[b] > 0`` wherever ``p_t[b] > 0``: the divergence is finite without any smoothing epsilon
  (bins with ``p_t[b] = 0`` contribute 0). Tied quantiles are merged, so there may be fewer bins.
  A step of ``n`` random samples still scores about ``(bins - 1) / (2 n)``, so the raw value
  mostly measures samples per step; its baseline ``length_mix_kl_random`` is the same
  computation with the plan's samples randomly reassigned to steps of the same sizes (mean of
  ``MIX_BASELINE_DRAWS`` seeded draws, seeds 0, 1, ...), and **length_mix_excess** =
  ``length_mix_kl - length_mix_kl_random`` is the diversity figure: ~0 for shuffle and packed
  (any order whose steps are random draws), large for bucketed and sorted, whose steps hold
  similar lengths.
- **rank_imbalance** = mean over steps of ``max_r C[t, r] / mean_r C[t, r]``, where ``C[t, r]`` is
  the summed ``CostModel`` cost of rank ``r``'s micro-batches in step ``t``; ``rank_imbalance_max``
  is the worst step. 1.0 is perfect balance (always, for ``world_size = 1``).
  ``target_imbalance`` is the same under the target's terms alone (``c = 0``) and
  **drafter_imbalance** the same for the estimated drafter blocks alone
  (``CostModel.micro_batch_blocks``: ``min(num_anchors, max(0, len - block_size + 1))`` per
  sample); ``drafter_blocks`` is their total. A packed plan balances target slots almost
  perfectly (every row costs its capacity) while its blocks vary by a third between ranks.
- **step_cost** = ``sum_t max_r C[t, r]``: estimated time of the epoch when every step waits for its
  slowest rank (cost-model units). **ideal_cost** = ``a * sum(len) + b * sum(len^2) + c * blocks`` over the
  planned samples: the same work with no padding, documents attending only to themselves.
  **relative_step_cost** = ``world_size * step_cost / ideal_cost`` >= 1: how much longer the epoch
  takes than perfectly packed, perfectly balanced work spread over the ranks.
- **samples_seen_once** = True when every sample index appears exactly once in the plan, except
  the dropped ones which appear zero times; ``missing_samples`` / ``repeated_samples`` count the
  violations.
- **step_tokens_min / max / mean / cv** = the real tokens of the optimizer steps (all ranks and
  micro-batches of a step, ``Plan.tokens_per_step``) over every step but the last, which holds what
  is left in both planning modes (``step_tokens_last``; a one-step plan uses its one step); ``cv`` =
  population standard deviation / mean. **micro_batches_per_step_min / mean / max** = the non-empty
  micro-batches of those steps. ``step_tokens_target`` is the plan's ``step_tokens`` (None for fixed
  accumulation). A fixed-accumulation plan of a padded strategy carries fewer real tokens per step
  than a packed one; equal-token plans hold every step but the last near the target.
- **longest_bucket_streak** = the longest run of consecutive optimizer steps whose samples all
  come from one and the same length bucket (a bucketed shuffle's risk of same-bucket streaks by
  chance, shown beside the lag-1 ACF). Buckets: a plan with bucket edges (``Plan.info["edges"]``,
  bucketed) uses its own edges; any other plan uses ``streak_bins`` (default
  :data:`STREAK_BINS` = 8) equal-count bins of the epoch's planned lengths (quantile edges, ties
  merged, as the length-mix bins). A step is single-bucket when all its samples fall in one bucket;
  the streak is 0 when no step is, 1 when single-bucket steps exist but no two consecutive ones
  share a bucket; ``longest_bucket_streak_bucket`` is the bucket of the first longest run (-1 when
  0), ``single_bucket_steps`` the number of single-bucket steps and ``streak_buckets`` the buckets
  (or bins) used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .balance import rank_costs
from .cost import CostModel, drafter_blocks
from .epoch_plan import Plan, segment_reduce

#: equal-count length bins of the bucket-streak metric for plans without bucket edges
STREAK_BINS = 8


def step_of_positions(plan: Plan) -> np.ndarray:
    """Optimizer step of every entry of ``plan.sample_indices``."""
    step_of_micro_batch = np.arange(plan.num_micro_batches, dtype=np.int64) // plan.micro_batches_per_step
    return np.repeat(step_of_micro_batch, plan.micro_batch_sizes())


def step_mean_lengths(plan: Plan) -> np.ndarray:
    """Mean sample length of every optimizer step that has at least one sample."""
    steps = step_of_positions(plan)
    lengths = plan.lengths[plan.sample_indices].astype(np.float64)
    tokens = np.bincount(steps, weights=lengths, minlength=plan.num_steps)
    counts = np.bincount(steps, minlength=plan.num_steps)
    nonempty = counts > 0
    return tokens[nonempty] / counts[nonempty]


def autocorrelation(series: np.ndarray, lags: int) -> np.ndarray:
    """Sample autocorrelation of ``series`` at lags ``1..lags`` (NaN where undefined).

    Written out (a few numpy lines) rather than taken from statsmodels, which batchlab does not
    otherwise need; it is the same biased estimator as ``statsmodels.tsa.stattools.acf``.
    """
    values = np.asarray(series, dtype=np.float64)
    centred = values - values.mean() if values.size else values
    denominator = float(np.dot(centred, centred))
    result = np.full(lags, np.nan)
    if denominator <= 0.0:
        return result
    for lag in range(1, min(lags, values.size - 1) + 1):
        result[lag - 1] = float(np.dot(centred[:-lag], centred[lag:])) / denominator
    return result


def sample_micro_batch(plan: Plan) -> np.ndarray:
    """Micro-batch index of every sample (``-1`` for samples the plan does not contain)."""
    owner = np.full(len(plan.lengths), -1, dtype=np.int64)
    micro_batch_of_position = np.repeat(
        np.arange(plan.num_micro_batches, dtype=np.int64), plan.micro_batch_sizes()
    )
    owner[plan.sample_indices] = micro_batch_of_position
    return owner


def pair_count(group_sizes: np.ndarray) -> int:
    sizes = group_sizes.astype(np.int64)
    return int((sizes * (sizes - 1) // 2).sum())


def sample_step(plan: Plan) -> np.ndarray:
    """Optimizer step of every sample (``-1`` for samples the plan does not contain)."""
    owner = sample_micro_batch(plan)
    return np.where(owner >= 0, owner // plan.micro_batches_per_step, -1)


def composition_recurrence(plan: Plan, next_epoch_plan: Plan) -> tuple[float, int]:
    """Fraction of sample pairs sharing a micro-batch in ``plan`` that share one again in the next.

    Returns:
        ``(recurrence, pairs)``: the fraction (NaN when ``pairs == 0``) and the number of pairs
        that share a micro-batch in ``plan``.
    """
    _check_same_dataset(plan, next_epoch_plan)
    return _group_recurrence(
        sample_micro_batch(plan), sample_micro_batch(next_epoch_plan), next_epoch_plan.num_micro_batches
    )


def step_recurrence(plan: Plan, next_epoch_plan: Plan) -> tuple[float, int]:
    """Fraction of sample pairs sharing an optimizer step in ``plan`` that share one again in the next.

    With a loss normalised over the global step, step membership is all the optimizer sees of the
    batching; this is :func:`composition_recurrence` with steps in place of micro-batches.

    Returns:
        ``(recurrence, pairs)`` as :func:`composition_recurrence`.
    """
    _check_same_dataset(plan, next_epoch_plan)
    return _group_recurrence(sample_step(plan), sample_step(next_epoch_plan), next_epoch_plan.num_steps)


def _check_same_dataset(plan: Plan, next_epoch_plan: Plan) -> None:
    if len(plan.lengths) != len(next_epoch_plan.lengths):
        raise ValueError(
            f"recurrence needs two plans of the same dataset: this plan has {len(plan.lengths)} samples, "
            f"next_epoch_plan has {len(next_epoch_plan.lengths)}; plan both epochs from the same lengths"
        )


def _group_recurrence(first: np.ndarray, second: np.ndarray, second_groups: int) -> tuple[float, int]:
    """Pairs sharing a group in ``first`` that share one in ``second`` too, over samples in both."""
    both = (first >= 0) & (second >= 0)
    first, second = first[both], second[both]
    if first.size == 0:
        return float("nan"), 0
    pairs_first = pair_count(np.bincount(first))
    joint_key = first * np.int64(second_groups) + second
    _, joint_counts = np.unique(joint_key, return_counts=True)
    pairs_both = pair_count(joint_counts)
    if pairs_first == 0:
        return float("nan"), 0
    return pairs_both / pairs_first, pairs_first


def _mean_step_kl(steps: np.ndarray, bins: np.ndarray, num_steps: int, num_bins: int, dataset: np.ndarray) -> float:
    counts = np.bincount(steps * num_bins + bins, minlength=num_steps * num_bins).reshape(num_steps, num_bins)
    totals = counts.sum(axis=1)
    counts = counts[totals > 0].astype(np.float64)
    step_hist = counts / counts.sum(axis=1, keepdims=True)
    ratio = np.divide(step_hist, dataset[None, :], out=np.ones_like(step_hist), where=step_hist > 0)
    return float((step_hist * np.log(ratio)).sum(axis=1).mean())


#: random reassignments averaged for the length-mix baseline (seeds 0, 1, ...)
MIX_BASELINE_DRAWS = 4


def length_mix_divergence(plan: Plan, mix_bins: int = 16, draws: int = MIX_BASELINE_DRAWS) -> tuple[float, float]:
    """Mean over steps of KL(step length histogram || dataset histogram), quantile bins.

    Returns:
        ``(kl, kl_random)``: the plan's value and its baseline, the mean of the same computation
        over ``draws`` random reassignments of the plan's samples to steps of the same sizes
        (seeds ``0 .. draws - 1``): the level a fully random batching with these step sizes reaches.
        ``kl - kl_random`` is the length-mix excess.
    """
    lengths = plan.lengths[plan.sample_indices]
    if lengths.size == 0:
        return float("nan"), float("nan")
    bins, num_bins = quantile_bins(lengths, mix_bins)
    dataset = np.bincount(bins, minlength=num_bins) / lengths.size
    steps = step_of_positions(plan)
    kl = _mean_step_kl(steps, bins, plan.num_steps, num_bins, dataset)
    baseline = [
        _mean_step_kl(steps, bins[np.random.default_rng(draw).permutation(bins.size)], plan.num_steps, num_bins, dataset)
        for draw in range(draws)
    ]
    return kl, float(np.mean(baseline))


def quantile_bins(lengths: np.ndarray, bins: int) -> tuple[np.ndarray, int]:
    """``(bin of every length, number of bins)``: ``bins`` equal-count bins of ``lengths`` (quantile
    edges, tied edges merged, so there may be fewer)."""
    inner = np.quantile(lengths, np.linspace(0.0, 1.0, bins + 1)[1:-1]) if bins > 1 else np.zeros(0)
    edges = np.unique(inner)
    return np.searchsorted(edges, lengths, side="right"), len(edges) + 1


def step_buckets(plan: Plan, streak_bins: int = STREAK_BINS) -> tuple[np.ndarray, int]:
    """``(bucket of every step, buckets)``: a step's bucket when all its samples share one, else -1
    (mixed or empty steps). Buckets as in ``longest_bucket_streak`` (module docstring)."""
    lengths = plan.lengths[plan.sample_indices]
    edges = plan.info.get("edges")
    if edges is not None:
        bucket, num_buckets = np.searchsorted(np.asarray(edges), lengths, side="left"), len(edges)
    elif lengths.size:
        bucket, num_buckets = quantile_bins(lengths, streak_bins)
    else:
        bucket, num_buckets = np.zeros(0, dtype=np.int64), 0
    step_offsets = plan.micro_batch_offsets[:: plan.micro_batches_per_step]
    lowest = -segment_reduce(np.maximum, -bucket, step_offsets)
    highest = segment_reduce(np.maximum, bucket, step_offsets)
    single = (lowest == highest) & (np.diff(step_offsets) > 0)
    return np.where(single, highest, -1), num_buckets


def longest_run(labels: np.ndarray) -> tuple[int, int]:
    """``(length, label)`` of the first longest run of equal labels ``>= 0`` (``(0, -1)`` when none)."""
    if not (labels >= 0).any():
        return 0, -1
    starts = np.flatnonzero(np.concatenate([[True], labels[1:] != labels[:-1]]))
    lengths = np.diff(np.append(starts, labels.size))
    lengths = np.where(labels[starts] >= 0, lengths, 0)
    best = int(np.argmax(lengths))
    return int(lengths[best]), int(labels[starts[best]])


def longest_bucket_streak(plan: Plan, streak_bins: int = STREAK_BINS) -> tuple[int, int]:
    """``(steps, bucket)`` of the longest run of consecutive single-bucket steps of one bucket."""
    return longest_run(step_buckets(plan, streak_bins)[0])


def step_spread(plan: Plan) -> dict[str, Any]:
    """Real tokens and non-empty micro-batches per optimizer step, over every step but the last."""
    tokens = plan.tokens_per_step()
    micro_batches = (plan.micro_batch_sizes() > 0).reshape(plan.num_steps, plan.micro_batches_per_step).sum(axis=1)
    body = slice(0, max(plan.num_steps - 1, 1))
    tokens_body, micro_body = tokens[body].astype(np.float64), micro_batches[body]
    nan = float("nan")
    return {
        "step_tokens_target": plan.step_tokens,
        "step_tokens_min": int(tokens_body.min()) if tokens_body.size else 0,
        "step_tokens_max": int(tokens_body.max()) if tokens_body.size else 0,
        "step_tokens_mean": float(tokens_body.mean()) if tokens_body.size else nan,
        "step_tokens_cv": float(tokens_body.std() / tokens_body.mean()) if tokens_body.sum() > 0 else nan,
        "step_tokens_last": int(tokens[-1]) if tokens.size else 0,
        "micro_batches_per_step_min": int(micro_body.min()) if micro_body.size else 0,
        "micro_batches_per_step_mean": float(micro_body.mean()) if micro_body.size else nan,
        "micro_batches_per_step_max": int(micro_body.max()) if micro_body.size else 0,
    }


def plan_rank_costs(plan: Plan, cost_model: CostModel) -> np.ndarray:
    """``[steps, world_size]`` cost of each rank's micro-batches (accumulation summed) per step."""
    costs = cost_model.micro_batch_costs(
        plan.lengths, plan.sample_indices, plan.micro_batch_offsets, plan.layout, plan.budget.max_tokens
    )
    return rank_costs(costs.reshape(plan.num_steps, -1), plan.world_size, plan.grad_accum)


def plan_rank_blocks(plan: Plan, cost_model: CostModel) -> np.ndarray:
    """``[steps, world_size]`` estimated drafter blocks of each rank per step (``CostModel.micro_batch_blocks``)."""
    blocks = cost_model.micro_batch_blocks(plan.lengths, plan.sample_indices, plan.micro_batch_offsets)
    return rank_costs(blocks.reshape(plan.num_steps, -1), plan.world_size, plan.grad_accum)


def _imbalance(per_rank: np.ndarray) -> np.ndarray:
    """``max_r / mean_r`` of every step with work (``[steps, world_size]`` in)."""
    mean = per_rank.mean(axis=1)
    active = mean > 0
    return per_rank.max(axis=1)[active] / mean[active]


def plan_metrics(
    plan: Plan,
    next_epoch_plan: Plan | None = None,
    acf_lags: int = 8,
    cost_model: CostModel | None = None,
    mix_bins: int = 16,
    streak_bins: int = STREAK_BINS,
) -> dict[str, Any]:
    """All plan metrics of the module docstring, as a JSON-ready dict (NaN where undefined).

    Args:
        plan: the plan of epoch ``e``.
        next_epoch_plan: the plan of epoch ``e + 1`` (same dataset); without it ``recurrence`` is NaN.
        acf_lags: number of autocorrelation lags (>= 1).
        cost_model: cost of a micro-batch; default ``CostModel()``.
        mix_bins: number of quantile bins for the length-mix divergence (>= 1).
        streak_bins: equal-count length bins of the bucket streak for plans without bucket edges (>= 1).
    """
    for name, value in (("acf_lags", acf_lags), ("mix_bins", mix_bins), ("streak_bins", streak_bins)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    cost_model = cost_model or CostModel()

    sizes = plan.micro_batch_sizes()
    slots = plan.micro_batch_slots()
    planned_lengths = plan.lengths[plan.sample_indices].astype(np.int64)
    real_tokens = int(planned_lengths.sum())
    computed_slots = int(slots.sum())
    efficiency = real_tokens / computed_slots if computed_slots else float("nan")

    acf = autocorrelation(step_mean_lengths(plan), acf_lags)
    if next_epoch_plan is not None:
        recurrence, recurrence_pairs = composition_recurrence(plan, next_epoch_plan)
        step_level, step_pairs = step_recurrence(plan, next_epoch_plan)
    else:
        recurrence, recurrence_pairs = float("nan"), 0
        step_level, step_pairs = float("nan"), 0
    mix_kl, mix_kl_random = length_mix_divergence(plan, mix_bins)

    per_rank = plan_rank_costs(plan, cost_model)
    rank_max = per_rank.max(axis=1)
    imbalance = _imbalance(per_rank)
    target_imbalance = _imbalance(plan_rank_costs(plan, cost_model.target_only()))
    drafter_imbalance = _imbalance(plan_rank_blocks(plan, cost_model))
    step_cost = float(rank_max.sum())
    total_blocks = float(drafter_blocks(planned_lengths, cost_model.block_size, cost_model.num_anchors).sum())
    ideal_cost = float(
        cost_model.a * real_tokens
        + cost_model.b * float((planned_lengths.astype(np.float64) ** 2).sum())
        + cost_model.c * total_blocks
    )
    missing, repeated = plan.exactly_once_violations()
    buckets_of_steps, streak_buckets = step_buckets(plan, streak_bins)
    streak, streak_bucket = longest_run(buckets_of_steps)

    return {
        "strategy": plan.strategy,
        "layout": plan.layout,
        "epoch": int(plan.epoch),
        "world_size": int(plan.world_size),
        "grad_accum": int(plan.grad_accum),
        "max_tokens": int(plan.budget.max_tokens),
        "samples": int(len(plan.lengths)),
        "samples_planned": int(plan.sample_indices.size),
        "dropped": int(plan.dropped.size),
        "truncated": int(plan.truncated.size),
        "real_tokens": real_tokens,
        "computed_slots": computed_slots,
        "padding_efficiency": float(efficiency),
        "padding_ratio": float(1.0 - efficiency),
        "micro_batches": int((sizes > 0).sum()),
        "empty_micro_batches": int((sizes == 0).sum()),
        "steps": int(plan.num_steps),
        "max_micro_batch_slots": int(slots.max()) if slots.size else 0,
        "budget_violations": int(plan.budget_violations().size),
        "lag1_acf": float(acf[0]),
        "acf": [float(value) for value in acf],
        "recurrence": float(recurrence),
        "recurrence_pairs": int(recurrence_pairs),
        "step_recurrence": float(step_level),
        "step_recurrence_pairs": int(step_pairs),
        "length_mix_kl": mix_kl,
        "length_mix_kl_random": mix_kl_random,
        "length_mix_excess": mix_kl - mix_kl_random,
        "rank_imbalance": float(imbalance.mean()) if imbalance.size else float("nan"),
        "rank_imbalance_max": float(imbalance.max()) if imbalance.size else float("nan"),
        "target_imbalance": float(target_imbalance.mean()) if target_imbalance.size else float("nan"),
        "drafter_imbalance": float(drafter_imbalance.mean()) if drafter_imbalance.size else float("nan"),
        "drafter_blocks": total_blocks,
        "step_cost": step_cost,
        "ideal_cost": ideal_cost,
        "relative_step_cost": plan.world_size * step_cost / ideal_cost if ideal_cost > 0 else float("nan"),
        "samples_seen_once": missing == 0 and repeated == 0,
        "missing_samples": missing,
        "repeated_samples": repeated,
        **step_spread(plan),
        "longest_bucket_streak": streak,
        "longest_bucket_streak_bucket": streak_bucket,
        "single_bucket_steps": int((buckets_of_steps >= 0).sum()),
        "streak_buckets": int(streak_buckets),
    }
