"""The drafter end of ``topology=disaggregated``: a :class:`~harness.train.placement.feature_source.FeatureSource` fed by the target ranks.

See :mod:`harness.train.placement.link` for the protocol (header, payload, credits, order, liveness).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harness.models.target import TargetFeatures
from harness.train.batch import BatchCollator, TrainingBatch
from harness.train.config import TopologyConfig
from harness.train.placement.feature_source import SourceInputs, StepBatches
from harness.train.placement.link import (
    HEADER_FIELDS,
    HEADER_INDEX,
    KIND_BATCH,
    KIND_END,
    TAG_HEADER,
    Heartbeat,
    PeerLost,
    WorkOrder,
    decode,
    job_store,
    link_device,
    receive_payload,
    store_key,
    unpack,
)
from harness.train.placement.registry import Placement
from harness.train.status import describe, read_statuses
from strategies import Plan


class DrafterLink:
    """A drafter rank's end of the link: receives its micro-batches from every target rank, in plan order.

    One receiver thread per target rank blocks on that rank's next header and payload and puts the
    micro-batch into the reorder buffer; :meth:`batches` takes them in plan order, acknowledges each one
    (a credit back to its sender) and hands them to the Trainer with their features attached.
    """

    def __init__(self, placement: Placement, topology: TopologyConfig, inputs: SourceInputs) -> None:
        self.placement = placement
        self.topology = topology
        self.run_dir = inputs.run_dir
        self.rank = placement.env.rank
        self.index = placement.index
        self.targets = placement.target_ranks
        self.store = job_store()
        self.device = inputs.device
        self.link_device = link_device(inputs.device)
        self.layer_ids = list(inputs.tap_layer_ids)
        self.hidden_size = inputs.hidden_size
        self.plan_epoch: Callable[[int], Plan] = inputs.plan_epoch
        self.status = inputs.status
        self._cond = threading.Condition()
        self._buffer: dict[tuple[int, int], tuple[TrainingBatch, torch.Tensor | None, int]] = {}
        self._error: tuple[int, BaseException] | None = None
        self._ended: set[int] = set()
        # when each target rank was last heard from; None before its first message (it may still be building
        # its target: then the receive's own timeout, trainer.collective_timeout_s, bounds the wait)
        self._last_message: dict[int, float | None] = {t: None for t in self.targets}
        self._published: set[int] = set()
        # stage metrics: bytes received, the senders' counters from their latest header
        self._bytes = 0
        self._reported = {t: (0, 0, 0, 0) for t in self.targets}  # busy_ns, elapsed_ns, in_flight, sent
        self._in_flight_max = {t: 0 for t in self.targets}
        self._window_start = {t: (0, 0) for t in self.targets}
        self._window_time = time.perf_counter()
        self._idle = 0.0
        if self.index == 0:
            collate = {f.name: getattr(inputs.collate, f.name)
                       for f in dataclasses.fields(BatchCollator) if f.name != "samples"}
            setup = {"rows": np.asarray(inputs.rows), "collate": collate, "tap_layer_ids": self.layer_ids,
                     "first_epoch": inputs.first_epoch}
            self.store.set(store_key("setup"), pickle.dumps(setup))
        self._heartbeat = Heartbeat(self.store, self.rank, min(1.0, topology.peer_timeout_s / 4))
        self._threads = [threading.Thread(target=self._receive, args=(t,), name=f"batchlab-link-{t}", daemon=True)
                         for t in self.targets]
        for thread in self._threads:
            thread.start()

    # ---------------------------------------------------------------- receiving
    def _receive(self, target: int) -> None:
        if self.link_device.type == "cuda":
            torch.cuda.set_device(self.link_device)
        try:
            while True:
                header = torch.empty(len(HEADER_FIELDS), dtype=torch.int64, device=self.link_device)
                dist.recv(header, src=target, tag=TAG_HEADER)
                h = header.tolist()
                kind = h[HEADER_INDEX["kind"]]
                received = header.numel() * 8
                batch, features = None, None
                if kind == KIND_BATCH:
                    meta, features = receive_payload(h, target, self.link_device)
                    received += meta.numel() + (features.numel() * features.element_size() if features is not None
                                                else 0)
                    batch = decode(meta)
                with self._cond:
                    self._last_message[target] = time.monotonic()
                    self._bytes += received
                    self._reported[target] = (h[HEADER_INDEX["busy_ns"]], h[HEADER_INDEX["elapsed_ns"]], h[HEADER_INDEX["in_flight"]], h[HEADER_INDEX["sent"]])
                    self._in_flight_max[target] = max(self._in_flight_max[target], h[HEADER_INDEX["in_flight"]])
                    if kind == KIND_BATCH:
                        self._buffer[(h[HEADER_INDEX["epoch"]], h[HEADER_INDEX["index"]])] = (batch, features, target)
                    elif kind == KIND_END:
                        self._ended.add(target)
                    self._cond.notify_all()
                if kind == KIND_END:
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the main thread, which raises it
            with self._cond:
                self._error = (target, error)
                self._cond.notify_all()

    def _lost(self, target: int, cause: str) -> PeerLost:
        where = describe(read_statuses(self.run_dir).get(target))
        return PeerLost(
            f"{self.placement.describe(self.rank)} lost {self.placement.describe(target)}, last seen {where}: "
            f"{cause}. The job stops; its last checkpoint is kept"
        )

    def _take(self, epoch: int, index: int, step: int) -> TrainingBatch:
        key = (epoch, index)
        with self._cond:
            while key not in self._buffer:
                if self._error is not None:
                    target, error = self._error
                    raise self._lost(target, f"{type(error).__name__}: {error}") from error
                now = time.monotonic()
                heard = [t for t in self.targets if self._last_message[t] is not None]
                silent = max(heard, key=lambda t: now - self._last_message[t], default=None)
                if silent is not None and now - self._last_message[silent] > self.topology.peer_timeout_s:
                    raise self._lost(silent, f"nothing received from it for more than topology.peer_timeout_s="
                                             f"{self.topology.peer_timeout_s} s while waiting for micro-batch "
                                             f"{index} of epoch {epoch} (step {step})")
                self._cond.wait(0.2)
            batch, features, target = self._buffer.pop(key)
        self.store.add(store_key("credit", target, self.rank), 1)  # the sender may send one more on this link
        batch = batch.to(self.device)
        if features is not None:
            features = unpack(batch, features.to(self.device, non_blocking=True), self.layer_ids, self.hidden_size)
        return dataclasses.replace(batch, features=features)

    # ---------------------------------------------------------------- what the Trainer calls
    def _publish(self, epoch: int, plan: Plan, start_step: int, first_global_step: int) -> None:
        if self.index != 0 or epoch in self._published:
            return
        self._published.add(epoch)
        self.store.set(store_key("epoch", epoch), pickle.dumps({"plan": plan, "start_step": start_step,
                                                          "first_global_step": first_global_step}))

    def batches(self, plan: Plan, start_step: int, global_step: int) -> Iterator[StepBatches]:
        """This drafter rank's ``(step, grad_accum micro-batches, wait for features in s)``, features attached."""
        self._publish(plan.epoch, plan, start_step, global_step + 1)
        # the next epoch's plan too, so the target ranks never idle at an epoch boundary
        self._publish(plan.epoch + 1, self.plan_epoch(plan.epoch + 1), 0,
                      global_step + 1 + plan.num_steps - start_step)
        order = WorkOrder(plan, start_step, len(self.placement.drafter_ranks))
        slots = plan.rank_step_slots()[:, self.index]
        for step in range(start_step, plan.num_steps):
            current = global_step + 1 + step - start_step
            self.status.stage("wait_features", current)
            started = time.perf_counter()
            batches = [self._take(plan.epoch, order.index(step, accum, self.index), step)
                       for accum in range(slots[step])]
            wait = time.perf_counter() - started
            self._idle += wait
            yield step, batches, wait

    def features(self, batch: TrainingBatch, step: int) -> TargetFeatures | None:  # noqa: ARG002
        return batch.features  # received with the micro-batch (None for an empty one)

    def step_metrics(self, comm: Any) -> dict[str, Any]:
        """The stage metrics of the step just done (every drafter rank calls it: one small all-reduce)."""
        with self._cond:
            received, self._bytes = self._bytes, 0
            reported = dict(self._reported)
            in_flight_max = max(self._in_flight_max.values())
            buffered = len(self._buffer)
        idle, self._idle = self._idle, 0.0
        reduced = comm.all_reduce_sum(torch.tensor([float(received), idle, float(in_flight_max)], dtype=torch.float64))
        top = comm.all_reduce_max(torch.tensor([float(in_flight_max)], dtype=torch.float64))
        now = time.perf_counter()
        window, self._window_time = now - self._window_time, now
        # every target rank's freshest counters, whichever drafter rank heard from it last
        counters = comm.all_gather(torch.tensor([[reported[t][0], reported[t][1]] for t in self.targets],
                                                dtype=torch.int64))  # [drafters, targets, 2]
        freshest = counters[counters[:, :, 1].argmax(0), torch.arange(len(self.targets))]
        busy = []
        for i, t in enumerate(self.targets):
            busy_ns, elapsed_ns = int(freshest[i, 0]), int(freshest[i, 1])
            start_busy, start_elapsed = self._window_start[t]
            busy.append((busy_ns - start_busy) / (elapsed_ns - start_elapsed) if elapsed_ns > start_elapsed
                        else math.nan)
            self._window_start[t] = (busy_ns, elapsed_ns)
        drafters = comm.env.world_size
        return {
            "topology_target_busy_fraction": busy,
            # every link's latest in-flight count, drafter-major: [(d0, t0), (d0, t1), ..., (d1, t0), ...]
            "topology_in_flight": comm.all_gather(torch.tensor([reported[t][2] for t in self.targets],
                                                               dtype=torch.int64)).reshape(-1).tolist(),
            "topology_in_flight_max": int(top[0]),  # the most unacknowledged on any link so far
            "topology_buffered": buffered,
            "topology_drafter_idle_s": float(reduced[1]) / drafters,
            "topology_drafter_idle_fraction": float(reduced[1]) / drafters / window if window > 0 else math.nan,
            "topology_bytes_per_second": float(reduced[0]) / window if window > 0 else math.nan,
        }

    def summary(self) -> dict[str, Any]:
        with self._cond:
            reported = dict(self._reported)
            in_flight_max = max(self._in_flight_max.values())
        return {
            "topology": "disaggregated", "target_ranks": len(self.targets),
            "drafter_ranks": len(self.placement.drafter_ranks), "max_in_flight": self.topology.max_in_flight,
            "dispatch": self.topology.dispatch, "topology_in_flight_max": in_flight_max,
            "topology_target_busy_fraction": [reported[t][0] / reported[t][1] if reported[t][1] else math.nan
                                              for t in self.targets],
        }

    def abort(self) -> None:
        """The rank failed: stop heartbeating, so the target ranks see it gone (its receiver threads are daemons)."""
        self._heartbeat.stop()

    def close(self) -> None:
        """Stop the target ranks and drain: their last micro-batches are received and discarded."""
        self.store.set(store_key("stop"), b"1")
        deadline = time.monotonic() + self.topology.peer_timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._buffer.clear()
            error = self._error
            alive = [t for t, thread in zip(self.targets, self._threads) if thread.is_alive()]
        self._heartbeat.stop()
        if error is not None:
            raise self._lost(error[0], f"{type(error[1]).__name__}: {error[1]}") from error[1]
        if alive:
            raise self._lost(alive[0], f"it did not end its link within topology.peer_timeout_s="
                                       f"{self.topology.peer_timeout_s} s of the stop")
