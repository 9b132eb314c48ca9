"""Predict every strategy's throughput from a calibration and its plans, beside what it costs in diversity.

For each strategy, epoch 0 is planned (and epoch 1, for recurrence) exactly as a run would plan it; every
rank's step time is the calibrated cost of the micro-batches it runs in the step (:class:`Calibration`), a
step waits for its slowest rank and adds the optimizer step, and the epoch's real tokens over its summed
step time is the predicted real tokens/s (the number ``batchlab-train`` reports as ``tokens_per_second``).
CPU ranks are calibrated together, their gradient all-reduce inside the measured step; a GPU calibration
times one GPU, so the drafter's gradient all-reduce across the job's GPUs is added only when its bandwidth is
given (:func:`ring_allreduce_seconds`, ``batchlab-advise --allreduce-gbps``; not overlapped with the backward,
so at most what it costs). On two or more ranks, every split of them into target and drafter ranks is modelled
too, on the calibration's separate stage fits (:mod:`harness.advise.stages`): which split balances, against
colocated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.advise.calibrate import Calibration


#: a split bounded by its slower stage (the link not measured) is recommended only this far above colocated: the
#: bound assumes perfect overlap and no transfers, and measured splits fell well short of it; a simulated split
#: (the link measured, :mod:`harness.advise.schedule`) is recommended as soon as it is faster
SPLIT_MARGIN = 1.10


@dataclass(frozen=True)
class Prediction:
    strategy: str
    tokens_per_second: float  # real tokens / predicted step time
    epoch_seconds: float
    steps: int
    micro_batches: int
    padding_pct: float
    recurrence: float
    step_recurrence: float
    length_mix_excess: float
    rank_imbalance: float
    seconds_to_budget: float | None  # the --tokens budget, None when none was given
    #: {"colocated_tokens_per_second", "splits": [{"split", "tokens_per_second", "vs_colocated", ...}], "best"}
    #: on the stage fits; None on one rank
    placement: dict | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: the gradient all-reduce's seconds a step on ``ranks`` training ranks (0 for one rank)
AllReduce = Callable[[int], float]


def no_allreduce(ranks: int) -> float:  # noqa: ARG001 - in the measured step (CPU), or not modelled
    return 0.0


def ring_allreduce_seconds(gradient_bytes: float, bus_gbps: float) -> AllReduce:
    """A ring all-reduce of ``gradient_bytes`` at ``bus_gbps`` GB/s bus bandwidth (nccl-tests' ``busbw``, which
    is defined so that the time is ``2 (N - 1) / N · bytes / busbw`` on N ranks)."""
    def seconds(ranks: int) -> float:
        return 2.0 * (ranks - 1) / ranks * gradient_bytes / (bus_gbps * 1e9) if ranks > 1 else 0.0

    return seconds


def plan_seconds(plan: Any, calibration: Calibration, allreduce: AllReduce = no_allreduce,
                 cores: float | None = None) -> np.ndarray:
    """``[steps]``: the predicted time of every optimizer step of ``plan`` (its slowest rank, plus the step and
    the gradients' all-reduce); ``cores``: CPU ranks measured a core each, more ranks than cores share them
    (every rank computing, each at ``cores / world_size`` of its speed)."""
    from strategies.balance import rank_costs

    costs = calibration.micro_batch_cost().micro_batch(plan)  # blocks capped at the drafter's max_blocks
    per_rank = rank_costs(costs.reshape(plan.num_steps, -1), plan.world_size, plan.grad_accum)
    shared = max(1.0, plan.world_size / cores) if cores else 1.0
    return (per_rank.max(axis=1) + calibration.step_s) * shared + allreduce(plan.world_size)


def predict(lengths: np.ndarray, strategies: list[str], calibration: Calibration, *, world_size: int,
            grad_accum: int = 1, step_tokens: int | None = None, seed: int = 0, tokens: int | None = None,
            strategy_options: dict[str, dict] | None = None, oversize: str = "drop",
            allreduce: AllReduce = no_allreduce, link: LinkModel | None = None,
            run_tokens: float | None = None, cores: float | None = None) -> list[Prediction]:
    """One :class:`Prediction` per strategy, in the order given (deterministic: plans are seeded); ``allreduce``
    adds the gradients' all-reduce to every step (:func:`ring_allreduce_seconds`); ``link``: the placements
    simulated (:func:`placement`), over a run's first ``run_tokens`` real tokens when given; ``cores``: CPU ranks
    calibrated a core each (:func:`calibration_ranks`), shared by more ranks than cores."""
    from strategies import Budget, build_strategy
    from strategies.metrics import plan_metrics

    budget = Budget(calibration.max_tokens)
    out = []
    for name in strategies:
        strategy = build_strategy(name, **(strategy_options or {}).get(name, {}))
        plans = [strategy.plan(lengths, budget, seed=seed, epoch=epoch, world_size=world_size, grad_accum=grad_accum,
                               oversize=oversize, step_tokens=step_tokens) for epoch in (0, 1)]
        metrics = plan_metrics(plans[0], next_epoch_plan=plans[1], cost_model=calibration.cost_model())
        seconds = float(plan_seconds(plans[0], calibration, allreduce, cores).sum())
        real = float(plans[0].lengths[plans[0].kept_indices()].sum())
        rate = real / seconds if seconds > 0 else float("nan")
        out.append(Prediction(
            strategy=name, tokens_per_second=rate, epoch_seconds=seconds, steps=plans[0].num_steps,
            micro_batches=int((plans[0].micro_batch_sizes() > 0).sum()),
            padding_pct=100.0 * (1.0 - float(metrics["padding_efficiency"])),
            recurrence=float(metrics.get("recurrence", float("nan"))),
            step_recurrence=float(metrics.get("step_recurrence", float("nan"))),
            length_mix_excess=float(metrics.get("length_mix_excess", float("nan"))),
            rank_imbalance=float(metrics.get("rank_imbalance_max", float("nan"))),
            seconds_to_budget=(tokens / rate if tokens and rate > 0 else None),
            placement=placement(plans[0], lambda w, g: strategy.plan(
                lengths, budget, seed=seed, epoch=0, world_size=w, grad_accum=g, oversize=oversize,
                step_tokens=step_tokens), calibration, allreduce, link, run_tokens)))
    return out


@dataclass(frozen=True)
class LinkModel:
    """What a split's simulation needs beyond the stage fits (:mod:`harness.advise.schedule`): the measured link
    and its settings. ``cores`` (None: a device each) is for stage costs measured a core each: batchlab-advise
    calibrates CPU ranks as many together as the job runs, up to one a core (:func:`calibration_ranks`), and
    the simulation shares the cores among the processes computing at each moment. A split's processes do not
    all compute at once (a drafter rank waiting for features leaves its core to the target ranks), so costs
    measured with every rank sharing the cores would charge them a contention the split does not have."""

    cost: Any  # harness.advise.schedule.LinkCost
    cores: float | None = None
    max_in_flight: int = 2
    dispatch: str = "dynamic"


def shared_cores(device: str) -> float | None:
    """The cores a job's CPU ranks share (this machine's), None on GPUs (a device each)."""
    import os

    return float(os.cpu_count() or 1) if device == "cpu" else None


def calibration_ranks(world_size: int, device: str, cores: int | None = None) -> int:
    """How many ranks calibrate together for a job of ``world_size`` ranks: on CPU as many as the job runs, up to
    one a core (``cores``, default :func:`shared_cores`; each with a core's share of the threads; more ranks than
    cores are simulated sharing them), on a GPU one."""
    return int(min(world_size, cores or shared_cores(device))) if device == "cpu" else 1


def placement(plan: Any, make_plan: Any, calibration: Calibration, allreduce: AllReduce = no_allreduce,
              link: LinkModel | None = None, tokens: float | None = None) -> dict | None:
    """Colocated against every target/drafter split of ``plan``'s ranks, on the stage fits (None on one rank);
    the gradients are all-reduced over the ranks that train the drafter (all of them colocated, the drafter
    ranks of a split). With ``link``, both are simulated (:mod:`harness.advise.schedule`; ``tokens``: only a run's
    first steps up to that many real tokens), else the split is bounded by its slower stage."""
    from harness.advise.stages import Split, Terms, colocated_seconds, splits

    if plan.world_size < 2:
        return None
    target, drafter = calibration.stage_costs()
    simulate: Any = None
    if link is None:
        colocated = colocated_seconds(plan, target, drafter, calibration.step_s + allreduce(plan.world_size))
        rate = float(plan.micro_batch_tokens().sum()) / colocated if colocated > 0 else float("nan")
    else:
        from harness.advise.schedule import simulate_colocated, simulate_split

        terms = Terms.of(plan, drafter.block_size, drafter.num_anchors)
        rate = simulate_colocated(plan, target.seconds(terms), drafter.seconds(terms),
                                  calibration.step_s + allreduce(plan.world_size), link.cores, tokens).tokens_per_second

        def replay(drafter_plan: Any, target_ranks: int, step_s: float) -> Split:
            terms = Terms.of(drafter_plan, drafter.block_size, drafter.num_anchors)
            run = simulate_split(drafter_plan, target.seconds(terms), drafter.seconds(terms), link.cost, target_ranks,
                                 step_s, link.cores, link.max_in_flight, link.dispatch, tokens)
            return Split(target_ranks, drafter_plan.world_size, drafter_plan.grad_accum, run.tokens,
                         run.epoch_seconds, run.target_busy, 1.0 - run.drafter_waiting)

        simulate = replay

    rows = [{"split": s.label, "target_ranks": s.target_ranks, "drafter_ranks": s.drafter_ranks,
             "drafter_grad_accum": s.drafter_grad_accum, "tokens_per_second": s.tokens_per_second,
             "vs_colocated": s.tokens_per_second / rate, "target_busy": s.target_busy, "drafter_busy": s.drafter_busy}
            for s in splits(make_plan, plan.world_size, plan.grad_accum, target, drafter,
                            lambda drafter_ranks: calibration.step_s + allreduce(drafter_ranks), simulate)]
    best = max(rows, key=lambda r: r["tokens_per_second"], default=None)
    margin = 1.0 if link is not None else SPLIT_MARGIN
    return {"colocated_tokens_per_second": rate, "splits": rows, "simulated": link is not None,
            "best": best["split"] if best and best["vs_colocated"] >= margin else "colocated"}


def recommendation(predictions: list[Prediction], max_recurrence: float = 0.1) -> str:
    """One paragraph: the fastest strategy whose recurrence stays under ``max_recurrence``, and what the most
    diverse one costs in tokens/s."""
    finite = [p for p in predictions if np.isfinite(p.tokens_per_second)]
    if not finite:
        return "No strategy could be predicted."
    diverse = [p for p in finite if np.isfinite(p.recurrence) and p.recurrence <= max_recurrence]
    fastest = max(diverse or finite, key=lambda p: p.tokens_per_second)
    most_diverse = min((p for p in finite if np.isfinite(p.recurrence)), key=lambda p: (p.recurrence, -p.tokens_per_second),
                       default=None)
    text = (f"{fastest.strategy} is the fastest strategy"
            + (f" whose batch composition recurs at most {max_recurrence:.2f} between epochs" if diverse else
               " (none keeps recurrence under the bound)")
            + f": {fastest.tokens_per_second:,.0f} predicted real tokens/s, {fastest.padding_pct:.1f}% padding, "
              f"recurrence {fastest.recurrence:.2f}.")
    if most_diverse is not None and most_diverse.recurrence < fastest.recurrence - 0.005:  # visibly more diverse
        ratio = most_diverse.tokens_per_second / fastest.tokens_per_second
        text += (f" The most diverse, {most_diverse.strategy} (recurrence {most_diverse.recurrence:.2f}), would run at "
                 f"{ratio:.2f}× its tokens/s.")
    return text + placement_sentence(fastest)


def placement_sentence(prediction: Prediction) -> str:
    """Where ``prediction``'s target and drafter should run: the split that balances, or why colocated wins."""
    rows = (prediction.placement or {}).get("splits") or []
    if not rows:
        return ""
    top = max(rows, key=lambda r: r["tokens_per_second"])
    simulated = prediction.placement.get("simulated", False)
    balance = (f"target ranks busy {100 * top['target_busy']:.0f}% of the epoch, drafter ranks "
               f"{100 * top['drafter_busy']:.0f}%; "
               + ("the link's protocol and measured costs simulated)" if simulated else
                  "an upper bound: the stages overlapping perfectly, feature transfers left out)"))
    if prediction.placement["best"] != "colocated":
        return (f" Placement: {top['target_ranks']} target + {top['drafter_ranks']} drafter ranks would run "
                f"{prediction.strategy} at {top['vs_colocated']:.2f}× colocated ({balance}.")
    under = "" if simulated else f", under the {SPLIT_MARGIN:.2f}× a split must promise"
    return (f" Placement: keep target and drafter colocated; the best split, {top['target_ranks']} target + "
            f"{top['drafter_ranks']} drafter ranks, would run at {top['vs_colocated']:.2f}×{under} ({balance}.")
