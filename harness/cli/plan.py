"""``batchlab-plan``: plan epochs of a dataset's lengths under each strategy and compare the plans.

Reads lengths (``--lengths PATH`` or ``--profile NAME``), plans ``--epochs`` epochs with every
strategy in ``--strategies`` under one budget, and prints one row per strategy: padding
efficiency, micro-batches, steps, lag-1 ACF of the step mean length, composition recurrence
between consecutive epochs per micro-batch and per optimizer step, length-mix excess over its
random baseline, rank imbalance, relative step cost, planning time and the exactly-once check
(definitions: ``docs/design/metrics.md`` and ``strategies.metrics``). A strategy whose recurrence exceeds
its bound (bucketed's ``max_recurrence``) gets a one-line warning on stderr, and a note says when
``length_grouped`` pads less than ``bucketed`` at no higher recurrence. ``--json`` prints the same
as a JSON list, one object per strategy; ``--report-dir`` adds a figure and a markdown report
(``analysis.plan_report``). Bad input prints one line on stderr and exits with 2. A strategy's own
options (bucketed's ``--num-buckets``, ...) are the flags it declares (``Strategy.cli_options``).

No torch on this import path: the command starts in well under a second.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from harness.cli.data_options import add_tokenizer_options, named_as_flags
from harness.command_errors import OneLineParser, add_verbose, describe, full_errors

if TYPE_CHECKING:
    from strategies import CliOption, CostModel, Plan

EXIT_BAD_INPUT = 2
# Inputs at least this large show a progress bar on stderr (when stderr is a terminal).
PROGRESS_MIN_SAMPLES = 100_000
# Samples planned once per strategy before timing, so one-off compilation is not timed.
WARMUP_SAMPLES = 4096


class BadInput(ValueError):
    """A command-line value the command cannot use."""


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    parser = OneLineParser(
        prog="batchlab-plan",
        description="Plan epochs of a dataset's sample lengths under each batching strategy and "
        "compare padding efficiency, diversity and balance (no training).",
        epilog="Reported per strategy: metrics of epoch 0, except recurrence (mean over consecutive "
        "epoch pairs), plan_seconds (median over epochs, after a warm-up on a few samples) and "
        "samples_seen_once (all epochs). Every column of the table is explained in "
        "docs/commands/batchlab-plan.md.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--lengths",
        metavar="PATH",
        help="dataset saved with save_to_disk, .parquet, .jsonl, .npy or .txt (one length per line)",
    )
    source.add_argument("--profile", metavar="NAME", help="bundled length profile, e.g. chat-902k")
    parser.add_argument("--column", help="column holding the lengths or token lists (default: input_ids, length, ...)")
    add_tokenizer_options(parser)
    parser.add_argument("--split", help="split of a saved DatasetDict")
    parser.add_argument("--max-tokens", type=int, default=16384, help="token slots per micro-batch (default 16384)")
    parser.add_argument("--max-samples", type=int, default=None, help="cap on samples per micro-batch")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--grad-accum", type=int, default=1, help="accumulation micro-batches per step (default 1)")
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=None,
        help="equal-token steps: every optimizer step carries about this many real tokens, its micro-batches "
        "varying as needed (needs --grad-accum 1)",
    )
    parser.add_argument("--strategies", default=None, help="comma-separated strategy names (default: all)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs to plan; >= 2 measures recurrence (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every plan (default 0)")
    add_strategy_flags(parser)
    parser.add_argument(
        "--oversize", choices=("error", "truncate", "drop"), default="error", help="samples longer than --max-tokens"
    )
    parser.add_argument("--balance", action="store_true", help="balance rank cost inside each step")
    parser.add_argument(
        "--balance-window",
        type=int,
        default=1,
        help="with --balance: also regroup micro-batches between this many consecutive steps (default 1: off)",
    )
    parser.add_argument("--cost-a", type=float, default=None, help="cost model: weight of computed slots")
    parser.add_argument("--cost-b", type=float, default=None, help="cost model: weight of sum(len^2)")
    parser.add_argument("--cost-c", type=float, default=None, help="cost model: weight of one drafter block (0: target only)")
    parser.add_argument("--block-size", type=int, default=None, help="cost model: drafter block size (default 16)")
    parser.add_argument("--num-anchors", type=int, default=None, help="cost model: most drafter anchors per sample (default 512)")
    parser.add_argument("--acf-lags", type=int, default=8, help="autocorrelation lags (default 8)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per strategy")
    parser.add_argument(
        "--report-dir",
        metavar="DIR",
        default=None,
        help="also write plan_metrics.csv, plan_metrics.json, plan_tradeoff.png and plan_report.md into DIR",
    )
    add_verbose(parser)
    return parser


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


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_strategy_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per strategy option declared in the registry (a flag several strategies declare: once)."""
    for flag, declared in strategy_flags().items():
        option = declared[0][1]
        if option.is_switch:
            parser.add_argument(flag, dest=_dest(flag), action="store_const", const=option.const, default=NOT_GIVEN,
                                help=option.help)
        else:
            parser.add_argument(flag, dest=_dest(flag), type=option.type, default=NOT_GIVEN, help=option.help)


