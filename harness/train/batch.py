"""The training batch, built whole on the CPU by the collate in DataLoader workers.

:class:`TrainingBatch` holds one micro-batch in the plan's layout (padded rows or one packed row) and
everything the drafter needs (anchors, block layout, labels, loss weights, their sum Σw as a host float,
host copies of the document boundaries). It pins and moves to the device in one call, without
re-validation or host reads. An empty micro-batch (a short last step) is a first-class batch with no
tokens: the trainer still runs the step and joins every collective.

Anchors are a function of ``(seed, epoch, sample index)`` only (:func:`document_anchors`), so a sample
gets the same blocks under every strategy and world size.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from harness.data.samples import TokenizedSamples
from harness.models.drafter_inputs import DrafterInputs, document_anchors, document_weight_sum
from harness.models.layout import TokenBatch
from strategies import Plan


@dataclass
class TrainingBatch:
    sample_indices: torch.Tensor  # [D] int64: dataset rows, in the batch's document order
    lengths: torch.Tensor  # [D] int64: tokens of each document as computed (after any truncation)
    tokens: TokenBatch | None  # None for an empty micro-batch
    drafter: DrafterInputs | None
    computed_slots: int  # token slots the target computes: rows x width (padded) or the row length (packed)
    weight_sum: float  # Σw of the drafter loss over this micro-batch (host float)
    # the target's features when they were computed elsewhere (topology=disaggregated); None: run the target
    features: Any = None

    @property
    def empty(self) -> bool:
        return self.tokens is None

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    def pin_memory(self) -> TrainingBatch:
        if self.empty:
            return self
        return TrainingBatch(self.sample_indices, self.lengths, self.tokens.pin_memory(), self.drafter.pin_memory(),
                             self.computed_slots, self.weight_sum)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> TrainingBatch:
        if self.empty or torch.device(device).type == "cpu":
            return self
        return TrainingBatch(self.sample_indices, self.lengths, self.tokens.to(device, non_blocking=non_blocking),
                             self.drafter.to(device, non_blocking=non_blocking), self.computed_slots,
                             self.weight_sum, self.features)


@dataclass
class BatchCollator:
    """Builds a :class:`TrainingBatch` from the dataset rows of one micro-batch (picklable: runs in workers)."""

    samples: TokenizedSamples
    layout: str  # "padded" or "packed"
    block_size: int
    num_anchors: int
    mask_token_id: int
    loss_decay_gamma: float
    max_blocks: int | None
    anchor_seed: int
    pad_token_id: int = 0

    def __call__(self, rows: np.ndarray, lengths: np.ndarray, epoch: int) -> TrainingBatch:
        """``rows``: dataset row of every document; ``lengths``: its length in the plan (truncation applied)."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if rows.size == 0:
            return TrainingBatch(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None, None, 0, 0.0)
        documents, masks = [], []
        for (ids, mask), length in zip(self.samples.samples(rows.tolist()), lengths):
            documents.append(torch.from_numpy(np.ascontiguousarray(ids[:length], dtype=np.int64)))
            masks.append(torch.from_numpy(np.ascontiguousarray(mask[:length], dtype=np.int64)))
        tokens = TokenBatch.from_documents(documents, self.layout, loss_masks=masks, pad_token_id=self.pad_token_id)
        drafter = DrafterInputs.build(
            tokens, rows.tolist(), block_size=self.block_size, num_anchors=self.num_anchors,
            mask_token_id=self.mask_token_id, loss_decay_gamma=self.loss_decay_gamma, max_blocks=self.max_blocks,
            seed=self.anchor_seed, epoch=epoch,
        )
        slots = int(lengths.sum()) if self.layout == "packed" else int(rows.size * lengths.max())
        return TrainingBatch(torch.from_numpy(rows), torch.from_numpy(lengths), tokens, drafter, slots,
                             float(drafter.weight_sum))


    def weight_sums(self, rows: np.ndarray, lengths: np.ndarray, epoch: int) -> np.ndarray:
        """float64 Σw of every sample (dataset ``rows``, plan ``lengths``) in ``epoch``, the weight it brings to
        any micro-batch without a ``max_blocks`` cap (:func:`~harness.models.drafter_inputs.document_weight_sum`
        of its :func:`~harness.models.drafter_inputs.document_anchors`), without building a batch."""
        if self.max_blocks is not None:
            raise ValueError("a sample's Σw depends on its neighbours under drafter.max_blocks (a cap per micro-batch); "
                             "set drafter.max_blocks=null")
        sums = np.zeros(len(rows), dtype=np.float64)
        for i, ((_, mask), length, row) in enumerate(zip(self.samples.samples(np.asarray(rows).tolist()),
                                                         np.asarray(lengths), np.asarray(rows))):
            mask = np.asarray(mask[:int(length)])
            anchors, _ = document_anchors(mask, block_size=self.block_size, num_anchors=self.num_anchors,
                                          seed=self.anchor_seed, epoch=epoch, sample_index=int(row))
            sums[i] = document_weight_sum(mask, anchors, block_size=self.block_size,
                                          loss_decay_gamma=self.loss_decay_gamma)
        return sums


class RankMicroBatches(Dataset):
    """One rank's micro-batches of one epoch's plan, from ``start_step`` on, step-major then accumulation: the
    slots it runs (:meth:`~strategies.Plan.rank_step_slots`: all ``grad_accum`` of a step, or, with equal-token
    steps, its real micro-batches or one empty one)."""

    def __init__(self, plan: Plan, rank: int, start_step: int, rows: np.ndarray, collate: BatchCollator,
                 anchor_epoch: int | None = None) -> None:
        self.plan, self.rank, self.start_step = plan, rank, start_step
        self.rows = rows  # plan index -> dataset row
        self.collate = collate
        self.anchor_epoch = plan.epoch if anchor_epoch is None else anchor_epoch
        self.slots = plan.rank_step_slots()[start_step:, rank]  # slots of each step from start_step on
        self.first = np.concatenate([[0], np.cumsum(self.slots)])  # item of each step's first slot

    def __len__(self) -> int:
        return int(self.first[-1])

    def __getitem__(self, item: int) -> TrainingBatch:
        step = int(np.searchsorted(self.first, item, side="right")) - 1
        accum = item - int(self.first[step])
        indices = self.plan.micro_batch(self.start_step + step, self.rank, accum)
        return self.collate(self.rows[indices], self.plan.lengths[indices], self.anchor_epoch)


def _ignore_stop_signals(worker_id: int) -> None:  # noqa: ARG001 - DataLoader's worker_init_fn signature
    """A SIGTERM/SIGINT sent to the job's process group must reach the training process, which finishes its
    step and checkpoints; a worker that died of it first would crash that process instead. Workers still
    exit with their parent, and at once when it is killed: a forked worker holds copies of its rank's
    sockets and of torch elastic's liveness pipe, so until it noticed (DataLoader checks every 5 s) a
    SIGKILLed rank would look alive to the agent and to its peers."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


def micro_batch_loader(dataset: RankMicroBatches, num_workers: int, prefetch_factor: int,
                       pin_memory: bool) -> DataLoader:
    """Batches come out in order (``batch_size=None``: the dataset's items are whole micro-batches)."""
    return DataLoader(
        dataset, batch_size=None, shuffle=False, num_workers=num_workers, pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        multiprocessing_context="fork" if num_workers > 0 else None,
        worker_init_fn=_ignore_stop_signals if num_workers > 0 else None,
    )
