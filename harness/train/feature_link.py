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
agent stops the others. Test hook: ``BATCHLAB_TEST_KILL=RANK:N`` SIGKILLs global rank ``RANK`` when it
is about to send its ``N``-th micro-batch (a target) or start step ``N`` (a drafter).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harness.models.target import TargetFeatures
from harness.train.batch import BatchCollator, TrainingBatch
from harness.train.config import RunConfig, TopologyConfig
from harness.train.status import RankStatus, describe, read_statuses
from harness.train.topology import Placement
from strategies import Plan

HEADER_FIELDS = ("kind", "epoch", "index", "meta_bytes", "rows", "cols", "dtype", "busy_ns", "elapsed_ns",
                 "in_flight", "sent")
_H = {name: i for i, name in enumerate(HEADER_FIELDS)}
KIND_BATCH, KIND_KEEPALIVE, KIND_END = 0, 1, 2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TAG_HEADER, TAG_META, TAG_FEATURES = 101, 102, 103
PREFIX = "batchlab/topology/"
KILL_ENV = "BATCHLAB_TEST_KILL"


class PeerLost(RuntimeError):
    """A peer rank of the link died or went silent; the message names it and its last stage."""


def _key(*parts: Any) -> str:
    return PREFIX + "/".join(str(p) for p in parts)


def _store():
    return dist.distributed_c10d._get_default_store()


def _kill_point() -> tuple[int, int] | None:
    value = os.environ.get(KILL_ENV)
    if not value:
        return None
    rank, count = value.split(":")
    return int(rank), int(count)


def _maybe_die(rank: int, count: int) -> None:
    point = _kill_point()
    if point is not None and point == (rank, count):
        os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class WorkOrder:
    """The micro-batches of one epoch from ``start_step`` on, numbered ``(step, accumulation, drafter rank)``."""

    plan: Plan
    start_step: int
    drafter_ranks: int

    @property
    def per_step(self) -> int:
        return self.plan.grad_accum * self.drafter_ranks

    def __len__(self) -> int:
        return (self.plan.num_steps - self.start_step) * self.per_step

    def item(self, index: int) -> tuple[int, int, int]:
        """``(step, accumulation slot, drafter rank)`` of micro-batch ``index``."""
        step, rest = divmod(index, self.per_step)
        accum, drafter = divmod(rest, self.drafter_ranks)
        return self.start_step + step, accum, drafter

    def index(self, step: int, accum: int, drafter: int) -> int:
        return (step - self.start_step) * self.per_step + accum * self.drafter_ranks + drafter


class _Heartbeat:
    """A daemon thread that bumps ``alive/RANK`` in the store (the store client is thread-safe)."""

    def __init__(self, store: Any, rank: int, interval: float) -> None:
        self._stop = threading.Event()
        key = _key("alive", rank)
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


class _Silence:
    """When a peer's heartbeat counter last changed (local monotonic clock: no cross-host clocks).

    A peer that has not started its heartbeat yet is not silent: a drafter rank's Trainer may take minutes
    to build (data, target copy, checkpoint); torch elastic's agent covers a rank that dies meanwhile."""

    def __init__(self, store: Any, ranks: tuple[int, ...]) -> None:
        self.store = store
        self.seen = {r: (-1, time.monotonic()) for r in ranks}

    def silent_for(self, rank: int) -> float:
        value, since = self.seen[rank]
        now = time.monotonic()
        current = int(self.store.add(_key("alive", rank), 0))
        if current != value or current == 0:  # 0: not started yet (still building its Trainer): not silent
            self.seen[rank] = (current, now)
            return 0.0
        return now - since


def _link_device(device: torch.device) -> torch.device:
    """NCCL sends device tensors only; gloo sends host tensors."""
    return device if device.type == "cuda" else torch.device("cpu")


