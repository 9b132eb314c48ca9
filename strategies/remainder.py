"""The rest of an epoch: plan the samples an epoch has not consumed yet, for any world size.

A run checkpointed part-way through an epoch on ``N`` ranks and resumed on ``M`` ranks (or with
another ``grad_accum``) cannot continue the epoch's plan: its steps are laid out for ``N * grad_accum``
micro-batches. :func:`plan_remainder` plans the samples the epoch has not visited yet with the same
strategy, budget, seed and epoch, laid out for the new shape; together with the consumed ones, the
epoch still visits every kept sample exactly once. (torchtitan asserts the same data-parallel
degree on resume and SpecForge refuses a changed world size; neither can do this.)

It reuses the strategy's own planner on the sub-array of remaining lengths and maps the plan's
indices back to the original sample positions, so the returned :class:`Plan` indexes the same
samples as a whole-epoch plan (anchors, ``kept_indices()``, exactly-once checks) and records the
consumed samples in ``Plan.consumed``. Its randomness is the strategy's, drawn from
``(seed, epoch)`` only: the same consumed set gives the same plan. Data-dependent choices of a
strategy (``bucketed``'s edges, ``length_grouped``'s megabatch size) are made on the remaining
samples. With nothing consumed it is exactly the whole-epoch plan.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .balance import RankBalance
from .base import Strategy, checked_step_tokens
from .epoch_plan import Budget, Plan
from .registry import resolve_strategy


def consumed_mask(consumed: Any, size: int) -> np.ndarray:
    """A boolean mask over ``size`` samples from a boolean mask or an array of sample indices."""
    array = np.asarray(consumed)
    if array.dtype == bool:
        if array.shape != (size,):
            raise ValueError(
                f"consumed is a boolean mask of shape {array.shape}, but there are {size} samples; "
                "give one flag per sample (or an array of consumed sample indices)"
            )
        return array.copy()
    if array.size == 0:
        return np.zeros(size, dtype=bool)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(
            f"consumed must be a boolean mask over the samples or a 1-D array of integer sample indices, "
            f"got dtype {array.dtype} and shape {array.shape}"
        )
    outside = (array < 0) | (array >= size)
    if outside.any():
        raise ValueError(
            f"consumed holds sample index {int(array[outside][0])}, outside [0, {size}); "
            "consumed indices refer to positions in lengths"
        )
    mask = np.zeros(size, dtype=bool)
    mask[array] = True
    return mask


def plan_remainder(
    strategy: str | Strategy,
    lengths: Any,
    consumed: Any,
    budget: Budget | int,
    seed: int = 0,
    epoch: int = 0,
    world_size: int = 1,
    grad_accum: int = 1,
    oversize: str = "error",
    balance: RankBalance | dict[str, Any] | None = None,
    step_tokens: int | None = None,
    **strategy_options: Any,
) -> Plan:
    """Plan the rest of ``epoch``: every kept sample not in ``consumed``, for this world size.

    Args:
        strategy: a strategy object, or a registry name with ``strategy_options``.
        lengths: every sample's length (the whole epoch's, not only the remaining ones).
        consumed: the samples the epoch already visited, as a boolean mask over ``lengths`` or an
            array of indices into it. A sample left out by ``oversize="drop"`` cannot be consumed.
        budget, seed, epoch, world_size, grad_accum, oversize, balance, step_tokens: as for
            :meth:`Strategy.plan`; ``world_size`` and ``grad_accum`` are the new run's. With
            ``step_tokens`` the rest is cut into equal-token steps of its own (the cut starts afresh
            at the first remaining micro-batch), and the plan's ``grad_accum`` is derived as there.

    Returns:
        A :class:`Plan` over the original sample indices with ``consumed`` set; its
        ``exactly_once()`` holds when it visits every kept, unconsumed sample once and no consumed
        one. An epoch with nothing left gives a plan of zero steps.
    """
    chosen = resolve_strategy(strategy, **strategy_options)
    step_tokens = checked_step_tokens(step_tokens, grad_accum, balance)
    budget, seed, epoch, world_size, grad_accum, balance, prepared = chosen.checked_inputs(
        lengths, budget, seed, epoch, world_size, grad_accum, oversize, balance)
    done = consumed_mask(consumed, prepared.lengths.size)
    if done[prepared.dropped].any():
        index = int(prepared.dropped[done[prepared.dropped]][0])
        raise ValueError(
            f"consumed holds sample {index}, which oversize={oversize!r} leaves out of every epoch "
            f"(length {int(prepared.lengths[index])} > max_tokens={budget.max_tokens}); it cannot have been consumed"
        )
    remaining = prepared.kept[~done[prepared.kept]]
    consumed_indices = np.flatnonzero(done).astype(np.int64)
    remainder_info = {"consumed": int(consumed_indices.size), "remaining": int(remaining.size)}
    if remaining.size == 0:
        sample_indices = np.zeros(0, dtype=np.int64)
        offsets = np.zeros(1, dtype=np.int64)
        info: dict[str, Any] = {"oversize": oversize, "options": chosen.options()}
    else:
        # lengths are already truncated / dropped: the sub-plan sees only samples that fit
        sub = chosen.plan(prepared.lengths[remaining], budget, seed=seed, epoch=epoch, world_size=world_size,
                          grad_accum=grad_accum, oversize="error", balance=balance, step_tokens=step_tokens)
        sample_indices = remaining[sub.sample_indices]
        offsets = sub.micro_batch_offsets
        grad_accum = sub.grad_accum  # derived from the steps with step_tokens; as given otherwise
        info = {**sub.info, "oversize": oversize}
    info["remainder"] = remainder_info
    return Plan(
        strategy=chosen.name,
        layout=chosen.layout,
        lengths=prepared.lengths,
        sample_indices=sample_indices,
        micro_batch_offsets=offsets,
        budget=budget,
        seed=seed,
        epoch=epoch,
        world_size=world_size,
        grad_accum=grad_accum,
        dropped=prepared.dropped,
        truncated=prepared.truncated,
        consumed=consumed_indices,
        info=info,
        step_tokens=step_tokens,
    )
