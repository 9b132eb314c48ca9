"""The link of ``topology=disaggregated``: target ranks send features to drafter ranks, bounded, in plan order.

**Data** goes one way, target → drafter, over torch.distributed point-to-point (gloo on CPU, NCCL on
GPU): per micro-batch a fixed-size int64 header (:data:`HEADER_FIELDS`: kind, epoch, micro-batch index,
payload sizes and dtype, and the sender's counters for the stage metrics), then the pickled
:class:`~harness.train.batch.TrainingBatch` (host tensors: the drafter inputs with labels, loss weights,
anchors; a few KiB), then the tapped features of the real tokens only, ``[N, taps × hidden]`` (pads
are not sent; the drafter scatters them back to the batch's token shape, exactly).

**Control** goes through the job's c10d store (no home-made cluster manager): drafter rank 0 publishes
the collate settings and every epoch's plan (the plan the drafter ranks iterate, so resumed or replanned
epochs need no second planner); dynamic dispatch is ``store.add`` on a per-epoch counter; a drafter rank
acknowledges a micro-batch with ``store.add`` on the link's credit counter when it takes it out of its
reorder buffer; a target rank sends on a link only while fewer than ``topology.max_in_flight`` of its
micro-batches there are unacknowledged, so a slow drafter blocks the producers and memory stays bounded
(sender side: the one micro-batch being computed; receiver side: ``max_in_flight`` per link). The stop
is a store key.

**Order.** Micro-batches are numbered per epoch in the order ``(step, accumulation slot, drafter rank)``;
each drafter rank takes its own in plan order (buffering early arrivals), so its optimizer sees exactly
the sequence a colocated run with ``world_size = drafter_ranks`` sees. Target ranks take indices in
increasing order (``dynamic``: the next free one; ``round_robin``: ``i ≡ target index mod target_ranks``),
so the lowest index not yet taken by a drafter always has its credit: no deadlock.

**Failures.** A dead peer ends the job within a bounded time: gloo fails a pending receive as soon as the
peer's connection closes; a drafter rank heartbeats in the store and target ranks send keepalive
headers while idle, so a rank waiting on a silent peer for ``topology.peer_timeout_s`` raises
:class:`PeerLost` naming it (with its last stage from :mod:`harness.train.status`), and torch elastic's
agent stops the others.

This module holds what both ends share (the header, the store keys, the work order, liveness); the drafter
end is :class:`harness.train.placement.drafter_link.DrafterLink`, the target end
:class:`harness.train.placement.target_producer.TargetProducer`.
"""

from __future__ import annotations

import math
import pickle
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harness.models.target import TargetFeatures
from strategies import Plan

HEADER_FIELDS = ("kind", "epoch", "index", "meta_bytes", "rows", "cols", "dtype", "busy_ns", "elapsed_ns",
                 "in_flight", "sent")
HEADER_INDEX = {name: i for i, name in enumerate(HEADER_FIELDS)}
KIND_BATCH, KIND_KEEPALIVE, KIND_END = 0, 1, 2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TAG_HEADER, TAG_META, TAG_FEATURES = 101, 102, 103
#: a rank waiting on the store (a credit, a plan) checks again after a pause that starts here and doubles up to
#: POLL_MAX_S: a credit is seen up to that late (``harness.advise.schedule`` simulates these pauses)
POLL_FIRST_S, POLL_MAX_S = 2e-4, 0.01
PREFIX = "batchlab/topology/"


class PeerLost(RuntimeError):
    """A peer rank of the link died or went silent; the message names it and its last stage."""


def store_key(*parts: Any) -> str:
    return PREFIX + "/".join(str(p) for p in parts)


def job_store():
    return dist.distributed_c10d._get_default_store()


class WorkOrder:
    """The micro-batches of one epoch from ``start_step`` on that the drafter ranks run, numbered in the order
    ``(step, accumulation slot, drafter rank)``; the slots a rank does not run in a step (equal-token steps:
    :meth:`~strategies.Plan.rank_step_slots`) get no number."""

    def __init__(self, plan: Plan, start_step: int, drafter_ranks: int) -> None:
        self.plan, self.start_step, self.drafter_ranks = plan, start_step, drafter_ranks
        slots = plan.rank_step_slots()[start_step:]  # [steps, drafter ranks]
        runs = np.arange(plan.grad_accum)[None, :, None] < slots[:, None, :]  # [steps, accum, drafter]
        self._numbers = np.where(runs, np.cumsum(runs.reshape(-1)).reshape(runs.shape) - 1, -1)
        self._items = np.argwhere(runs)  # in (step, accum, drafter) order: the item of every number

    def __len__(self) -> int:
        return len(self._items)

    def item(self, index: int) -> tuple[int, int, int]:
        """``(step, accumulation slot, drafter rank)`` of micro-batch ``index``."""
        step, accum, drafter = (int(v) for v in self._items[index])
        return self.start_step + step, accum, drafter

    def index(self, step: int, accum: int, drafter: int) -> int:
        number = int(self._numbers[step - self.start_step, accum, drafter])
        if number < 0:
            raise IndexError(f"drafter rank {drafter} runs no slot {accum} in step {step}")
        return number


