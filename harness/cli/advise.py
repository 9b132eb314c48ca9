"""``batchlab-advise``: which strategy, at what real tokens/s, finishing when — on this data, machine and world size.

    batchlab-advise --lengths my_dataset/ --max-tokens 16384 --world-size 8 --tokens 2e9
    batchlab-advise --profile chat-902k --max-tokens 16384 --world-size 8 --json
    batchlab-advise --lengths data.jsonl --max-tokens 2048 --target tiny --drafter tiny --report-dir advice/
    batchlab-advise --lengths sharegpt.json --tokenizer SmolLM2.gguf --bad-rows drop --max-tokens 4096
    batchlab-advise --lengths data.jsonl --max-tokens 2048 --drafter multirun/strategies/strategy=packed,seed=0
    batchlab-advise --experiment reference_8gpu --set target.num_hidden_layers=4 --device cuda --dtype bf16 \
        --profile chat-902k --max-tokens 16384 --world-size 8

1. Calibrates the step-cost model on this machine (:mod:`harness.advise.calibrate`: the run's own target
   forward and drafter step timed on a design of shapes, cached per machine, device, dtype, budget and
   configs; ``--recalibrate`` measures again).
2. Predicts for every strategy (:mod:`harness.advise.predict`): real tokens/s, time per epoch and to
   ``--tokens``, beside padding, recurrence, step recurrence, length-mix excess and rank imbalance; on two
   or more ranks, every split into target and drafter ranks against colocated (:mod:`harness.advise.stages`,
   on the target and drafter stages calibrated apart). On several GPUs, ``--allreduce-gbps`` adds the drafter's
   gradient all-reduce to every step (one GPU's calibration cannot time it; without it, a note says so).
3. Recommends in one paragraph, with what a finished sweep measured (``--sweep DIR``: only the differences
   the report's Holm-corrected tests keep). ``--json`` prints it all; ``--report-dir`` adds a figure (predicted
   tokens/s against recurrence, one point per strategy) and ``advice.json``.

Bad input is one line on stderr and exit status 2 (``--verbose``: and its traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.cli.process_exit import exits_fast
from harness.cli.data_options import add_tokenizer_options, named_as_flags
from harness.command_errors import OneLineParser, add_verbose, at_least, one_line_errors

#: trainer settings this command sets from its own options
OWN_OPTIONS = {"trainer.max_tokens": "--max-tokens", "trainer.device": "--device", "trainer.precision": "--dtype",
               "trainer.nproc": "--world-size"}


#: the prediction table: (title, Prediction field, width); docs/commands/batchlab-advise.md explains each (a test
#: keeps it so)
TABLE_COLUMNS = (("strategy", "strategy", 16), ("tokens/s", "tokens_per_second", 11), ("epoch", "epoch_seconds", 10),
                 ("steps", "steps", 7), ("padding", "padding_pct", 9), ("recur.", "recurrence", 8),
                 ("step rec.", "step_recurrence", 10), ("mix exc.", "length_mix_excess", 9),
                 ("imbal.", "rank_imbalance", 8), ("to --tokens", "seconds_to_budget", 13))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="batchlab-advise", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", metavar="PATH", help="dataset (save_to_disk, .parquet, .jsonl, .npy, .txt)")
    source.add_argument("--profile", metavar="NAME", help="bundled length profile, e.g. chat-902k")
    parser.add_argument("--column", help="column holding the lengths or token lists")
    add_tokenizer_options(parser)
    parser.add_argument("--split", help="split of a saved DatasetDict")
    parser.add_argument("--max-tokens", type=at_least(int, 64), required=True, help="token slots per micro-batch")
    parser.add_argument("--world-size", type=at_least(int, 1), default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--grad-accum", type=at_least(int, 1), default=1, help="micro-batches per step (default 1)")
    parser.add_argument("--step-tokens", type=at_least(int, 1), default=None, help="equal-token steps of this size")
    parser.add_argument("--strategies", default=None, help="comma-separated (default: all)")
    parser.add_argument("--target", default=None,
                        help="conf/target/ option (default tiny), or a target checkpoint directory")
    parser.add_argument("--experiment", default=None,
                        help="conf/experiment/ option whose target, drafter and trainer settings to calibrate (e.g. "
                             "reference_8gpu; its placement is modelled, not used)")
    parser.add_argument("--drafter", default=None,
                        help="conf/drafter/ option (default tiny), or a batchlab-train run directory (its drafter)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a batchlab-train override of the target, drafter or trainer config, repeatable (e.g. "
                             "--set drafter.num_hidden_layers=5 --set target.num_hidden_layers=4)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--tokens", type=lambda t: int(float(t)), default=None, help="token budget: time to reach it")
    parser.add_argument("--allreduce-gbps", type=float, default=None, metavar="BUSBW",
                        help="cuda: the GPUs' all-reduce bus bandwidth in GB/s (nccl-tests' busbw): adds the drafter's "
                             "gradient all-reduce to every step, not overlapped with the backward (at most what it "
                             "costs; one GPU's calibration cannot time it)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the plans (default 0)")
    parser.add_argument("--max-recurrence", type=float, default=0.1, help="the recommendation's recurrence bound")
    parser.add_argument("--sweep", nargs="+", metavar="SWEEP_DIR",
                        help="a batchlab-train -m sweep of these strategies: its measured differences (only those "
                             "the report's Holm-corrected tests keep) join the recommendation")
    parser.add_argument("--recalibrate", action="store_true", help="measure again, even with a cached calibration")
    parser.add_argument("--json", action="store_true", help="print everything as JSON")
    parser.add_argument("--report-dir", help="also write advice.json and the figure here")
    parser.add_argument("--cache-dir", default=None, help="default $BATCHLAB_CACHE or ~/.cache/batchlab")
    add_verbose(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return one_line_errors("batchlab-advise", lambda: _with_flags(args), verbose=args.verbose)


def _with_flags(args: argparse.Namespace) -> int:
    """:func:`advise`, its bad input naming this command's options where it names the settings they set."""
    try:
        return advise(args)
    except ValueError as error:
        message = named_as_flags(str(error))
        if message == str(error):
            raise
        raise ValueError(message) from error


