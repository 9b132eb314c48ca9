"""``batchlab-plan``'s work (:mod:`harness.cli.plan` is the command): the strategies and their options chosen, every
strategy's epochs planned and measured (:func:`compare_strategies`), and the advice drawn from the rows.

No torch on this import path: the command starts in well under a second.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from strategies import CliOption, CostModel, Plan

# Samples planned once per strategy before timing, so one-off compilation is not timed.
WARMUP_SAMPLES = 4096


class BadInput(ValueError):
    """A command-line value the command cannot use."""


class _NotGiven:
    def __repr__(self) -> str:
        return "NOT_GIVEN"


#: value of a strategy flag left out (the strategy's own default applies)
NOT_GIVEN: Any = _NotGiven()


def strategy_flags() -> dict[str, list[tuple[str, CliOption]]]:
    """Every flag the registered strategies declare (``Strategy.cli_options``), with the strategies declaring it."""
    import strategies

    flags: dict[str, list[tuple[str, CliOption]]] = {}
    for name in strategies.available_strategies():
        for option in strategies.strategy_class(name).cli_options:
            flags.setdefault(option.flag, []).append((name, option))
    return flags


def flag_dest(flag: str) -> str:
    """The attribute of the parsed arguments a strategy's ``--flag`` sets."""
    return flag[2:].replace("-", "_")


