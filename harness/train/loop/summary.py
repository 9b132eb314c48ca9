"""A run's summary (``summary.json`` and the W&B run summary), with the averages of its step records
(:func:`harness.step_averages.step_averages`, which the report computes the same way)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.step_averages import step_averages
from harness.train.loop.metrics import METRICS_FILE, read_metrics


def run_summary(*, config: Any, world_size: int, data: Any, state: Any, interrupted: bool, wall_time: float,
                seen_at_most_once: bool, extra: dict[str, Any], run_dir: Path | None) -> dict[str, Any]:
    """The run's summary: what it was (``config``: the loop's :class:`~harness.train.loop.trainer.LoopConfig`), what
    it saw, whether every sample was seen exactly once, its last eval, ``extra`` (the components' own entries)
    and, given ``run_dir`` (rank 0), the :func:`step_averages` of its ``metrics.jsonl``."""
    summary = {
        "status": "interrupted" if interrupted else "complete",
        "strategy": config.strategy, "seed": config.seed, "group": config.group, "name": config.name,
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
        "validation_samples": int(data.validation_rows.size), "eval_split": config.eval.split,
        "dropped_no_anchor": int(data.train_report.dropped_no_anchor.size),
        "dropped_oversize": data.oversize_dropped, "truncated_oversize": data.oversize_truncated,
        "data_fingerprint": data.samples.fingerprint, "plan_fingerprint": data.fingerprint,
        "target": target_name(config.target),
    }
    summary.update(state.last_eval)
    summary.update(extra)
    if run_dir is not None and (Path(run_dir) / METRICS_FILE).exists():
        records = read_metrics(run_dir)
        if records:
            summary.update(step_averages(records))
    return summary


def target_name(pretrained: str | None) -> str:
    """The target a run trained against, in a few words (runs.csv's ``target`` column): a GGUF file's name, a
    checkpoint directory's name and model type, the embedded default's shipped hybrid, or a random-weight hybrid."""
    import json

    from harness.data import bundled
    from harness.models.causal_lm_target import is_gguf
    from harness.train.rank_models import EMBEDDED_TARGET

    if not pretrained:
        return "hybrid, random weights"
    if pretrained == EMBEDDED_TARGET:
        return "tiny hybrid pretrained on the embedded corpus"
    path = Path(pretrained)
    if is_gguf(path):
        return path.stem
    if path.resolve() == bundled.target_dir().resolve():
        return "tiny hybrid (bundled)"
    config = path / "config.json"
    model_type = json.loads(config.read_text()).get("model_type", "?") if config.is_file() else "?"
    return f"{path.name} ({model_type})"
