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
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.cli.process_exit import exits_fast
from harness.cli.data_options import add_tokenizer_options, named_as_flags
from harness.command_errors import OneLineParser, add_verbose, describe, full_errors
from harness.plan_comparison import (
    NOT_GIVEN,
    BadInput,
    advice,
    compare_strategies,
    flag_dest,
    jsonable,
    select_strategies,
    strategy_flags,
    strategy_options_from_args,
)

EXIT_BAD_INPUT = 2
# Inputs at least this large show a progress bar on stderr (when stderr is a terminal).
PROGRESS_MIN_SAMPLES = 100_000


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
    add_plan_options(parser)
    add_verbose(parser)
    return parser


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """The budget, the layout of steps and ranks, the strategies and their flags, the cost model and the outputs."""
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


def add_strategy_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per strategy option declared in the registry (a flag several strategies declare: once)."""
    for flag, declared in strategy_flags().items():
        option = declared[0][1]
        if option.is_switch:
            parser.add_argument(flag, dest=flag_dest(flag), action="store_const", const=option.const, default=NOT_GIVEN,
                                help=option.help)
        else:
            parser.add_argument(flag, dest=flag_dest(flag), type=option.type, default=NOT_GIVEN, help=option.help)


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
    from harness.data.lengths import LengthsSourceError

    problem = check_flags(args)
    if problem:
        return _fail(problem)
    try:
        source, lengths, rows = plan_strategies(args)
    except (BadInput, LengthsSourceError, strategies.LengthsError, ValueError, OSError) as err:
        if full_errors(args.verbose):
            traceback.print_exc()
        return _fail(named_as_flags(describe(err)))
    print_rows(args, source, lengths, rows)
    if args.report_dir is not None:
        try:
            _write_report(rows, args, source, lengths.size)
        except OSError as err:
            return _fail(f"--report-dir {args.report_dir!r}: cannot write the report ({err})")
    return 0


def check_flags(args: argparse.Namespace) -> str | None:
    """The first flag the command cannot use, in one line with its fix (None: all usable); ``--report-dir`` is
    created, before any planning, so that a report that cannot be written fails fast."""
    if args.epochs < 1:
        return f"--epochs {args.epochs} must be at least 1 (2 or more to measure recurrence)"
    if args.balance_window != 1 and not args.balance:
        return f"--balance-window {args.balance_window} needs --balance"
    if args.acf_lags < 1:
        return f"--acf-lags {args.acf_lags} must be at least 1"
    if args.report_dir is not None:
        if Path(args.report_dir).exists() and not Path(args.report_dir).is_dir():
            return f"--report-dir {args.report_dir!r} is an existing file; give a directory (created if missing)"
        try:
            Path(args.report_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return f"--report-dir {args.report_dir!r}: cannot write the report ({err})"
    return None


def plan_strategies(args: argparse.Namespace) -> tuple[str, np.ndarray, list[dict[str, Any]]]:
    """The lengths' source, the lengths, and one row of metrics per strategy (:func:`compare_strategies`); what
    reading the lengths said, and the samples over the budget, are said once on stderr."""
    import strategies
    from harness.data.lengths import user_lengths

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
        return source, lengths, compare_strategies(lengths, args, names, show_progress)
    finally:
        validate_log.setLevel(level)


def print_rows(args: argparse.Namespace, source: str, lengths: np.ndarray, rows: list[dict[str, Any]]) -> None:
    """The rows as JSON or as a table under a line naming the input and the budget; the advice on stderr."""
    if args.json:
        print(json.dumps(jsonable(rows), indent=2))
    else:
        print(
            f"{lengths.size:,} samples from {source}; max_tokens={args.max_tokens}, "
            f"world_size={args.world_size}, grad_accum={args.grad_accum}, epochs={args.epochs}, seed={args.seed}"
        )
        print(format_table(rows))
    for line in advice(rows):
        print(f"batchlab-plan: {line}", file=sys.stderr)


def _write_report(rows: list[dict[str, Any]], args: argparse.Namespace, source: str, samples: int) -> None:
    """``--report-dir``: the comparison as JSON, CSV, a trade-off figure and a markdown report."""
    from analysis.plan_report import write_plan_report

    title = (
        f"Plan comparison: {samples:,} samples from {source}, max_tokens={args.max_tokens}, "
        f"world_size={args.world_size}, grad_accum={args.grad_accum}, seed={args.seed}"
    )
    paths = write_plan_report(jsonable(rows), args.report_dir, title=title)
    json_path = Path(args.report_dir) / "plan_metrics.json"
    json_path.write_text(json.dumps(jsonable(rows), indent=2))
    print(f"report: {paths['report']} (figure {paths['figure'].name}, {paths['csv'].name}, {json_path.name})", file=sys.stderr)


if __name__ == "__main__":
    exits_fast(main)()
