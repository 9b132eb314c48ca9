"""What a step's Σ(w·CE) is divided by (``optim.loss_normaliser``): the global step's Σw, or one constant per epoch.

``step`` (the default, every trainer's practice) divides by the step's Σw, all-reduced before the first
backward: a step's blocks share one unit of weight, so a block in a step of few documents weighs more than one
in a step of many. Anchors are capped per document, so a step's Σw follows its document count, not its tokens,
and a strategy whose steps hold few long documents (sorted, bucketed) gives long documents more of the gradient.

``epoch`` divides every step of an epoch by one constant, the epoch's Σw over its steps (the same for every
strategy of the same data, seed and step count): every block weighs the same in every step, as the held-out
evaluation weighs them. It is the mechanism ablation's arm (``experiment=ablation_normaliser``): the gap between
two strategies that remains under it is what their step composition and order do with equal weights; the rest
of the gap under ``step`` is the reweighting. A step's gradient then scales with its Σw, so clipping binds on
steps of many documents (the report counts clipped steps per arm).

The constant is computed from the samples alone (each one's Σw: its anchors of ``(seed, epoch, sample)`` and its
loss mask, :meth:`~harness.train.batch.BatchCollator.weight_sums`), before the epoch's first step, on every rank
alike (no collective); a resumed run computes the same value. An epoch re-planned by an elastic resume takes the
step count of its whole plan for the new shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.train.batch import BatchCollator
    from harness.train.loop.epoch_data import EpochData
    from strategies import Plan


class LossNormaliser:
    """The divisor of every step's loss, by ``optim.loss_normaliser`` (see the module docstring)."""

    def __init__(self, mode: str, data: EpochData, collate: BatchCollator) -> None:
        self.mode, self.data, self.collate = mode, data, collate
        self.epoch: int | None = None
        self.epoch_constant: float | None = None  # the epoch's Σw over its steps (mode "epoch")

    def start_epoch(self, plan: Plan) -> None:
        """Before ``plan``'s first step (or the first step after a resume): the epoch's constant, in mode "epoch"."""
        if self.mode != "epoch" or self.epoch == plan.epoch:
            return
        whole = self.data.whole_plan(plan)
        kept = whole.kept_indices()
        weights = self.collate.weight_sums(self.data.train_rows[kept], whole.lengths[kept], whole.epoch)
        self.epoch, self.epoch_constant = plan.epoch, float(weights.sum()) / max(whole.num_steps, 1)

    def divisor(self, step_weight: float) -> float:
        """What this step's Σ(w·CE) is divided by, given the global step's Σw (> 0; 1 for a step without blocks)."""
        if self.mode == "epoch":
            if self.epoch_constant is None:
                raise RuntimeError("LossNormaliser.start_epoch was not called before the epoch's first step")
            return self.epoch_constant if self.epoch_constant > 0 else 1.0
        return step_weight if step_weight > 0 else 1.0
