"""Where a training rank's micro-batches and their target features come from: the interface placements implement.

The trainer asks its :class:`FeatureSource` for an epoch's micro-batches (:meth:`~FeatureSource.batches`) and
for each micro-batch's tapped target features (:meth:`~FeatureSource.features`); it never asks which
placement it runs under. :class:`LocalTarget` (``topology=colocated``) reads the plan's micro-batches itself
(a DataLoader, collated in workers or in-process) and runs the frozen target on them;
:class:`~harness.train.placement.drafter_link.DrafterLink` (``topology=disaggregated``) receives both from the
target ranks. Placements and their sources are registered in :mod:`harness.train.placement.builtin`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from harness.models.target import TargetFeatures
from harness.train.batch import BatchCollator, RankMicroBatches, TrainingBatch, micro_batch_loader
from strategies import Plan

#: what :meth:`FeatureSource.batches` yields: (step of the epoch, this rank's grad_accum micro-batches, seconds
#: waited for them)
StepBatches = tuple[int, list[TrainingBatch], float]


class FeatureSource(Protocol):
    def batches(self, plan: Plan, start_step: int, global_step: int) -> Iterator[StepBatches]:
        """This rank's micro-batches of ``plan`` from ``start_step`` on (``global_step``: optimizer steps done)."""

    def features(self, batch: TrainingBatch, step: int) -> TargetFeatures | None:
        """The tapped target features of a micro-batch of optimizer step ``step`` (None for an empty one)."""

    def step_metrics(self, comm: Any) -> dict[str, Any]:
        """The placement's metrics of the step just done (every training rank calls it)."""

    def summary(self) -> dict[str, Any]:
        """The placement's entries of the run's summary."""

    def close(self) -> None:
        """The run ended: stop what the source started (every training rank calls it)."""

    def abort(self) -> None:
        """The rank failed: release what would keep the process alive (worker processes), quickly."""


@dataclass
class SourceInputs:
    """What a placement's feature source may need from the rank that trains (built before the source)."""

    trainer: Any  # the run's TrainerConfig (``trainer``)
    loader: Any  # its LoaderConfig (``loader``)
    topology: Any  # its TopologyConfig (``topology``)
    features: Any  # its FeaturesConfig (harness.train.feature_cache): the cache of the target's features
    env: Any  # this rank among the training ranks
    status: Any  # RankStatus
    device: torch.device
    target: Any  # the frozen HybridTarget (colocated: computes features; disaggregated: eval only)
    tap_layer_ids: list[int]
    hidden_size: int
    rows: np.ndarray  # training plan index -> dataset row
    collate: BatchCollator  # the training collate
    plan_epoch: Any  # EpochData.plan_epoch
    first_epoch: int  # the epoch training starts (or resumes) in
    run_dir: Any


class LocalTarget:
    """``colocated``: this rank reads its micro-batches of the plan and runs the frozen target on each."""

    def __init__(self, inputs: SourceInputs) -> None:
        self.inputs = inputs
        self.trainer = inputs.trainer
        self.loader = inputs.loader
        self._epoch_batches: Iterator[StepBatches] | None = None

    def batches(self, plan: Plan, start_step: int, global_step: int) -> Iterator[StepBatches]:
        self._epoch_batches = self._batches(plan, start_step, global_step)
        return self._epoch_batches

    def _batches(self, plan: Plan, start_step: int, global_step: int) -> Iterator[StepBatches]:
        inputs = self.inputs
        device = inputs.device
        dataset = RankMicroBatches(plan, inputs.env.rank, start_step, inputs.rows, inputs.collate)
        settings = self.loader
        workers = settings.num_workers if settings.num_workers is not None else (4 if device.type == "cuda" else 0)
        loader = micro_batch_loader(dataset, workers, settings.prefetch_factor, pin_memory=device.type == "cuda")
        iterator = iter(loader)
        try:
            for step, slots in zip(range(start_step, plan.num_steps), dataset.slots):
                inputs.status.stage("data_wait", global_step + 1 + step - start_step)
                started = time.perf_counter()
                batches = [next(iterator).to(device) for _ in range(slots)]
                yield step, batches, time.perf_counter() - started
        finally:
            # Shut the workers down now, through the loader's own protocol (they ignore SIGTERM, see
            # batch.py); leaving them to interpreter exit would block there.
            del iterator

    def features(self, batch: TrainingBatch, step: int) -> TargetFeatures | None:
        if batch.empty:
            return None
        self.inputs.status.stage("target_forward", step)
        return self.inputs.target(batch.tokens, gdn_backend=self.trainer.gdn_backend,
                                  tap_layer_ids=self.inputs.tap_layer_ids)

    def step_metrics(self, comm: Any) -> dict[str, Any]:  # noqa: ARG002 - nothing beyond the trainer's own
        return {}

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        """Shut the epoch's DataLoader workers down (they ignore SIGTERM: a process exiting with them alive would
        wait for them for good)."""
        if self._epoch_batches is not None:
            self._epoch_batches.close()
            self._epoch_batches = None


class CachedFeatures(LocalTarget):
    """``colocated`` with ``trainer.target_features=cached``: this rank reads its micro-batches as
    :class:`LocalTarget` does, and their target features from the cache (:mod:`harness.train.feature_cache`, built
    before the ranks started) instead of running the target."""

    def __init__(self, inputs: SourceInputs) -> None:
        super().__init__(inputs)
        from harness.train.feature_cache import feature_store

        self.store = feature_store(inputs.features, inputs.collate.samples, inputs.rows, lambda: inputs.target,
                                   inputs.tap_layer_ids)

    def features(self, batch: TrainingBatch, step: int) -> TargetFeatures | None:
        if batch.empty:
            return None
        self.inputs.status.stage("target_forward", step)
        return self.store.batch_features(batch, self.inputs.device, self.inputs.target.dtype)

    def summary(self) -> dict[str, Any]:
        return {"target_features": "cached"}
