"""Turn a strategy's micro-batches and their epoch order into a :class:`Plan` (steps, ranks, balance).

Every strategy produces the same intermediate form (:class:`MicroBatches`): the samples grouped by
micro-batch (``order`` sliced by ``offsets``) and ``sequence``, the micro-batch ids in epoch order.
Consecutive runs of ``world_size * grad_accum`` ids form the optimizer steps; a short final run is
spread round-robin over the ranks (rank ``j % world_size``, accumulation slot ``j // world_size``) and
the remaining slots stay empty. Rank balancing, when asked for, then moves micro-batches between the
slots of each step. All of it is vectorised numpy.

Equal-token steps (``step_offsets`` set, :meth:`Strategy.token_steps`): step ``t`` is
``sequence[step_offsets[t]:step_offsets[t + 1]]``; every step is spread round-robin over the ranks
the same way, ``grad_accum`` becomes the most micro-batches any rank gets in a step, and after
balancing each rank's real micro-batches are moved to its first slots (the rest is padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._random import Purpose, generator
from .balance import RankBalance, balance_slots
from .epoch_plan import Budget, Layout, Plan
from .slots import real_slots_first, slot_table, token_slot_table
from .validate import PreparedLengths


@dataclass(frozen=True)
class MicroBatches:
    """Micro-batches of one epoch before they are placed on steps and ranks.

    Attributes:
        order: int64 sample indices, grouped by micro-batch.
        offsets: int64, ``num_micro_batches + 1`` offsets into ``order``.
        sequence: int64 micro-batch ids in epoch order (a permutation of ``range(num_micro_batches)``).
        info: facts for ``Plan.info`` (edges, options).
        step_offsets: None (fixed accumulation: steps are runs of ``world_size * grad_accum`` ids),
            or int64 offsets into ``sequence`` where each optimizer step starts, ``steps + 1`` of
            them (equal-token steps).
    """

    order: np.ndarray
    offsets: np.ndarray
    sequence: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)
    step_offsets: np.ndarray | None = None


def assemble(
    strategy: str,
    layout: Layout,
    prepared: PreparedLengths,
    micro: MicroBatches,
    budget: Budget,
    seed: int,
    epoch: int,
    world_size: int,
    grad_accum: int,
    balance: RankBalance | None,
    oversize: str,
    step_tokens: int | None = None,
) -> Plan:
    """Place micro-batches on steps and ranks (balanced if asked) and build the plan's flat arrays.

    With ``micro.step_offsets`` set (equal-token steps, ``step_tokens``) ``grad_accum`` is derived
    from the steps and the argument is ignored; ``balance`` then places micro-batches inside each
    step only (its ``window_steps`` must be 1).
    """
    if micro.step_offsets is None:
        table, num_full = slot_table(micro.sequence, world_size, grad_accum)
    else:
        table, grad_accum = token_slot_table(micro.sequence, micro.step_offsets, world_size)
        num_full = 0  # no regrouping between steps: it would change their tokens
    info: dict[str, Any] = {"oversize": oversize, **micro.info}
    if balance is not None:
        costs = balance.cost_model.micro_batch_costs(
            prepared.lengths, micro.order, micro.offsets, layout, budget.max_tokens
        )
        table = balance_slots(
            table, costs, world_size, grad_accum, balance, generator(seed, epoch, Purpose.BALANCE), num_full
        )
        info["balance"] = {
            "a": balance.cost_model.a,
            "b": balance.cost_model.b,
            "c": balance.cost_model.c,
            "block_size": balance.cost_model.block_size,
            "num_anchors": balance.cost_model.num_anchors,
            "window_steps": balance.window_steps,
        }
    if micro.step_offsets is not None:
        table = real_slots_first(table, world_size, grad_accum)
    sample_indices, offsets = _flatten(table.reshape(-1), micro.order, micro.offsets)
    return Plan(
        strategy=strategy,
        layout=layout,
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
        info=info,
        step_tokens=step_tokens,
    )


def _flatten(slots: np.ndarray, order: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gather the samples of every slot (micro-batch id or -1) into flat indices and offsets."""
    sizes = np.diff(offsets)
    filled = slots >= 0
    slot_sizes = np.zeros(slots.size, dtype=np.int64)
    slot_sizes[filled] = sizes[slots[filled]]
    new_offsets = np.zeros(slots.size + 1, dtype=np.int64)
    np.cumsum(slot_sizes, out=new_offsets[1:])
    # position in `order` of every output sample: the micro-batch's start plus the rank inside it
    shift = offsets[slots[filled]] - new_offsets[:-1][filled]
    positions = np.repeat(shift, slot_sizes[filled])
    positions += np.arange(positions.size, dtype=np.int64)
    return order[positions], new_offsets
