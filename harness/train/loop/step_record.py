"""One optimizer step's record: the counts the run's state advances by, typed; where the run is; and the sections
the components fill, logged as one flat mapping (``metrics.jsonl``, W&B).

The trainer makes it from the gathered :class:`~harness.train.loop.step_stats.RankStats` (the counts, read by field,
never by a log key) and the step's metrics (:func:`~harness.train.loop.step_stats.step_record`); the gradient
statistics, the placement, the epoch's plan and the held-out evaluation add their own sections. A section's
entries are logged under their own names, section after section (a later section's entry would win).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepPosition:
    """Where the run is once the step is done."""

    step: int  # optimizer steps done (the first step is 1)
    epoch: int
    step_in_epoch: int  # the step of the epoch's plan just done
    tokens_seen: int
    samples_seen: int
    epochs: float  # tokens seen over an epoch's tokens


@dataclass
class StepRecord:
    """One step: what it trained on (summed over every rank), its global metrics, and the sections around them."""

    real_tokens: int
    samples: int
    computed_slots: int
    loss: float
    tau: float
    tokens_per_second: float
    metrics: dict[str, Any]  # the step's global metrics by name (step_stats.step_record)
    gradients: dict[str, Any] = field(default_factory=dict)  # clipping, and the gradient statistics when measured
    placement: dict[str, Any] = field(default_factory=dict)  # the feature source's metrics of the step
    position: StepPosition | None = None
    plan: dict[str, Any] = field(default_factory=dict)  # the epoch's plan metrics, with its first step
    evaluation: dict[str, Any] = field(default_factory=dict)  # the held-out evaluation, on an eval step

    @classmethod
    def of(cls, ranks: Any, metrics: dict[str, Any], gradients: dict[str, Any]) -> StepRecord:
        """The record of a step from every rank's :class:`~harness.train.loop.step_stats.StepStats` (``ranks``), the
        metrics derived from them and the gradient section."""
        return cls(real_tokens=int(ranks.total("real_tokens")), samples=int(ranks.total("samples")),
                   computed_slots=int(ranks.total("computed_slots")), loss=metrics["loss"], tau=metrics["tau"],
                   tokens_per_second=metrics["tokens_per_second"], metrics=metrics, gradients=gradients)

    def logged(self) -> dict[str, Any]:
        """The flat mapping ``metrics.jsonl`` and W&B get."""
        position = dataclasses.asdict(self.position) if self.position is not None else {}
        return {**self.metrics, **self.gradients, **self.placement, **position, **self.plan, **self.evaluation}