def strategy_options_from_args(args: argparse.Namespace, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The options of each strategy in ``names`` set by the flags given; every given flag is checked, whatever
    ``names`` holds."""
    options: dict[str, dict[str, Any]] = {name: {} for name in names}
    for flag, declared in strategy_flags().items():
        given = getattr(args, _dest(flag), NOT_GIVEN)
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


def _jsonable(value: Any) -> Any:
    """NaN and infinities become null (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    return value


TABLE_COLUMNS = (
    ("strategy", "strategy", "{}"),
    ("efficiency", "padding_efficiency", "{:.1%}"),
    ("micro-batches", "micro_batches", "{:,}"),
    ("steps", "steps", "{:,}"),
    ("tok/step cv", "step_tokens_cv", "{:.3f}"),
    ("mb/step", "micro_batches_per_step_mean", "{:.2f}"),
    ("lag-1 ACF", "lag1_acf", "{:+.3f}"),
    ("recurrence", "recurrence", "{:.3f}"),
    ("step rec.", "step_recurrence", "{:.3f}"),
    ("mix excess", "length_mix_excess", "{:+.3f}"),
    ("streak", "longest_bucket_streak", "{}"),
    ("rank imb.", "rank_imbalance", "{:.3f}"),
    ("drafter imb.", "drafter_imbalance", "{:.3f}"),
    ("rel. cost", "relative_step_cost", "{:.3f}"),
    ("plan s", "plan_seconds", "{:.3f}"),
    ("exactly once", "samples_seen_once", "{}"),
)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width text table, one row per strategy (``-`` where a value is undefined)."""
    cells = [[title for title, _, _ in TABLE_COLUMNS]]
    for row in rows:
        line = []
        for _, key, fmt in TABLE_COLUMNS:
            value = row.get(key)
            undefined = value is None or (isinstance(value, float) and math.isnan(value))
            line.append("-" if undefined else fmt.format("yes" if value is True else "NO" if value is False else value))
        cells.append(line)
    widths = [max(len(line[i]) for line in cells) for i in range(len(TABLE_COLUMNS))]
    rendered = []
    for number, line in enumerate(cells):
        rendered.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
        if number == 0:
            rendered.append("  ".join("-" * w for w in widths))
    return "\n".join(rendered)


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


def _fail(message: str) -> int:
    print(f"batchlab-plan: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # argparse already printed the usage error
        return int(exit_request.code or 0)

    import strategies
    from harness.data.lengths import LengthsSourceError, user_lengths

    if args.epochs < 1:
        return _fail(f"--epochs {args.epochs} must be at least 1 (2 or more to measure recurrence)")
    if args.balance_window != 1 and not args.balance:
        return _fail(f"--balance-window {args.balance_window} needs --balance")
    if args.acf_lags < 1:
        return _fail(f"--acf-lags {args.acf_lags} must be at least 1")
    if args.report_dir is not None:  # before any planning: a report that cannot be written fails fast
        if Path(args.report_dir).exists() and not Path(args.report_dir).is_dir():
            return _fail(f"--report-dir {args.report_dir!r} is an existing file; give a directory (created if missing)")
        try:
            Path(args.report_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return _fail(f"--report-dir {args.report_dir!r}: cannot write the report ({err})")
    try:
        names = select_strategies(args.strategies, strategies.available_strategies())
        strategy_options_from_args(args, names)  # a bad strategy flag fails before the lengths are read
        source = args.lengths if args.lengths is not None else "profile:" + args.profile
        lengths, words = user_lengths(source, column=args.column, split=args.split, tokenizer=args.tokenizer,
                                      bad_rows=args.bad_rows, progress=None if sys.stderr.isatty() else False)
        if words:
            print(f"batchlab-plan: {words}", file=sys.stderr)
        over = int((lengths > args.max_tokens).sum())
        if over and args.oversize != "error":  # said once here, not once per strategy and epoch
            left = "left out of every epoch" if args.oversize == "drop" else "cut to the budget"
            print(f"batchlab-plan: {over:,} of {lengths.size:,} samples longer than --max-tokens {args.max_tokens} "
                  f"{left} (--oversize {args.oversize}; the longest {int(lengths.max()):,})", file=sys.stderr)
        show_progress = None if lengths.size >= PROGRESS_MIN_SAMPLES else False
        validate_log = logging.getLogger("strategies.validate")
        level = validate_log.level
        validate_log.setLevel(logging.ERROR if over else level)
        try:
            rows = compare_strategies(lengths, args, names, show_progress)
        finally:
            validate_log.setLevel(level)
    except (BadInput, LengthsSourceError, strategies.LengthsError, ValueError, OSError) as err:
        if full_errors(args.verbose):
            traceback.print_exc()
        return _fail(named_as_flags(describe(err)))

    if args.json:
        print(json.dumps(_jsonable(rows), indent=2))
    else:
        print(
            f"{lengths.size:,} samples from {source}; max_tokens={args.max_tokens}, "
            f"world_size={args.world_size}, grad_accum={args.grad_accum}, epochs={args.epochs}, seed={args.seed}"
        )
        print(format_table(rows))
    for line in advice(rows):
        print(f"batchlab-plan: {line}", file=sys.stderr)
    if args.report_dir is not None:
        try:
            _write_report(rows, args, source, lengths.size)
        except OSError as err:
            return _fail(f"--report-dir {args.report_dir!r}: cannot write the report ({err})")
    return 0


def _write_report(rows: list[dict[str, Any]], args: argparse.Namespace, source: str, samples: int) -> None:
    """``--report-dir``: the comparison as JSON, CSV, a trade-off figure and a markdown report."""
    from analysis.plan_report import write_plan_report

    title = (
        f"Plan comparison: {samples:,} samples from {source}, max_tokens={args.max_tokens}, "
        f"world_size={args.world_size}, grad_accum={args.grad_accum}, seed={args.seed}"
    )
    paths = write_plan_report(_jsonable(rows), args.report_dir, title=title)
    json_path = Path(args.report_dir) / "plan_metrics.json"
    json_path.write_text(json.dumps(_jsonable(rows), indent=2))
    print(f"report: {paths['report']} (figure {paths['figure'].name}, {paths['csv'].name}, {json_path.name})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
