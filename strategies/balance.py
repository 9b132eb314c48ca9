"""Rank balancing: place each step's micro-batches on ranks so the slowest rank is as fast as possible.

A data-parallel step lasts as long as its most expensive rank. Within every optimizer step,
:func:`balance_slots` assigns the step's ``world_size * grad_accum`` micro-batches to ranks
(``grad_accum`` each) to minimise the largest rank cost under a :class:`CostModel`, with
longest-processing-time-first (LPT) vectorised across all steps at once: micro-batches are sorted by
cost inside each step, then for each position (a loop of ``world_size * grad_accum`` numpy
operations, not of steps) every step hands its next micro-batch to its least loaded rank that still
has a free accumulation slot. Per step the result is kept only when it is no worse than the
original placement, so balancing never increases any step's max rank cost.

With ``grad_accum == 1`` every rank gets exactly one micro-batch and no in-step placement can help;
``window_steps > 1`` then also regroups micro-batches *between* the full steps of each window of
that many steps (sorted by cost and dealt into steps, so similar costs share a step; the steps of a
window are then shuffled, and the regrouping is kept only when it lowers the window's summed step
cost). This trades some step diversity for balance and is off by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cost import CostModel
from .validate import check_positive_int


@dataclass(frozen=True)
class RankBalance:
    """Rank-balancing option of every strategy.

    Attributes:
        cost_model: cost of one micro-batch, ``a * slots + b * sum(len^2) + c * blocks``.
        window_steps: 1 (default) balances inside each step only; ``w > 1`` also regroups the
            micro-batches of every ``w`` consecutive full steps (see the module docstring).
    """

    cost_model: CostModel = field(default_factory=CostModel)
    window_steps: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.cost_model, Mapping):
            object.__setattr__(self, "cost_model", _cost_model_from_mapping(self.cost_model))
        if not isinstance(self.cost_model, CostModel):
            raise ValueError(
                f"RankBalance.cost_model={self.cost_model!r} must be a CostModel(a, b, c) or a mapping of its fields"
            )
        check_positive_int("RankBalance.window_steps", self.window_steps, "use 1 to balance within each step only")

    @classmethod
    def coerce(cls, value: Any) -> RankBalance | None:
        """Accept None, a RankBalance, or a mapping of its fields (cost_model may be a mapping)."""
        if value is None or isinstance(value, RankBalance):
            return value
        if isinstance(value, Mapping):
            allowed = {"cost_model", "window_steps", *_COST_FIELDS}
            unknown = set(value) - allowed
            if unknown:
                raise ValueError(
                    f"balance has unknown field(s) {sorted(unknown)}; use cost_model (or a, b, c, block_size, "
                    "num_anchors) and window_steps"
                )
            fields = dict(value)
            coefficients = {k: fields.pop(k) for k in _COST_FIELDS if k in fields}
            if coefficients:
                if "cost_model" in fields:
                    raise ValueError("balance: give either cost_model or its fields (a, b, c, ...), not both")
                fields["cost_model"] = CostModel(**coefficients)
            return cls(**fields)
        raise ValueError(f"balance={value!r} must be None, a RankBalance or a mapping of its fields")


_COST_FIELDS = ("a", "b", "c", "block_size", "num_anchors")


def _cost_model_from_mapping(values: Mapping[str, Any]) -> CostModel:
    unknown = set(values) - set(_COST_FIELDS)
    if unknown:
        raise ValueError(
            f"cost_model has unknown field(s) {sorted(unknown)}; CostModel takes {', '.join(_COST_FIELDS)}"
        )
    return CostModel(**dict(values))


def rank_costs(slot_costs: np.ndarray, world_size: int, grad_accum: int) -> np.ndarray:
    """Per-rank cost ``[steps, world_size]`` from per-slot costs ``[steps, world_size * grad_accum]``."""
    return slot_costs.reshape(slot_costs.shape[0], world_size, grad_accum).sum(axis=2)


def _lpt(slot_costs: np.ndarray, world_size: int, grad_accum: int) -> np.ndarray:
    """LPT placement of every step at once; returns, per step, the new slot of each old slot."""
    num_steps, per_step = slot_costs.shape
    by_cost = np.argsort(-slot_costs, axis=1, kind="stable")
    sorted_costs = np.take_along_axis(slot_costs, by_cost, axis=1)
    load = np.zeros((num_steps, world_size))
    filled = np.zeros((num_steps, world_size), dtype=np.int64)
    steps = np.arange(num_steps)
    new_slot_of_old = np.empty((num_steps, per_step), dtype=np.int64)
    for position in range(per_step):
        open_load = np.where(filled < grad_accum, load, np.inf)
        rank = np.argmin(open_load, axis=1)
        load[steps, rank] += sorted_costs[:, position]
        new_slot_of_old[steps, by_cost[:, position]] = rank * grad_accum + filled[steps, rank]
        filled[steps, rank] += 1
    return new_slot_of_old


def balance_slots(
    slot_table: np.ndarray,
    micro_batch_costs: np.ndarray,
    world_size: int,
    grad_accum: int,
    balance: RankBalance,
    rng: np.random.Generator,
    num_full_steps: int,
) -> np.ndarray:
    """Rebalance a ``[steps, world_size * grad_accum]`` table of micro-batch ids (-1 = empty slot).

    ``micro_batch_costs[id]`` is the cost of micro-batch ``id``. The first ``num_full_steps`` steps
    have no empty slot and may be regrouped by windows; the rest are only rebalanced in place.
    Returns a new table holding the same ids.
    """
    table = slot_table.copy()
    costs_with_empty = np.append(micro_batch_costs, 0.0)  # index -1 -> cost 0
    if balance.window_steps > 1 and num_full_steps > 1:
        table[:num_full_steps] = _regroup_windows(
            table[:num_full_steps], costs_with_empty, world_size, grad_accum, balance.window_steps, rng
        )
    slot_costs = costs_with_empty[table]
    new_slot_of_old = _lpt(slot_costs, world_size, grad_accum)
    balanced = np.empty_like(table)
    np.put_along_axis(balanced, new_slot_of_old, table, axis=1)
    before = rank_costs(slot_costs, world_size, grad_accum).max(axis=1)
    after = rank_costs(costs_with_empty[balanced], world_size, grad_accum).max(axis=1)
    return np.where((after <= before)[:, None], balanced, table)


def _regroup_windows(
    table: np.ndarray,
    costs_with_empty: np.ndarray,
    world_size: int,
    grad_accum: int,
    window_steps: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Deal each window's micro-batches into steps by cost, keeping windows where it helps."""
    num_steps, per_step = table.shape
    out = table.copy()
    for start, stop, size in _window_blocks(num_steps, window_steps):
        windows = table[start:stop].reshape(-1, size * per_step)  # [num_windows, size * per_step]
        ids = np.take_along_axis(windows, np.argsort(-costs_with_empty[windows], axis=1, kind="stable"), axis=1)
        regrouped = ids.reshape(-1, size, per_step)
        step_order = np.argsort(rng.random(regrouped.shape[:2]), axis=1)  # shuffle whole steps per window
        regrouped = np.take_along_axis(regrouped, step_order[:, :, None], axis=1)
        before = _best_step_costs(costs_with_empty[windows].reshape(-1, per_step), world_size, grad_accum)
        after = _best_step_costs(costs_with_empty[regrouped].reshape(-1, per_step), world_size, grad_accum)
        better = after.reshape(-1, size).sum(axis=1) < before.reshape(-1, size).sum(axis=1)
        chosen = np.where(better[:, None, None], regrouped, windows.reshape(-1, size, per_step))
        out[start:stop] = chosen.reshape(-1, per_step)
    return out


def _window_blocks(num_steps: int, window_steps: int) -> list[tuple[int, int, int]]:
    """(start, stop, window size) of the complete windows, then of the shorter last window."""
    complete = num_steps // window_steps * window_steps
    blocks = [(0, complete, window_steps)] if complete else []
    if complete < num_steps:
        blocks.append((complete, num_steps, num_steps - complete))
    return blocks


def _best_step_costs(slot_costs: np.ndarray, world_size: int, grad_accum: int) -> np.ndarray:
    """Max rank cost of each step after in-step LPT (or as placed, when that is lower)."""
    placed = rank_costs(slot_costs, world_size, grad_accum).max(axis=1)
    new_slot_of_old = _lpt(slot_costs, world_size, grad_accum)
    balanced = np.empty_like(slot_costs)
    np.put_along_axis(balanced, new_slot_of_old, slot_costs, axis=1)
    return np.minimum(placed, rank_costs(balanced, world_size, grad_accum).max(axis=1))
