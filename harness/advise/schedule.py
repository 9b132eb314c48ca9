"""The placements' schedules simulated micro-batch by micro-batch: what the stage-time bound leaves out.

:mod:`harness.advise.stages` bounds a split by its slower stage, as if the stages overlapped perfectly. A real
split runs the protocol of :mod:`harness.train.placement.link`, and this module replays it on the calibrated costs:

* a target rank takes the next micro-batch (dynamic dispatch: whichever rank is free; round robin: its own
  turn), waits for a credit on the link to that micro-batch's drafter rank (at most ``max_in_flight`` of its
  micro-batches there not yet taken), and sees the credit only at its next look at the store (pauses from
  :data:`~harness.train.placement.link.POLL_FIRST_S` doubling to :data:`~harness.train.placement.link.POLL_MAX_S`);
  then it runs the target's forward and sends (the link's send cost);
* the drafter rank's receiving thread receives and unpickles it (the link's receive cost);
* a drafter rank takes every micro-batch of its step before computing any (each take returns a credit and
  scatters the features back: the link's unpack cost), the drafter ranks all-reduce Σw, run the drafter's
  forward and backward, all-reduce the gradients and step.

Colocated ranks run both stages of their micro-batches and meet at every step's all-reduce.

On a CPU the job's processes share ``cores``: while ``n`` processes compute, each advances at
``min(1, cores / n)`` of its own speed, so the stage costs given are a rank's speed on a core of its own
(calibrated by as many concurrent ranks as there are cores). On GPUs every rank has its own device:
``cores=None``. A drafter rank's receiving thread takes turns with its training loop (one interpreter lock).

A small discrete-event simulation written here: the protocol's waits (credits seen at poll ticks, a step's
micro-batches taken together, barriers) are what decides the schedule, and no queueing library models them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.train.placement.link import POLL_FIRST_S, POLL_MAX_S, WorkOrder


@dataclass(frozen=True)
class LinkCost:
    """Seconds a micro-batch's trip over the link costs, ``fixed + per_token · real tokens + per_slot · slots``,
    at each of its three places (:func:`harness.advise.link.calibrate_link` measures them)."""

    send: tuple[float, float, float] = (0.0, 0.0, 0.0)  # target rank: gather, pickle, store, the three sends
    receive: tuple[float, float, float] = (0.0, 0.0, 0.0)  # drafter's receiving thread: receives, unpickle
    unpack: tuple[float, float, float] = (0.0, 0.0, 0.0)  # drafter rank's take: credit, features scattered back

    @staticmethod
    def _seconds(coefficients: tuple[float, float, float], tokens: np.ndarray, slots: np.ndarray) -> np.ndarray:
        fixed, per_token, per_slot = coefficients
        return fixed + per_token * tokens + per_slot * slots

    def seconds(self, tokens: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(send, receive, unpack)`` seconds of micro-batches of ``tokens`` real tokens in ``slots`` slots."""
        return tuple(self._seconds(c, tokens, slots) for c in (self.send, self.receive, self.unpack))


@dataclass(frozen=True)
class Simulated:
    """A simulated epoch: its seconds (as ``batchlab-train`` counts them: the training ranks' steps, from the first
    wait for data to the last optimizer step) and where the time went."""

    epoch_seconds: float
    tokens: float
    target_busy: float  # the target ranks' share of the epoch spent computing and sending (split; nan colocated)
    drafter_waiting: float  # the training ranks' share of the epoch spent waiting for features (and taking them)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.epoch_seconds if self.epoch_seconds > 0 else float("nan")


# ---------------------------------------------------------------- the engine


class Event:
    """Something that happens once; processes wait for it."""

    def __init__(self) -> None:
        self.time: float | None = None
        self._callbacks: list[Callable[[], None]] = []

    def then(self, callback: Callable[[], None]) -> None:
        if self.time is not None:
            callback()
        else:
            self._callbacks.append(callback)

    def fire(self, now: float) -> None:
        if self.time is None:
            self.time = now
            callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback()


