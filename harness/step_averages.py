"""A run's averages over its step records: the one definition that the trainer's summary (``summary.json``) and
the report (:func:`analysis.compare.run_metrics`) both call, so the two never disagree. It sits below both:
the report reads run files and never imports the trainer."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _finite(values: Any) -> list[float]:
    out = []
    for value in values:
        if isinstance(value, (bool, np.bool_)) or value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out.append(number)
    return out


def _mean(values: Any) -> float:
    found = _finite(values)
    return float(np.mean(found)) if found else math.nan


def recurrence_key(records: Sequence[Mapping[str, Any]]) -> str:
    """``plan_step_recurrence`` where the records have it, else ``plan_recurrence`` (micro-batch level)."""
    return "plan_step_recurrence" if _finite(r.get("plan_step_recurrence") for r in records) else "plan_recurrence"


def step_averages(records: Sequence[Mapping[str, Any]], recurrence: str | None = None) -> dict[str, Any]:
    """A run's averages over its step records (``metrics.jsonl`` lines, or a history's rows; NaN = not logged).

    * ``step_tokens_per_second`` = Σ real tokens / Σ step time; ``step_time_sum_s`` = Σ step time;
      ``padding_pct`` = 100 · (1 − Σ real tokens / Σ computed slots);
    * ``grad_diversity`` (Yin's Δ at the step's weight) and ``grad_sample_diversity`` (``1 + B_simple``, no step
      size in it) = means over the measured steps (``grad_stats_measured``), ``grad_noise_scale`` = the last
      measured value;
    * ``lag1_acf`` = mean over epochs of the plan's lag-1 ACF of step mean length; ``recurrence`` = mean over
      epochs of ``recurrence`` (default :func:`recurrence_key`), ``recurrence_kind`` = step or micro-batch;
      ``length_mix_excess`` = mean over epochs of the plan's step length-mix excess over random steps (the
      diversity figure: 0 when steps mix lengths as random steps do);
    * ``rank_imbalance``, ``data_wait_fraction``, ``drafter_block_efficiency``, ``peak_memory_mb`` = means over
      steps; ``final_loss`` = the last step's training loss; ``clip_fraction`` = the share of steps whose
      gradient norm was clipped.
    """
    recurrence = recurrence or recurrence_key(records)
    real = sum(_finite(r.get("real_tokens") for r in records))
    slots = sum(_finite(r.get("computed_slots") for r in records))
    step_time = sum(_finite(r.get("step_time") for r in records))
    measured = [r for r in records if _truthy(r.get("grad_stats_measured"))]
    noise = _finite(r.get("grad_noise_scale") for r in measured)
    losses = _finite(r.get("loss") for r in records[-1:])
    return {
        "step_tokens_per_second": real / step_time if step_time > 0 else math.nan,
        "step_time_sum_s": step_time,
        "padding_pct": 100.0 * (1.0 - real / slots) if slots > 0 else math.nan,
        "grad_diversity": _mean(r.get("grad_diversity") for r in measured),
        "grad_sample_diversity": _mean(_sample_diversity(r) for r in measured),
        "grad_noise_scale": noise[-1] if noise else math.nan,
        "lag1_acf": _mean(r.get("plan_lag1_acf") for r in records),
        "recurrence": _mean(r.get(recurrence) for r in records),
        "recurrence_kind": "step" if recurrence == "plan_step_recurrence" else "micro-batch",
        "length_mix_excess": _mean(r.get("plan_length_mix_excess") for r in records),
        "rank_imbalance": _mean(r.get("rank_imbalance") for r in records),
        "data_wait_fraction": _mean(r.get("data_wait_fraction") for r in records),
        "drafter_block_efficiency": _mean(r.get("drafter_block_efficiency") for r in records),
        "peak_memory_mb": _mean(r.get("peak_memory_mb") for r in records),
        "final_loss": losses[0] if losses else math.nan,
        "clip_fraction": _mean(float(_truthy(r.get("grad_clipped"))) for r in records if "grad_clipped" in r),
    }


def _sample_diversity(record: Mapping[str, Any]) -> Any:
    """A measured step's ``grad_sample_diversity``; a record from before the key existed: 1 + its noise scale."""
    if "grad_sample_diversity" in record:
        return record["grad_sample_diversity"]
    scale = _finite([record.get("grad_noise_scale")])
    return 1.0 + scale[0] if scale else None


def _truthy(value: Any) -> bool:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    return bool(value)