class Heartbeat:
    """A daemon thread that bumps ``alive/RANK`` in the store (the store client is thread-safe)."""

    def __init__(self, store: Any, rank: int, interval: float) -> None:
        self._stop = threading.Event()
        key = store_key("alive", rank)
        store.add(key, 1)

        def beat() -> None:
            while not self._stop.wait(interval):
                try:
                    store.add(key, 1)
                except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                    return

        self._thread = threading.Thread(target=beat, name=f"batchlab-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


class Silence:
    """When a peer's heartbeat counter last changed (local monotonic clock: no cross-host clocks).

    A peer that has not started its heartbeat yet is not silent: a drafter rank's Trainer may take minutes
    to build (data, target copy, checkpoint); torch elastic's agent covers a rank that dies meanwhile."""

    def __init__(self, store: Any, ranks: tuple[int, ...]) -> None:
        self.store = store
        self.seen = {r: (-1, time.monotonic()) for r in ranks}

    def silent_for(self, rank: int) -> float:
        value, since = self.seen[rank]
        now = time.monotonic()
        current = int(self.store.add(store_key("alive", rank), 0))
        if current != value or current == 0:  # 0: not started yet (still building its Trainer): not silent
            self.seen[rank] = (current, now)
            return 0.0
        return now - since


def link_device(device: torch.device) -> torch.device:
    """NCCL sends device tensors only; gloo sends host tensors."""
    return device if device.type == "cuda" else torch.device("cpu")


def encode(batch: Any, tapped: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A micro-batch as the link sends it: the pickled batch (uint8) and the real tokens' features ``[N, taps ×
    hidden]`` gathered from the target's ``tapped`` output (None for an empty micro-batch), on ``device``."""
    features = None
    if tapped is not None:
        features = batch.drafter.documents.gather(tapped.to(device)).contiguous()
    meta = torch.frombuffer(bytearray(pickle.dumps(batch)), dtype=torch.uint8).to(device)
    return meta, features


def payload_fields(meta: torch.Tensor, features: torch.Tensor | None) -> dict[str, int]:
    """The header fields that size what :func:`encode` made: the pickled batch's bytes, the features' shape, dtype."""
    rows, cols = features.shape if features is not None else (0, 0)
    return {"meta_bytes": meta.numel(), "rows": rows, "cols": cols,
            "dtype": DTYPES.index(features.dtype) if features is not None else 0}


def header(values: dict[str, int], device: torch.device) -> torch.Tensor:
    """The fixed int64 header, :data:`HEADER_FIELDS` in order (a field not given: 0)."""
    return torch.tensor([int(values.get(name, 0)) for name in HEADER_FIELDS], dtype=torch.int64, device=device)


def receive_payload(h: list[int], src: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pickled batch and the features (None when there are none) that header values ``h`` announce, received
    from rank ``src`` on ``device``."""
    meta = torch.empty(h[HEADER_INDEX["meta_bytes"]], dtype=torch.uint8, device=device)
    dist.recv(meta, src=src, tag=TAG_META)
    features = None
    if h[HEADER_INDEX["rows"]] > 0:
        features = torch.empty(h[HEADER_INDEX["rows"]], h[HEADER_INDEX["cols"]], dtype=DTYPES[h[HEADER_INDEX["dtype"]]],
                               device=device)
        dist.recv(features, src=src, tag=TAG_FEATURES)
    return meta, features


def decode(meta: torch.Tensor) -> Any:
    """The batch :func:`encode` pickled."""
    return pickle.loads(meta.cpu().numpy().tobytes())


def unpack(batch: Any, rows: torch.Tensor, layer_ids: list[int], hidden_size: int) -> TargetFeatures:
    """The real tokens' features ``rows`` back in the batch's token shape, one tensor a tapped layer (pads zero:
    the drafter never reads them)."""
    shape = tuple(batch.drafter.token_shape)
    full = rows.new_zeros(math.prod(shape), rows.shape[1])
    full.index_copy_(0, batch.drafter.documents.source_index.to(rows.device), rows)
    full = full.view(*shape, rows.shape[1])
    return TargetFeatures(layer_ids=list(layer_ids), hidden_states=list(full.split(hidden_size, dim=-1)))