class Machine:
    """Processes (generators) yielding ``("work", seconds, process)``, ``("wait", event)`` or ``("poll", event)``;
    the work of one process's threads is serialised (Python's interpreter lock: the ranks' small tensors make
    their work mostly interpreter time), and the processes with work share ``cores`` (None: a device each)."""

    def __init__(self, cores: float | None) -> None:
        self.cores = cores
        self.now = 0.0
        self._tasks: dict[int, list] = {}  # id -> [remaining seconds of own speed, process, owner]
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._ids = itertools.count()
        self.busy: dict[Any, float] = {}  # process -> wall seconds with work

    def start(self, process: Generator) -> None:
        self._resume(process)

    def _resume(self, process: Generator) -> None:
        try:
            request = next(process)
        except StopIteration:
            return
        kind = request[0]
        if kind == "work":
            seconds, owner = max(float(request[1]), 0.0), request[2]
            self._tasks[next(self._ids)] = [seconds, process, owner]
        elif kind == "wait":
            request[1].then(lambda: self._at(self.now, lambda: self._resume(process)))
        elif kind == "poll":  # look at the store at the poll loop's ticks until the event has happened
            started = self.now

            def seen() -> None:
                tick, pause = started, POLL_FIRST_S
                while tick < self.now - 1e-12:
                    tick, pause = tick + pause, min(2 * pause, POLL_MAX_S)
                self._at(tick, lambda: self._resume(process))

            request[1].then(seen)
        else:
            raise ValueError(f"unknown request {request!r}")

    def _at(self, time: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time, next(self._ids), callback))

    def _rates(self) -> tuple[dict[int, float], dict[Any, int]]:
        """Each running task's speed (a process's tasks take turns on its interpreter lock, and the processes with
        work share the cores), and each working process's count of running tasks."""
        processes: dict[Any, int] = {}
        for task in self._tasks.values():
            processes[task[2]] = processes.get(task[2], 0) + 1
        machine = 1.0 if self.cores is None or not processes else min(1.0, self.cores / len(processes))
        return {key: machine / processes[task[2]] for key, task in self._tasks.items()}, processes

    def run(self) -> None:
        while self._tasks or self._timers:
            rates, processes = self._rates()
            next_done = min((t[0] / rates[k] for k, t in self._tasks.items()), default=np.inf)
            next_timer = self._timers[0][0] - self.now if self._timers else np.inf
            step = max(min(next_done, next_timer), 0.0)
            for key, task in self._tasks.items():
                task[0] -= step * rates[key]
            for process in processes:
                self.busy[process] = self.busy.get(process, 0.0) + step
            self.now += step
            for key in [k for k, t in self._tasks.items() if t[0] <= 1e-12]:
                _, process, _ = self._tasks.pop(key)
                self._resume(process)
            while self._timers and self._timers[0][0] <= self.now + 1e-12:
                _, _, callback = heapq.heappop(self._timers)
                callback()


class _Barrier:
    """The ranks meeting at a collective: each step's event fires when all ``parties`` have arrived."""

    def __init__(self, machine: Machine, parties: int) -> None:
        self.machine, self.parties = machine, parties
        self._arrived: dict[Any, int] = {}
        self._events: dict[Any, Event] = {}

    def arrive(self, key: Any) -> Event:
        event = self._events.setdefault(key, Event())
        self._arrived[key] = self._arrived.get(key, 0) + 1
        if self._arrived[key] == self.parties:
            event.fire(self.machine.now)
        return event


# ---------------------------------------------------------------- the placements


def _steps(plan: Any, tokens: float | None) -> int:
    """How many of ``plan``'s first steps a run of ``tokens`` real tokens takes (None: the whole epoch)."""
    if tokens is None:
        return plan.num_steps
    reached = np.cumsum(plan.tokens_per_step()) >= tokens
    return int(np.argmax(reached)) + 1 if reached.any() else plan.num_steps


def simulate_colocated(plan: Any, target_s: np.ndarray, drafter_s: np.ndarray, step_s: float,
                       cores: float | None, tokens: float | None = None) -> Simulated:
    """``plan``'s epoch with every rank running both stages of its micro-batches (per-slot seconds ``target_s``,
    ``drafter_s``, as :meth:`~harness.advise.stages.StageCost.seconds` gives them), meeting at every step; only
    its first steps up to ``tokens`` real tokens when given (what a run stopped there measures)."""
    slots, steps = plan.rank_step_slots(), _steps(plan, tokens)
    work = (np.asarray(target_s) + np.asarray(drafter_s)).reshape(plan.num_steps, plan.world_size, plan.grad_accum)
    machine = Machine(cores)
    barrier = _Barrier(machine, plan.world_size)

    def rank(r: int) -> Generator:
        for step in range(steps):
            yield ("work", float(work[step, r, :slots[step, r]].sum()) + step_s, ("rank", r))
            yield ("wait", barrier.arrive(step))  # the gradients' all-reduce: the step waits for its slowest rank

    for r in range(plan.world_size):
        machine.start(rank(r))
    machine.run()
    return Simulated(machine.now, float(plan.tokens_per_step()[:steps].sum()), float("nan"), 0.0)