# ====================================================================== drafter side
class DrafterLink:
    """A drafter rank's end of the link: receives its micro-batches from every target rank, in plan order.

    One receiver thread per target rank blocks on that rank's next header and payload and puts the
    micro-batch into the reorder buffer; :meth:`batches` takes them in plan order, acknowledges each one
    (a credit back to its sender) and hands them to the Trainer with their features attached.
    """

    def __init__(self, placement: Placement, topology: TopologyConfig, trainer: Any, run_dir: Any) -> None:
        self.placement = placement
        self.topology = topology
        self.run_dir = run_dir
        self.rank = placement.env.rank
        self.index = placement.index
        self.targets = placement.target_ranks
        self.store = _store()
        self.device = trainer.device
        self.link_device = _link_device(trainer.device)
        self.layer_ids = list(trainer.drafter.target_layer_ids)
        self.hidden_size = trainer.drafter.hidden_size
        self.plan_epoch: Callable[[int], Plan] = trainer.plan_epoch
        self._stage = trainer._stage  # the trainer's status file (and its test failure hook)
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
        self._steps_taken = 0
        if self.index == 0:
            state = trainer.state
            collate = {f.name: getattr(trainer.train_collate, f.name)
                       for f in dataclasses.fields(BatchCollator) if f.name != "samples"}
            setup = {"rows": np.asarray(trainer.train_rows), "collate": collate, "tap_layer_ids": self.layer_ids,
                     "first_epoch": state.epoch}
            self.store.set(_key("setup"), pickle.dumps(setup))
        self._heartbeat = _Heartbeat(self.store, self.rank, min(1.0, topology.peer_timeout_s / 4))
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
                kind = h[_H["kind"]]
                received = header.numel() * 8
                batch, features = None, None
                if kind == KIND_BATCH:
                    meta = torch.empty(h[_H["meta_bytes"]], dtype=torch.uint8, device=self.link_device)
                    dist.recv(meta, src=target, tag=TAG_META)
                    received += meta.numel()
                    if h[_H["rows"]] > 0:
                        features = torch.empty(h[_H["rows"]], h[_H["cols"]], dtype=DTYPES[h[_H["dtype"]]],
                                               device=self.link_device)
                        dist.recv(features, src=target, tag=TAG_FEATURES)
                        received += features.numel() * features.element_size()
                    batch = pickle.loads(meta.cpu().numpy().tobytes())
                with self._cond:
                    self._last_message[target] = time.monotonic()
                    self._bytes += received
                    self._reported[target] = (h[_H["busy_ns"]], h[_H["elapsed_ns"]], h[_H["in_flight"]], h[_H["sent"]])
                    self._in_flight_max[target] = max(self._in_flight_max[target], h[_H["in_flight"]])
                    if kind == KIND_BATCH:
                        self._buffer[(h[_H["epoch"]], h[_H["index"]])] = (batch, features, target)
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
        self.store.add(_key("credit", target, self.rank), 1)  # the sender may send one more on this link
        batch = batch.to(self.device)
        if features is not None:
            features = self._unpack(batch, features.to(self.device, non_blocking=True))
        return dataclasses.replace(batch, features=features)

    def _unpack(self, batch: TrainingBatch, rows: torch.Tensor) -> TargetFeatures:
        """The real tokens' features back in the batch's token shape (pads zero: the drafter never reads them)."""
        shape = tuple(batch.drafter.token_shape)
        full = rows.new_zeros(math.prod(shape), rows.shape[1])
        full.index_copy_(0, batch.drafter.documents.source_index.to(rows.device), rows)
        full = full.view(*shape, rows.shape[1])
        return TargetFeatures(layer_ids=list(self.layer_ids), hidden_states=list(full.split(self.hidden_size, dim=-1)))

    # ---------------------------------------------------------------- what the Trainer calls
    def _publish(self, epoch: int, plan: Plan, start_step: int, first_global_step: int) -> None:
        if self.index != 0 or epoch in self._published:
            return
        self._published.add(epoch)
        self.store.set(_key("epoch", epoch), pickle.dumps({"plan": plan, "start_step": start_step,
                                                          "first_global_step": first_global_step}))

    def batches(self, plan: Plan, start_step: int, global_step: int) -> Iterator[tuple[int, list[TrainingBatch], float]]:
        """This drafter rank's ``(step, grad_accum micro-batches, wait for features in s)``, as ``batch_generator``."""
        self._publish(plan.epoch, plan, start_step, global_step + 1)
        # the next epoch's plan too, so the target ranks never idle at an epoch boundary
        self._publish(plan.epoch + 1, self.plan_epoch(plan.epoch + 1), 0,
                      global_step + 1 + plan.num_steps - start_step)
        order = WorkOrder(plan, start_step, len(self.placement.drafter_ranks))
        for step in range(start_step, plan.num_steps):
            current = global_step + 1 + step - start_step
            self._steps_taken += 1
            _maybe_die(self.rank, self._steps_taken)
            self._stage("wait_features", current)
            started = time.perf_counter()
            batches = [self._take(plan.epoch, order.index(step, accum, self.index), step)
                       for accum in range(plan.grad_accum)]
            wait = time.perf_counter() - started
            self._idle += wait
            yield step, batches, wait
            if self.topology.drafter_delay_s:
                time.sleep(self.topology.drafter_delay_s)

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

    def close(self) -> None:
        """Stop the target ranks and drain: their last micro-batches are received and discarded."""
        self.store.set(_key("stop"), b"1")
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


