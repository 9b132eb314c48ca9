"""The placement stage-time model: every rank colocated, against the ranks split into target and drafter ranks.

A stage costs ``a·slots + b·Σlen² + c·min(blocks, max_blocks) + m`` per micro-batch (:class:`StageCost`: the
terms of :class:`strategies.CostModel` plus a fixed cost; seconds when calibrated, any unit otherwise).

- **Colocated** on ``N`` ranks: every rank runs both stages of its micro-batches; a step waits for its slowest
  rank, then the optimizer step.
- **Disaggregated** as ``T`` target ranks + ``D`` drafter ranks (``T + D = N``, the drafter ranks at the same
  global batch: their plan has ``world_size = D`` and ``grad_accum = N·G / D``, so ``D`` must divide ``N·G``):
  the target ranks take micro-batches as they come free (dynamic dispatch), so their stage lasts
  ``Σ target / T``; the drafter ranks step together, so theirs is every step's slowest drafter rank plus the
  optimizer step. With enough micro-batches in flight the two stages overlap and the epoch lasts as long as
  the slower one; ``target_busy`` and ``drafter_busy`` are each stage's share of it.

This is a bound: feature transfers are left out and the stages overlap perfectly. Where the link has been
measured (:mod:`harness.advise.link`), :mod:`harness.advise.schedule` replays the split's protocol instead
(credits, polling, a step's micro-batches taken together, the link's costs, cores shared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from strategies import CostModel
from strategies.balance import rank_costs


@dataclass(frozen=True)
class Terms:
    """Per micro-batch slot of a plan: computed slots, ``Σlen²``, drafter blocks, and whether it holds anything."""

    slots: np.ndarray
    quad: np.ndarray
    blocks: np.ndarray
    nonempty: np.ndarray

    @classmethod
    def of(cls, plan: Any, block_size: int, num_anchors: int) -> Terms:
        # CostModel's own Σlen² (its b term alone) and block estimate, the plan's own computed slots
        quad = CostModel(a=0.0, b=1.0, c=0.0, block_size=block_size, num_anchors=num_anchors)
        return cls(slots=plan.micro_batch_slots().astype(np.float64),
                   quad=quad.micro_batch_costs(plan.lengths, plan.sample_indices, plan.micro_batch_offsets,
                                               plan.layout, plan.budget.max_tokens),
                   blocks=quad.micro_batch_blocks(plan.lengths, plan.sample_indices, plan.micro_batch_offsets),
                   nonempty=plan.micro_batch_sizes() > 0)


@dataclass(frozen=True)
class StageCost:
    """One stage's cost of a micro-batch: ``a·slots + b·Σlen² + c·min(blocks, max_blocks) + m`` (empty: 0)."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    m: float = 0.0
    block_size: int = 16
    num_anchors: int = 512
    max_blocks: int | None = None  # the drafter's cap on blocks per micro-batch (None: none)

    def micro_batch(self, plan: Any) -> np.ndarray:
        """``[steps · world_size · grad_accum]``: the cost of every micro-batch slot of ``plan``."""
        return self.seconds(Terms.of(plan, self.block_size, self.num_anchors))

    def seconds(self, terms: Terms) -> np.ndarray:
        """The cost of every micro-batch slot of ``terms`` (computed once for both stages of a plan)."""
        blocks = terms.blocks if self.max_blocks is None else np.minimum(terms.blocks, self.max_blocks)
        return (self.a * terms.slots + self.b * terms.quad + self.c * blocks + self.m) * terms.nonempty


def colocated_seconds(plan: Any, target: StageCost, drafter: StageCost, step_s: float = 0.0) -> float:
    """The epoch of ``plan`` with every rank running both stages: each step's slowest rank plus the step."""
    terms = Terms.of(plan, drafter.block_size, drafter.num_anchors)
    per_slot = (target.seconds(terms) + drafter.seconds(terms)).reshape(plan.num_steps, -1)
    return float((rank_costs(per_slot, plan.world_size, plan.grad_accum).max(axis=1) + step_s).sum())


@dataclass(frozen=True)
class Split:
    """``target_ranks`` + ``drafter_ranks`` (module docstring): the epoch and each stage's busy share."""

    target_ranks: int
    drafter_ranks: int
    drafter_grad_accum: int
    tokens: float  # the epoch's real tokens
    epoch_seconds: float
    target_busy: float
    drafter_busy: float

    @property
    def label(self) -> str:
        return f"{self.target_ranks}+{self.drafter_ranks}"

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.epoch_seconds if self.epoch_seconds > 0 else float("nan")


def split_seconds(drafter_plan: Any, target: StageCost, drafter: StageCost, target_ranks: int,
                  step_s: float = 0.0) -> Split:
    """The epoch of ``drafter_plan`` (planned for the drafter ranks) with ``target_ranks`` target ranks feeding it."""
    terms = Terms.of(drafter_plan, drafter.block_size, drafter.num_anchors)
    target_time = float(target.seconds(terms).sum()) / target_ranks
    per_slot = drafter.seconds(terms).reshape(drafter_plan.num_steps, -1)
    drafter_time = float((rank_costs(per_slot, drafter_plan.world_size, drafter_plan.grad_accum).max(axis=1)
                          + step_s).sum())
    epoch = max(target_time, drafter_time)
    return Split(target_ranks, drafter_plan.world_size, drafter_plan.grad_accum,
                 float(drafter_plan.micro_batch_tokens().sum()), epoch,
                 target_time / epoch if epoch > 0 else float("nan"),
                 drafter_time / epoch if epoch > 0 else float("nan"))


def split_shapes(world_size: int, grad_accum: int) -> list[tuple[int, int, int]]:
    """``(target ranks, drafter ranks, the drafter ranks' grad_accum)`` of every split of ``world_size`` ranks whose
    drafter ranks keep the global batch (``world_size · grad_accum`` micro-batches a step), fewest target ranks
    first (none on a single rank)."""
    micro_batches = world_size * grad_accum
    return [(t, world_size - t, micro_batches // (world_size - t)) for t in range(1, world_size)
            if micro_batches % (world_size - t) == 0]


def splits(make_plan: Callable[[int, int], Any], world_size: int, grad_accum: int, target: StageCost,
           drafter: StageCost, step_s: float | Callable[[int], float] = 0.0,
           simulate: Callable[[Any, int, float], Split] | None = None) -> list[Split]:
    """Every split of :func:`split_shapes`; ``make_plan(world_size, grad_accum)`` plans the drafters' epoch;
    ``step_s``: the step's own time, or a function of the drafter ranks (their all-reduce); ``simulate(plan,
    target_ranks, step_s)``: the split's epoch replayed (:mod:`harness.advise.schedule`) instead of bounded by
    its slower stage."""
    out = []
    for target_ranks, drafter_ranks, drafter_accum in split_shapes(world_size, grad_accum):
        plan = make_plan(drafter_ranks, drafter_accum)
        step = step_s(drafter_ranks) if callable(step_s) else step_s
        out.append(simulate(plan, target_ranks, step) if simulate is not None
                   else split_seconds(plan, target, drafter, target_ranks, step))
    return out
