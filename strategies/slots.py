"""Where each micro-batch of an epoch sits: a table of steps by (rank, accumulation slot), -1 for empty.

Rank ``r``'s accumulation slot ``a`` is column ``r * grad_accum + a``. Consecutive ids are spread
round-robin over the ranks (id ``j`` of a step to rank ``j % world_size``, slot ``j // world_size``).
"""

from __future__ import annotations

import numpy as np


def slot_table(sequence: np.ndarray, world_size: int, grad_accum: int) -> tuple[np.ndarray, int]:
    """``[steps, world_size * grad_accum]`` micro-batch ids per slot (-1 = empty) and the full steps."""
    per_step = world_size * grad_accum
    num_full, remainder = divmod(sequence.size, per_step)
    num_steps = num_full + (remainder > 0)
    table = np.full((num_steps, per_step), -1, dtype=np.int64)
    table[:num_full] = sequence[: num_full * per_step].reshape(num_full, per_step)
    if remainder:
        j = np.arange(remainder)
        table[num_full, (j % world_size) * grad_accum + j // world_size] = sequence[num_full * per_step :]
    return table, num_full


def token_slot_table(sequence: np.ndarray, step_offsets: np.ndarray, world_size: int) -> tuple[np.ndarray, int]:
    """``[steps, world_size * grad_accum]`` micro-batch ids per slot (-1 = empty) of steps of varying size.

    Micro-batch ``j`` of a step goes to rank ``j % world_size``, accumulation slot ``j // world_size``;
    ``grad_accum`` (returned) is the most micro-batches any rank gets in any step.
    """
    sizes = np.diff(step_offsets)
    grad_accum = max(int(-(-sizes.max() // world_size)), 1) if sizes.size else 1
    table = np.full((sizes.size, world_size * grad_accum), -1, dtype=np.int64)
    step = np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)
    j = np.arange(sequence.size, dtype=np.int64) - step_offsets[:-1][step]
    table[step, (j % world_size) * grad_accum + j // world_size] = sequence
    return table, grad_accum


def real_slots_first(table: np.ndarray, world_size: int, grad_accum: int) -> np.ndarray:
    """The table with each rank's micro-batches moved, in order, to its first slots of every step."""
    per_rank = table.reshape(table.shape[0], world_size, grad_accum)
    moved = np.take_along_axis(per_rank, np.argsort(per_rank < 0, axis=2, kind="stable"), axis=2)
    return moved.reshape(table.shape)