# ====================================================================== target side
class TargetProducer:
    """A target rank: take a micro-batch, collate, target forward, send; until the drafter ranks stop."""

    def __init__(self, config: RunConfig, placement: Placement, run_dir: Any, target: torch.nn.Module,
                 device: torch.device) -> None:
        from harness.data.samples import load_samples

        self.config = config
        self.topology = config.topology
        self.placement = placement
        self.run_dir = run_dir
        self.rank = placement.env.rank
        self.index = placement.index
        self.drafters = placement.drafter_ranks
        self.store = _store()
        self.device = device
        self.link_device = _link_device(device)
        self.target = target
        self.status = RankStatus(run_dir, self.rank, role="target")
        self.silence = _Silence(self.store, self.drafters)
        self.signalled = False
        self.started = time.perf_counter()
        self.busy = 0.0
        self.sent = {d: 0 for d in self.drafters}
        self.last_sent = {d: time.monotonic() for d in self.drafters}
        self.keepalive = min(5.0, self.topology.peer_timeout_s / 4)
        self.step = 0
        setup = pickle.loads(self._wait_for(_key("setup"), "the drafter's setup"))
        self.rows = setup["rows"]
        self.tap_layer_ids = setup["tap_layer_ids"]
        self.first_epoch = setup["first_epoch"]
        samples = load_samples(config.data, progress=False)  # the job built the cache before starting its ranks
        self.collate = BatchCollator(samples, **setup["collate"])

    # ---------------------------------------------------------------- waiting, with liveness
    def _stopped(self) -> bool:
        return self.store.check([_key("stop")])

    def _idle_tick(self, waiting_on: int | None, what: str) -> None:
        """While waiting: keepalives to the drafter ranks, and give up on a drafter that went silent."""
        now = time.monotonic()
        for d in self.drafters:
            if now - self.last_sent[d] >= self.keepalive:
                self._send_header(d, KIND_KEEPALIVE)
        for d in ([waiting_on] if waiting_on is not None else self.drafters):
            silent = self.silence.silent_for(d)
            if silent > self.topology.peer_timeout_s:
                where = describe(read_statuses(self.run_dir).get(d))
                raise PeerLost(
                    f"{self.placement.describe(self.rank)} lost {self.placement.describe(d)}, last seen {where}: "
                    f"no heartbeat for {silent:.0f} s (topology.peer_timeout_s={self.topology.peer_timeout_s}) "
                    f"while waiting for {what}. The job stops"
                )

    def _poll(self, ready: Callable[[], bool], waiting_on: int | None, what: str) -> bool:
        """Wait until ``ready()``; False if the drafter ranks asked to stop first."""
        pause, last_tick = 2e-4, time.monotonic()
        while not ready():
            if self._stopped():
                return False
            if time.monotonic() - last_tick > 0.5:
                self._idle_tick(waiting_on, what)
                last_tick = time.monotonic()
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return True

    def _wait_for(self, key: str, what: str) -> bytes:
        if not self._poll(lambda: self.store.check([key]), None, what):
            return b""
        return self.store.get(key)

    def _in_flight(self, drafter: int) -> int:
        return self.sent[drafter] - int(self.store.add(_key("credit", self.rank, drafter), 0))

    # ---------------------------------------------------------------- sending
    def _send_header(self, drafter: int, kind: int, epoch: int = -1, index: int = -1, meta_bytes: int = 0,
                     rows: int = 0, cols: int = 0, dtype: int = 0, in_flight: int = 0) -> None:
        values = {"kind": kind, "epoch": epoch, "index": index, "meta_bytes": meta_bytes, "rows": rows, "cols": cols,
                  "dtype": dtype, "busy_ns": int(self.busy * 1e9),
                  "elapsed_ns": int((time.perf_counter() - self.started) * 1e9), "in_flight": in_flight,
                  "sent": self.sent[drafter]}
        header = torch.tensor([values[name] for name in HEADER_FIELDS], dtype=torch.int64, device=self.link_device)
        self._send(header, drafter, TAG_HEADER)
        self.last_sent[drafter] = time.monotonic()

    def _send(self, tensor: torch.Tensor, drafter: int, tag: int) -> None:
        try:
            dist.send(tensor, dst=drafter, tag=tag)
        except Exception as error:  # named: the peer is what failed
            where = describe(read_statuses(self.run_dir).get(drafter))
            raise PeerLost(f"{self.placement.describe(self.rank)} lost {self.placement.describe(drafter)}, last seen "
                           f"{where}: {type(error).__name__}: {error}. The job stops") from error

    def _produce(self, plan: Plan, epoch: int, index: int, step: int, accum: int, drafter: int) -> None:
        started = time.perf_counter()
        self.status.stage("target_forward", self.step)
        indices = plan.micro_batch(step, drafter, accum)
        batch = self.collate(self.rows[indices], plan.lengths[indices], plan.epoch)
        features = None
        if not batch.empty:
            tapped = self.target(batch.tokens.to(self.device), gdn_backend=self.config.trainer.gdn_backend,
                                 tap_layer_ids=self.tap_layer_ids)
            # the real tokens only, taps side by side: [N, taps * hidden]
            features = batch.drafter.documents.gather(tapped.concatenated().to(self.link_device)).contiguous()
        meta = torch.frombuffer(bytearray(pickle.dumps(batch)), dtype=torch.uint8).to(self.link_device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.busy += time.perf_counter() - started
        self.status.stage("send", self.step)
        self.sent[drafter] += 1
        _maybe_die(self.rank, sum(self.sent.values()))
        rows, cols = (features.shape if features is not None else (0, 0))
        self._send_header(drafter, KIND_BATCH, epoch, index, meta.numel(), rows, cols,
                          DTYPES.index(features.dtype) if features is not None else 0, self._in_flight(drafter))
        self._send(meta, drafter, TAG_META)
        if features is not None:
            self._send(features, drafter, TAG_FEATURES)
        self.last_sent[drafter] = time.monotonic()

    def run(self) -> dict[str, Any]:
        """Produce until the drafter ranks set the stop key; then end every link and return this rank's summary."""
        def note_signal(signum: int, frame: Any) -> None:
            self.signalled = True  # the drafter ranks finish their step and stop the link

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, note_signal)
            except ValueError:  # not the main thread
                pass
        topology, targets = self.topology, len(self.placement.target_ranks)
        epoch, produced = self.first_epoch, 0
        running = True
        while running:
            record = self._wait_for(_key("epoch", epoch), f"the plan of epoch {epoch}")
            if not record:
                break
            record = pickle.loads(record)
            order = WorkOrder(record["plan"], record["start_step"], len(self.drafters))
            k = 0
            while True:
                if topology.dispatch == "round_robin":
                    index, k = self.index + k * targets, k + 1
                else:
                    index = int(self.store.add(_key("dispatch", epoch), 1)) - 1
                if index >= len(order):
                    break
                step, accum, drafter = order.item(index)
                self.step = record["first_global_step"] + step - record["start_step"]
                self.status.stage("wait_credit", self.step)
                if not self._poll(lambda d=drafter: self._in_flight(d) < topology.max_in_flight, drafter,
                                  f"a credit for micro-batch {index} of epoch {epoch}"):
                    running = False
                    break
                self._produce(order.plan, epoch, index, step, accum, drafter)
                produced += 1
            epoch += 1
        self.status.stage("end_links", self.step)
        for d in self.drafters:
            self._send_header(d, KIND_END)
        self.status.stage("done", self.step)
        elapsed = time.perf_counter() - self.started
        return {"status": "interrupted" if self.signalled else "complete", "role": "target", "rank": self.rank,
                "micro_batches": produced, "busy_fraction": self.busy / elapsed if elapsed > 0 else math.nan}