def advise(args: argparse.Namespace) -> int:
    import numpy as np

    import strategies
    from harness.advise import advice
    from harness.advise.predict import recommendation
    from harness.plan_comparison import select_strategies

    models = advice.model_overrides(args)
    advice.check_device(args)
    names = select_strategies(args.strategies, strategies.available_strategies())
    lengths, words = advice.read_lengths(args)
    if words:
        print(f"batchlab-advise: {words}", file=sys.stderr)
    over = advice.oversize(lengths, args.max_tokens)
    check_sets(args.overrides)
    config = advice.run_config(args, models)
    calibration, measured, cache_dir = advice.calibrate_here(config, args, models.target_name)
    predictions, allreduce_note = advice.predict_strategies(config, args, lengths, names, calibration, cache_dir)
    paragraph = recommendation(predictions, args.max_recurrence)
    if args.sweep:
        from analysis.compare import measured_evidence

        paragraph += " " + measured_evidence(args.sweep)
    notes = [allreduce_note] if allreduce_note else []
    if over:
        notes.append(advice.oversize_note(over, lengths, args.max_tokens))
    result = {"calibration": {**calibration.to_json(), "measured_now": measured},
              "predictions": [p.as_dict() for p in predictions], "recommendation": paragraph, "notes": notes,
              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "verbose")}}
    if args.report_dir:
        _write_report(Path(args.report_dir), result, predictions)
    if args.json:
        print(json.dumps(result, indent=2, default=float))
        return 0
    print_advice(args, calibration, measured, predictions)
    print(paragraph)
    for note in notes:
        print(note)
    if np.isfinite(calibration.worst_error()) and calibration.worst_error() > 0.25:
        print(f"note: the calibration fits one shape {100 * calibration.worst_error():.0f}% off: a busy machine? "
              "--recalibrate on a quiet one", file=sys.stderr)
    return 0


