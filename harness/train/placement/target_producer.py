"""The target end of ``topology=disaggregated``: a target rank's loop (take a micro-batch, collate, forward, send).

See :mod:`harness.train.placement.link` for the protocol (header, payload, credits, order, liveness).
"""

from __future__ import annotations

import math
import pickle
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness.data.config import DataConfig
from harness.train.batch import BatchCollator
from harness.train.config import TopologyConfig
from harness.train.placement.link import (
    KIND_BATCH,
    KIND_END,
    KIND_KEEPALIVE,
    POLL_FIRST_S,
    POLL_MAX_S,
    TAG_FEATURES,
    TAG_HEADER,
    TAG_META,
    PeerLost,
    Silence,
    WorkOrder,
    encode,
    header,
    job_store,
    link_device,
    payload_fields,
    store_key,
)
from harness.train.placement.registry import Placement
from harness.train.status import RankStatus, describe, read_statuses
from strategies import Plan


class TargetProducer:
    """A target rank: take a micro-batch, collate, target forward, send; until the drafter ranks stop."""

    def __init__(self, topology: TopologyConfig, data: DataConfig, gdn_backend: str, placement: Placement, run_dir: Any,
                 target: torch.nn.Module, device: torch.device) -> None:
        """``data``: the run's samples (``data``); ``gdn_backend``: ``trainer.gdn_backend``, the target's kernels."""
        from harness.data.samples import load_samples

        self.gdn_backend = gdn_backend
        self.topology = topology
        self.placement = placement
        self.run_dir = run_dir
        self.rank = placement.env.rank
        self.index = placement.index
        self.drafters = placement.drafter_ranks
        self.store = job_store()
        self.device = device
        self.link_device = link_device(device)
        self.target = target
        self.status = RankStatus(run_dir, self.rank, role="target")
        self.silence = Silence(self.store, self.drafters)
        self.signalled = False
        self.started = time.perf_counter()
        self.busy = 0.0
        self.sent = {d: 0 for d in self.drafters}
        self.last_sent = {d: time.monotonic() for d in self.drafters}
        self.keepalive = min(5.0, self.topology.peer_timeout_s / 4)
        self.step = 0
        # the samples first (the job built their cache before starting its ranks), while the drafter ranks build
        # their trainer: the first micro-batch is then ready sooner after the drafter ranks start waiting for it
        samples = load_samples(data, progress=False)
        setup = pickle.loads(self._wait_for(store_key("setup"), "the drafter's setup"))
        self.rows = setup["rows"]
        self.tap_layer_ids = setup["tap_layer_ids"]
        self.first_epoch = setup["first_epoch"]
        self.collate = BatchCollator(samples, **setup["collate"])

    # ---------------------------------------------------------------- waiting, with liveness
    def _stopped(self) -> bool:
        return self.store.check([store_key("stop")])

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
        pause, last_tick = POLL_FIRST_S, time.monotonic()
        while not ready():
            if self._stopped():
                return False
            if time.monotonic() - last_tick > 0.5:
                self._idle_tick(waiting_on, what)
                last_tick = time.monotonic()
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
        return True

    def _wait_for(self, key: str, what: str) -> bytes:
        if not self._poll(lambda: self.store.check([key]), None, what):
            return b""
        return self.store.get(key)

    def _in_flight(self, drafter: int) -> int:
        return self.sent[drafter] - int(self.store.add(store_key("credit", self.rank, drafter), 0))

    # ---------------------------------------------------------------- sending
    def _send_header(self, drafter: int, kind: int, epoch: int = -1, index: int = -1, in_flight: int = 0,
                     payload: dict[str, int] | None = None) -> None:
        values = {"kind": kind, "epoch": epoch, "index": index, **(payload or {}), "busy_ns": int(self.busy * 1e9),
                  "elapsed_ns": int((time.perf_counter() - self.started) * 1e9), "in_flight": in_flight,
                  "sent": self.sent[drafter]}
        self._send(header(values, self.link_device), drafter, TAG_HEADER)
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
        tapped = None
        if not batch.empty:
            tapped = self.target(batch.tokens.to(self.device), gdn_backend=self.gdn_backend,
                                 tap_layer_ids=self.tap_layer_ids).concatenated()
        meta, features = encode(batch, tapped, self.link_device)  # the real tokens only, taps side by side
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.busy += time.perf_counter() - started
        self.status.stage("send", self.step)
        self.sent[drafter] += 1
        self._send_header(drafter, KIND_BATCH, epoch, index, self._in_flight(drafter), payload_fields(meta, features))
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
            record = self._wait_for(store_key("epoch", epoch), f"the plan of epoch {epoch}")
            if not record:
                break
            record = pickle.loads(record)
            order = WorkOrder(record["plan"], record["start_step"], len(self.drafters))
            k = 0
            while True:
                if topology.dispatch == "round_robin":
                    index, k = self.index + k * targets, k + 1
                else:
                    index = int(self.store.add(store_key("dispatch", epoch), 1)) - 1
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