def strategy_options_from_args(args: argparse.Namespace, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The options of each strategy in ``names`` set by the flags given; every given flag is checked, whatever
    ``names`` holds."""
    options: dict[str, dict[str, Any]] = {name: {} for name in names}
    for flag, declared in strategy_flags().items():
        given = getattr(args, flag_dest(flag), NOT_GIVEN)
        if given is NOT_GIVEN:
            continue
        for name, option in declared:
            try:
                value = option.value(given)
            except ValueError as err:
                raise BadInput(f"{flag} {err}") from None
            if name in options:
                options[name][option.field] = value
    return options


def select_strategies(text: str | None, available: Sequence[str]) -> list[str]:
    """``--strategies``: the requested names, checked against the registry."""
    if text is None:
        return list(available)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in available]
    if unknown or not names:
        raise BadInput(
            f"--strategies {text!r}: unknown strategy {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(available)}"
        )
    return names


def compare_strategies(
    lengths: np.ndarray, args: argparse.Namespace, names: list[str], show_progress: bool | None
) -> list[dict[str, Any]]:
    """Plan ``args.epochs`` epochs per strategy and return one metrics dict per strategy."""
    from tqdm import tqdm

    import strategies

    budget = strategies.Budget(args.max_tokens, args.max_samples)
    cost_model = _cost_model(args)
    balance = strategies.RankBalance(cost_model=cost_model, window_steps=args.balance_window) if args.balance else None
    common = dict(
        seed=args.seed,
        world_size=args.world_size,
        grad_accum=args.grad_accum,
        oversize=args.oversize,
        balance=balance,
        step_tokens=args.step_tokens,
    )
    strategy_options = strategy_options_from_args(args, names)

    rows = []
    progress = tqdm(
        total=len(names) * args.epochs,
        desc="planning",
        unit=" epochs",
        file=sys.stderr,
        disable=None if show_progress is None else not show_progress,
        leave=False,
    )
    with progress:
        for name in names:
            options = strategy_options[name]
            progress.set_postfix_str(name)
            # Warm-up: compiles the strategy's kernels so the timed epochs measure planning only. The
            # sample is clipped to the budget: under --oversize drop a prefix of only oversize samples
            # would otherwise be refused ("left no sample") although the whole dataset plans fine.
            warmup_lengths = np.minimum(lengths[:WARMUP_SAMPLES], budget.max_tokens)
            strategies.plan(warmup_lengths, budget, strategy=name, epoch=0, **common, **options)
            epoch_metrics: list[dict[str, Any]] = []
            seconds: list[float] = []
            previous = None
            for epoch in range(args.epochs):
                started = time.perf_counter()
                current = strategies.plan(lengths, budget, strategy=name, epoch=epoch, **common, **options)
                seconds.append(time.perf_counter() - started)
                if previous is not None:
                    epoch_metrics.append(_metrics(previous, current, args, cost_model))
                previous = current
                progress.update(1)
            epoch_metrics.append(_metrics(previous, None, args, cost_model))
            row = _summarise(name, epoch_metrics, seconds, args)
            options = dict(previous.info.get("options", {}))
            row["options"] = options
            row["recurrence_bound"] = options.get("max_recurrence")
            if previous.info.get("edges") is not None:
                row["buckets"] = len(previous.info["edges"])
            rows.append(row)
    return rows


def _metrics(plan: Plan, next_plan: Plan | None, args: argparse.Namespace, cost_model: CostModel) -> dict[str, Any]:
    from strategies.metrics import plan_metrics

    return plan_metrics(plan, next_epoch_plan=next_plan, acf_lags=args.acf_lags, cost_model=cost_model)


def _cost_model(args: argparse.Namespace) -> CostModel:
    from strategies import CostModel

    defaults = CostModel()
    return CostModel(
        a=defaults.a if args.cost_a is None else args.cost_a,
        b=defaults.b if args.cost_b is None else args.cost_b,
        c=defaults.c if args.cost_c is None else args.cost_c,
        block_size=defaults.block_size if args.block_size is None else args.block_size,
        num_anchors=defaults.num_anchors if args.num_anchors is None else args.num_anchors,
    )


def _summarise(
    name: str, epoch_metrics: list[dict[str, Any]], seconds: list[float], args: argparse.Namespace
) -> dict[str, Any]:
    row = dict(epoch_metrics[0])
    row["strategy"] = name
    for key in ("recurrence", "step_recurrence"):
        pairs = [m[key] for m in epoch_metrics[:-1]]
        finite_pairs = [value for value in pairs if not math.isnan(value)]
        row[key] = float(np.mean(finite_pairs)) if finite_pairs else float("nan")
        row[f"{key}_per_epoch"] = pairs
    row["padding_efficiency_per_epoch"] = [m["padding_efficiency"] for m in epoch_metrics]
    row["samples_seen_once"] = all(m["samples_seen_once"] for m in epoch_metrics)
    row["plan_seconds"] = statistics.median(seconds)
    row["plan_seconds_per_epoch"] = seconds
    row["epochs"] = args.epochs
    row["seed"] = args.seed
    row.pop("epoch", None)
    return row


def jsonable(value: Any) -> Any:
    """NaN and infinities become null (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [jsonable(item) for item in value]
    return value


def advice(rows: list[dict[str, Any]]) -> list[str]:
    """One line per strategy whose recurrence exceeds its bound, and one when length_grouped wins.

    A strategy's bound is its ``max_recurrence`` option (``recurrence_bound`` in the row).
    """
    lines = []
    for row in rows:
        bound, value = row.get("recurrence_bound"), row.get("recurrence")
        if bound is None or value is None or (isinstance(value, float) and math.isnan(value)) or value <= bound:
            continue
        lines.append(
            f"warning: {row['strategy']} recurrence {value:.3f} exceeds its bound max_recurrence={bound:g} "
            f"(micro-batch partners repeat between epochs); use fewer buckets (--num-buckets), the dp edges "
            f"(--edges dp), or the packed strategy"
        )
    by_name = {row["strategy"]: row for row in rows}
    bucketed, grouped = by_name.get("bucketed"), by_name.get("length_grouped")
    if bucketed and grouped:
        try:
            wins = grouped["padding_efficiency"] > bucketed["padding_efficiency"] and (
                grouped["recurrence"] <= bucketed["recurrence"] or math.isnan(bucketed["recurrence"])
            )
        except TypeError:
            wins = False
        if wins:
            lines.append(
                f"note: length_grouped pads less than bucketed here ({grouped['padding_efficiency']:.1%} vs "
                f"{bucketed['padding_efficiency']:.1%}) at no higher recurrence ({grouped['recurrence']:.4f} vs "
                f"{bucketed['recurrence']:.4f}); prefer it unless rank balance matters (rank imbalance "
                f"{grouped['rank_imbalance']:.3f} vs {bucketed['rank_imbalance']:.3f}; docs/design/which-strategy.md)"
            )
    return lines