def check_sets(overrides: list[str]) -> None:
    """``--set KEY=VALUE``: a target., drafter. or trainer. setting that exists and that no option of this command
    sets."""
    from harness.cli.overrides import check_override

    for override in overrides:
        key = override.split("=", 1)[0]
        if not key.startswith(("target.", "drafter.", "trainer.")) or "=" not in override:
            raise ValueError(f"--set {override}: give KEY=VALUE with a target., drafter. or trainer. key, e.g. "
                             "--set drafter.num_hidden_layers=5")
        if key in OWN_OPTIONS:
            raise ValueError(f"--set {override}: {key} is this command's {OWN_OPTIONS[key]}; use that option")
        problem = check_override(override)  # batchlab-train's own check: the setting exists, or a did-you-mean
        if problem:
            raise ValueError(f"--set {problem}")


def print_advice(args: argparse.Namespace, calibration: Any, measured: bool, predictions: list) -> None:
    """The calibration in one line, then the prediction table and the placements."""
    vocabulary = "" if calibration.vocab_size is None else f", vocabulary {int(calibration.vocab_size):,}"
    print(f"calibration ({'measured now' if measured else 'cached'}; {calibration.machine['cpu']}, "
          f"{args.device}, {args.dtype}{vocabulary}): a={calibration.a:.3g} s/slot, b={calibration.b:.3g} s/len², "
          f"c={calibration.c:.3g} s/block, {1e3 * calibration.micro_batch_s:.2f} ms a micro-batch, "
          f"{1e3 * calibration.step_s:.2f} ms a step; worst fit error {100 * calibration.worst_error():.0f}% "
          f"over {len(calibration.shapes)} shapes")
    print("".join(f"{title:<{width}}" if title == "strategy" else f"{title:>{width}}"
                  for title, _, width in TABLE_COLUMNS if title != "to --tokens" or args.tokens))
    for p in predictions:
        row = (f"{p.strategy:<16}{p.tokens_per_second:>11,.0f}{_duration(p.epoch_seconds):>10}{p.steps:>7}"
               f"{p.padding_pct:>8.1f}%{p.recurrence:>8.2f}{p.step_recurrence:>10.2f}{p.length_mix_excess:>9.3f}"
               f"{p.rank_imbalance:>8.2f}")
        print(row + (f"{_duration(p.seconds_to_budget):>13}" if args.tokens else ""))
    _print_placements(predictions, args.world_size)


def _print_placements(predictions: list, world_size: int) -> None:
    """Colocated against every target/drafter split (tokens/s relative to colocated, target ranks busy)."""
    labels = [row["split"] for row in (predictions[0].placement or {}).get("splits", [])] if predictions else []
    if not labels:
        return
    simulated = (predictions[0].placement or {}).get("simulated", False)
    print(f"placement on {world_size} ranks, target + drafter ranks (× colocated, target ranks busy; "
          + ("simulated: the link's protocol and measured costs):" if simulated else
             "modelled on the stage fits, an upper bound: perfect overlap, transfers left out):"))
    print(f"{'strategy':<16}" + "".join(f"{label:>15}" for label in labels) + f"{'best':>11}")
    for p in predictions:
        cells = "".join(f"{r['vs_colocated']:>7.2f}× ({100 * r['target_busy']:>3.0f}%)" for r in p.placement["splits"])
        print(f"{p.strategy:<16}{cells}{p.placement['best']:>11}")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def _write_report(out: Path, result: dict, predictions: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "advice.json").write_text(json.dumps(result, indent=2, default=float))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for p in predictions:
        ax.scatter(p.recurrence, p.tokens_per_second, s=40)
        ax.annotate(p.strategy, (p.recurrence, p.tokens_per_second), textcoords="offset points", xytext=(5, 4),
                    fontsize=9)
    ax.set(xlabel="composition recurrence between epochs (lower: more diverse)",
           ylabel="predicted real tokens/s", title="Predicted throughput against diversity")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "advice.png", dpi=150)
    plt.close(fig)


if __name__ == "__main__":
    exits_fast(main)()
