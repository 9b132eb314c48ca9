"""Predict every strategy's throughput from a calibration and its plans, beside what it costs in diversity.

For each strategy, epoch 0 is planned (and epoch 1, for recurrence) exactly as a run would plan it; every
rank's step time is the calibrated cost of the micro-batches it runs in the step (:class:`Calibration`), a
step waits for its slowest rank and adds the optimizer step, and the epoch's real tokens over its summed
step time is the predicted real tokens/s (the number ``batchlab-train`` reports as ``tokens_per_second``).
Collective communication is not modelled (on one machine it is small next to the step; on a GPU cluster
measure it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.advise.calibrate import Calibration


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

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def plan_seconds(plan: Any, calibration: Calibration) -> np.ndarray:
    """``[steps]``: the predicted time of every optimizer step of ``plan`` (its slowest rank, plus the step)."""
    from strategies.balance import rank_costs

    model = calibration.cost_model()
    costs = model.micro_batch_costs(plan.lengths, plan.sample_indices, plan.micro_batch_offsets, plan.layout,
                                    plan.budget.max_tokens)
    fixed = calibration.micro_batch_s * (plan.micro_batch_sizes() > 0)
    per_rank = rank_costs((costs + fixed).reshape(plan.num_steps, -1), plan.world_size, plan.grad_accum)
    return per_rank.max(axis=1) + calibration.step_s


def predict(lengths: np.ndarray, strategies: list[str], calibration: Calibration, *, world_size: int,
            grad_accum: int = 1, step_tokens: int | None = None, seed: int = 0, tokens: int | None = None,
            strategy_options: dict[str, dict] | None = None, oversize: str = "drop") -> list[Prediction]:
    """One :class:`Prediction` per strategy, in the order given (deterministic: plans are seeded)."""
    from strategies import Budget, build_strategy
    from strategies.metrics import plan_metrics

    budget = Budget(calibration.max_tokens)
    out = []
    for name in strategies:
        strategy = build_strategy(name, **(strategy_options or {}).get(name, {}))
        plans = [strategy.plan(lengths, budget, seed=seed, epoch=epoch, world_size=world_size, grad_accum=grad_accum,
                               oversize=oversize, step_tokens=step_tokens) for epoch in (0, 1)]
        metrics = plan_metrics(plans[0], next_epoch_plan=plans[1], cost_model=calibration.cost_model())
        seconds = float(plan_seconds(plans[0], calibration).sum())
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
            seconds_to_budget=(tokens / rate if tokens and rate > 0 else None)))
    return out


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
    return text
