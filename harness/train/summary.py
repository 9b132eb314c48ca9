"""A run's summary (``summary.json`` and the W&B run summary), and the per-run averages of its step records.

:func:`step_averages` is the one definition of a run's averages over its steps (throughput over step time,
padding, gradient diversity over the measured steps, the plan's lag-1 ACF and recurrence over epochs...):
the trainer's summary and the report (:func:`analysis.compare.run_metrics`) both call it, so the two never
disagree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.train.metrics import METRICS_FILE, read_metrics


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
    * ``grad_diversity`` = mean over the measured steps (``grad_stats_measured``), ``grad_noise_scale`` = the
      last measured value;
    * ``lag1_acf`` = mean over epochs of the plan's lag-1 ACF of step mean length; ``recurrence`` = mean over
      epochs of ``recurrence`` (default :func:`recurrence_key`), ``recurrence_kind`` = step or micro-batch;
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
        "grad_noise_scale": noise[-1] if noise else math.nan,
        "lag1_acf": _mean(r.get("plan_lag1_acf") for r in records),
        "recurrence": _mean(r.get(recurrence) for r in records),
        "recurrence_kind": "step" if recurrence == "plan_step_recurrence" else "micro-batch",
        "rank_imbalance": _mean(r.get("rank_imbalance") for r in records),
        "data_wait_fraction": _mean(r.get("data_wait_fraction") for r in records),
        "drafter_block_efficiency": _mean(r.get("drafter_block_efficiency") for r in records),
        "peak_memory_mb": _mean(r.get("peak_memory_mb") for r in records),
        "final_loss": losses[0] if losses else math.nan,
        "clip_fraction": _mean(float(_truthy(r.get("grad_clipped"))) for r in records if "grad_clipped" in r),
    }


def _truthy(value: Any) -> bool:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    return bool(value)


def run_summary(*, config: Any, world_size: int, data: Any, state: Any, interrupted: bool, wall_time: float,
                seen_at_most_once: bool, extra: dict[str, Any], run_dir: Path | None) -> dict[str, Any]:
    """The run's summary: what it was, what it saw, whether every sample was seen exactly once, its last eval,
    ``extra`` (the components' own entries) and, given ``run_dir`` (rank 0), the :func:`step_averages` of its
    ``metrics.jsonl``."""
    summary = {
        "status": "interrupted" if interrupted else "complete",
        "strategy": config.strategy_name, "seed": config.seed, "group": config.group, "name": config.name,
        "world_size": world_size, "grad_accum": config.trainer.grad_accum, "max_tokens": data.budget.max_tokens,
        "layout": data.strategy.layout, "tokens_seen": state.tokens_seen, "samples_seen": state.samples_seen,
        "steps": state.global_step, "epochs": state.tokens_seen / data.epoch_tokens, "epoch_tokens": data.epoch_tokens,
        "stop_tokens": data.total_tokens, "step_tokens": config.trainer.step_tokens, "stop_steps": data.total_steps,
        "tokens_per_second": state.tokens_seen / state.train_time_s if state.train_time_s else math.nan,
        "train_time_s": state.train_time_s, "wall_time_s": wall_time,
        "padding_ratio": 1.0 - state.tokens_seen / state.computed_slots if state.computed_slots else 0.0,
        "samples_seen_once": all(state.epochs_exactly_once) and seen_at_most_once,
        "epochs_exactly_once": state.epochs_exactly_once,
        "train_samples": int(data.train_rows.size), "heldout_samples": int(data.heldout_rows.size),
        "dropped_no_anchor": int(data.train_report.dropped_no_anchor.size),
        "dropped_oversize": data.oversize_dropped, "truncated_oversize": data.oversize_truncated,
        "data_fingerprint": data.samples.fingerprint, "plan_fingerprint": data.fingerprint,
    }
    summary.update(state.last_eval)
    summary.update(extra)
    if run_dir is not None and (Path(run_dir) / METRICS_FILE).exists():
        records = read_metrics(run_dir)
        if records:
            summary.update(step_averages(records))
    return summary