def simulate_split(drafter_plan: Any, target_s: np.ndarray, drafter_s: np.ndarray, link: LinkCost,
                   target_ranks: int, step_s: float, cores: float | None, max_in_flight: int = 2,
                   dispatch: str = "dynamic", tokens: float | None = None) -> Simulated:
    """``drafter_plan``'s epoch (planned for the drafter ranks) fed by ``target_ranks`` target ranks over the link
    (module docstring); ``target_s``, ``drafter_s``: per-slot seconds of the two stages; only its first steps up to
    ``tokens`` real tokens when given."""
    plan, drafters, steps = drafter_plan, drafter_plan.world_size, _steps(drafter_plan, tokens)
    order = WorkOrder(plan, 0, drafters)
    slots = plan.rank_step_slots()
    send_s, receive_s, unpack_s = link.seconds(plan.micro_batch_tokens().astype(np.float64),
                                               plan.micro_batch_slots().astype(np.float64))
    # (step, accumulation slot, drafter rank) of every micro-batch the simulated steps run, in work order, and the
    # plan's slot of each
    items = [item for item in (order.item(n) for n in range(len(order))) if item[0] < steps]
    flat = np.array([plan.micro_batch_index(step, d, accum) for step, accum, d in items], dtype=np.int64)
    machine = Machine(cores)
    order_drafter = [d for _, _, d in items]
    arrived = [Event() for _ in range(len(items))]
    sender = np.full(len(items), -1)
    in_flight = np.zeros((target_ranks, drafters), dtype=np.int64)
    credit_waits: dict[tuple[int, int], Event] = {}
    next_index = itertools.count()
    barrier = _Barrier(machine, drafters)
    waited = [0.0]

    def target(k: int) -> Generator:
        turn = itertools.count()
        while True:
            n = next(next_index) if dispatch == "dynamic" else k + next(turn) * target_ranks
            if n >= len(items):
                return
            d = items[n][2]
            if in_flight[k, d] >= max_in_flight:
                credit_waits[(k, d)] = event = Event()
                yield ("poll", event)
            in_flight[k, d] += 1
            sender[n] = k
            slot = flat[n]
            yield ("work", target_s[slot] + send_s[slot], ("target", k))
            machine.start(receive(n, slot))

    def receive(n: int, slot: int) -> Generator:
        # the drafter rank's receiving thread: its process's interpreter lock, shared with the training loop
        yield ("work", receive_s[slot], ("drafter", order_drafter[n]))
        arrived[n].fire(machine.now)

    def drafter(d: int) -> Generator:
        for step in range(steps):
            started = machine.now
            numbers = [order.index(step, accum, d) for accum in range(slots[step, d])]
            for n in numbers:
                yield ("wait", arrived[n])
                k = int(sender[n])
                in_flight[k, d] -= 1
                if (k, d) in credit_waits:
                    credit_waits.pop((k, d)).fire(machine.now)
                yield ("work", unpack_s[flat[n]], ("drafter", d))
            if d == 0:
                waited[0] += machine.now - started
            yield ("wait", barrier.arrive((step, "weight")))  # the step's Σw all-reduce
            yield ("work", float(sum(drafter_s[flat[n]] for n in numbers)) + step_s, ("drafter", d))
            yield ("wait", barrier.arrive((step, "gradients")))

    for d in range(drafters):
        machine.start(drafter(d))
    for k in range(target_ranks):
        machine.start(target(k))
    machine.run()
    epoch = machine.now
    busy = sum(v for key, v in machine.busy.items() if key[0] == "target") / target_ranks
    return Simulated(epoch, float(plan.tokens_per_step()[:steps].sum()), busy / epoch if epoch > 0 else float("nan"),
                     waited[0] / epoch if epoch > 0 else float("nan"))
